"""TokenButler evaluation: predictor accuracy, perplexity against the baselines, co-reference retrieval.

Three tasks, each writing records to results.json (and a table to summary.md):

  accuracy   top-50% token classification (the paper's headline predictor metric, 70-75% there): for every layer
             l >= 1, head h and query row i, the visible keys j <= i are labelled "important" when their true
             pre-softmax logit is in the row's top half (ceil(n/2) of the n visible keys), and likewise by the
             predicted logit; accuracy = the fraction of (row, key) pairs whose labels agree, averaged over layers,
             heads and rows. Rows: every `stride`-th query position from `min_row` on, of held-out windows of the
             evaluation corpus (the predictor never trained on it). Reported per layer too.
  ppl        perplexity with decode simulated per row (eval/ppl.py "decode" variant) at several sparsities
             (budget = 1 - sparsity) for butler, oracle, quest, streaming and h2o, plus dense once; each record
             also carries the method's achieved sparsity (layers kept dense and `min_tokens` included).
  coref      the co-reference retrieval task (eval/coref.py): accuracy of the answer under every method, and token
             coverage: the fraction of the location's tokens (in the early INTRO sentence) that the method would
             keep at the query that predicts the answer, averaged over layers 1..L-1 and query heads (layers a
             method keeps dense count as fully covered). Coverage is computed from the dense model's activations
             on the whole prompt (exact for butler, whose predictor reads layer 0's input only; for the other
             methods their selection rule applied to the dense q/k, an approximation of the sparse run's).

    python -m eval.butler_eval --model smollm2 --artifact runs/butler --out runs/butler_eval \\
        --tasks accuracy,ppl,coref --sparsities 0.1,0.3,0.5,0.6 --lengths 2048 --samples 4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shlex
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import coref as coref_task
from eval import ppl as ppl_task
from jsparse import selection as sel
from jsparse.methods.butler import group_indices, head_mask, predicted_logits
from jsparse.methods.oracle import select_decode
from jsparse.methods.quest import page_mask
from jsparse.methods.streaming import sink_window
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask
from train.loop import predictor_qk, record_qk

TASKS = ("accuracy", "ppl", "coref")
BASELINES = ("oracle", "quest", "streaming", "h2o")
DEFAULT_SPARSITIES = (0.1, 0.3, 0.5, 0.6)


# ----------------------------------------------------------------------------------------------- accuracy


@functools.partial(jax.jit, static_argnames=("cfg", "pcfg", "rows"))
def _batch_agreement(params, pparams, tokens, *, cfg, pcfg, rows: tuple[int, ...]):
    """f32[L', 2]: per layer, (agreeing pairs, visible pairs) of the top-50% labels over the batch's rows."""
    B, T = tokens.shape
    h0, q, k = record_qk(params, cfg, tokens)
    qp, kp = predictor_qk(pparams, pcfg, h0)
    Lp, Hq, Hkv, Hk = cfg.num_layers - 1, cfg.num_heads, cfg.num_kv_heads, pcfg.key_heads
    r = jnp.asarray(rows, jnp.int32)  # [R]
    q = q[:, :, r].reshape(B, Lp, Hq, len(rows), -1)
    qp = qp[:, :, r].reshape(B, Lp, Hq, len(rows), -1)
    k = k.reshape(B, Lp, Hkv, T, -1)
    kp = kp.reshape(B, Lp, Hk, T, -1)
    visible = jnp.arange(T)[None, :] <= r[:, None]  # [R, T]
    n = r + 1
    top = (n + 1) // 2  # ceil(n / 2)

    def labels(logits):  # [B, H, R, T] -> bool important
        masked = jnp.where(visible, logits, -jnp.inf)
        kth = jnp.take_along_axis(-jnp.sort(-masked, axis=-1), (top - 1)[None, None, :, None], axis=-1)
        return (masked >= kth) & visible

    def per_layer(xs):
        ql, kl, qpl, kpl = xs
        s = jnp.einsum("bhrd,bhtd->bhrt", ql.astype(jnp.float32),
                       jnp.repeat(kl, Hq // Hkv, axis=1).astype(jnp.float32)) / math.sqrt(ql.shape[-1])
        p = jnp.einsum("bhrd,bhtd->bhrt", qpl, jnp.repeat(kpl, Hq // Hk, axis=1)) / math.sqrt(qpl.shape[-1])
        agree = (labels(s) == labels(p)) & visible
        return jnp.stack([agree.sum().astype(jnp.float32), (B * Hq * visible.sum()).astype(jnp.float32)])

    return jax.lax.map(per_layer, (jnp.swapaxes(q, 0, 1), jnp.swapaxes(k, 0, 1), jnp.swapaxes(qp, 0, 1),
                                   jnp.swapaxes(kp, 0, 1)))


def top50_accuracy(model, butler, windows: np.ndarray, *, stride: int = 16, min_row: int = 32,
                   batch: int = 1) -> dict:
    """TokenButler's top-50% classification accuracy of `butler`'s predictor on windows: i32[S, T].

    Returns:
      {"accuracy": float, "per_layer": [L - 1 floats, layers 1..L-1], "rows": query rows used, "windows": S}.
    """
    T = windows.shape[1]
    rows = tuple(range(min(min_row, T - 1), T, stride))
    totals = np.zeros((model.cfg.num_layers - 1, 2))
    for s in range(0, len(windows), batch):
        part = windows[s:s + batch]
        totals += np.asarray(_batch_agreement(model.params, butler.params, jnp.asarray(part), cfg=model.cfg,
                                              pcfg=butler.pcfg, rows=rows), np.float64)
    per_layer = totals[:, 0] / totals[:, 1]
    return {"accuracy": float(totals[:, 0].sum() / totals[:, 1].sum()), "per_layer": per_layer.tolist(),
            "rows": len(rows), "windows": int(len(windows))}


# ----------------------------------------------------------------------------------------------- coverage


def _kv_to_q(mask, G):
    return jnp.repeat(mask, G, axis=1)


def selection_mask(name: str, method, cfg, layer: int, q_row, k_cache, P: int, h2o_score=None, butler_logits=None):
    """bool[B, Hq, T]: the keys `method` keeps for the query at position P of layer `layer` (>= 1).

    Args:
      q_row: [B, 1, Hq, D] the layer's query at P; k_cache: [B, Hkv, T, D] the layer's keys; h2o_score:
        f32[B, Hkv, T] accumulated attention (h2o); butler_logits: f32[B, Hq, 1, T] predicted logits (butler).
    """
    B, _, Hq, _ = q_row.shape
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    pos = jnp.full((B, 1), P, jnp.int32)
    lengths = pos[:, 0] + 1
    if layer < getattr(method, "dense_layers", 0) or layer in getattr(method, "dense_set", ()):
        return jnp.broadcast_to(jnp.arange(T) <= P, (B, Hq, T))
    K = method.k_static(T)
    k_dyn = sel.budget_tokens(method.budget, pos + 1, method.min_tokens)  # [B, 1]
    if name == "oracle":
        idx = select_decode(q_row, k_cache, pos, method.budget, method.min_tokens, K)
        return _kv_to_q(decode_indices_to_mask(idx, lengths, T)[:, :, 0], G)
    if name == "streaming":
        idx = sink_window(pos + 1, k_dyn, method.sink, K)  # [B, 1, K]
        idx = jnp.broadcast_to(idx[:, None], (B, Hkv, 1, K))
        return _kv_to_q(decode_indices_to_mask(idx, lengths, T)[:, :, 0], G)
    if name == "quest":
        return page_mask(q_row, k_cache, pos, method.budget, method.min_tokens, method.page_size)[:, :, 0]
    if name == "h2o":
        k_t = k_dyn[:, 0]
        r = jnp.maximum(jnp.ceil(method.recent * k_t.astype(jnp.float32)).astype(jnp.int32), 1)
        n = jnp.arange(T)
        visible = n[None] <= P
        window = visible & (n[None] > (P - r)[:, None])
        heavy = jnp.where((visible & ~window)[:, None], h2o_score, sel.NEG_INF)
        idx = sel.topk_indices(heavy, jnp.broadcast_to((k_t - r)[:, None], (B, Hkv)), K)
        keep = decode_indices_to_mask(idx[:, :, None], lengths, T)[:, :, 0] | window[:, None]
        return _kv_to_q(keep, G)
    if name.startswith("butler"):
        budget = method.sparse_budget(cfg.num_layers)
        K = sel.budget_tokens(budget, T, method.min_tokens)
        if method.selection == "head":
            return head_mask(butler_logits, pos, lengths, budget, method.min_tokens, K, method.sink,
                             method.local)[:, :, 0]
        idx = group_indices(butler_logits, Hkv, pos, budget, method.min_tokens, K, method.sink,
                            method.local)
        return _kv_to_q(decode_indices_to_mask(idx, lengths, T)[:, :, 0], G)
    raise ValueError(f"coverage is not implemented for method {name!r}; expected one of "
                     f"{['butler', *BASELINES]}")


@functools.partial(jax.jit, static_argnames=("cfg",))
def _dense_record(params, tokens, *, cfg):
    return record_qk(params, cfg, tokens)


def token_coverage(model, methods: dict, prompts: Sequence[coref_task.CorefPrompt]) -> dict[str, float]:
    """Mean over prompts, layers 1..L-1 and query heads of the fraction of the location span each method keeps at
    the last prompt position (the query that predicts the answer's first token)."""
    cfg = model.cfg
    tokens = jnp.asarray(np.stack([p.tokens for p in prompts]))
    B, T = tokens.shape
    P = T - 1
    h0, q, k = _dense_record(model.params, tokens, cfg=cfg)
    Lp, Hq, Hkv, D = cfg.num_layers - 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = q.reshape(B, Lp, Hq, T, D)
    k = k.reshape(B, Lp, Hkv, T, D)
    span = np.zeros((B, T), bool)
    for b, p in enumerate(prompts):
        span[b, p.span[0]:p.span[1]] = True
    span = jnp.asarray(span)
    out = {}
    for name, method in methods.items():
        qp = kp = None
        if name.startswith("butler"):
            qp, kp = predictor_qk(method.params, method.pcfg, h0)  # [B, L' * Hq, T, d'], [B, L' * Hk', T, d']
            qp = qp.reshape(B, Lp, Hq, T, -1)
            kp = kp.reshape(B, Lp, method.pcfg.key_heads, T, -1)
        fracs = []
        for l in range(1, cfg.num_layers):
            q_row = jnp.swapaxes(q[:, l - 1, :, P:P + 1], 1, 2)  # [B, 1, Hq, D]
            k_l = k[:, l - 1]
            score = logits = None
            if name == "h2o":
                probs = sel.pooled_probs(jnp.swapaxes(q[:, l - 1, :, :P], 1, 2), k_l,
                                         jnp.broadcast_to(jnp.arange(P), (B, P)))
                score = probs.sum(axis=2)  # [B, Hkv, T]: attention received from the rows before P
            if name.startswith("butler"):
                logits = predicted_logits(qp[:, l - 1, :, P:P + 1], kp[:, l - 1], jnp.full((B, 1), P, jnp.int32))
            mask = selection_mask(name, method, cfg, l, q_row, k_l, P, h2o_score=score, butler_logits=logits)
            kept = jnp.sum(mask & span[:, None], axis=-1) / jnp.sum(span, axis=-1)[:, None]  # [B, Hq]
            fracs.append(np.asarray(kept, np.float64))
        out[name] = float(np.mean(fracs))
    return out


# ----------------------------------------------------------------------------------------------- runs


def _record(task, method, length, metric, value, **extra) -> dict:
    return {"task": task, "method": method, "length": length, "metric": metric, "value": value, **extra}


def run_accuracy(model, butler, length: int, samples: int, seed: int, corpus: str) -> list[dict]:
    ids = ppl_task.tokenize_corpus(model.tokenizer, ppl_task.read_corpus(corpus))
    windows = ppl_task.make_windows(model.tokenizer, ids, length, samples, seed)
    t0 = time.perf_counter()
    acc = top50_accuracy(model, butler, windows)
    return [_record("accuracy", "butler", length, "top50_accuracy", acc["accuracy"], n=acc["windows"],
                    rows_per_window=acc["rows"], per_layer=acc["per_layer"], seconds=time.perf_counter() - t0)]


def run_ppl_sweep(model, artifact: str, methods: Sequence[str], sparsities: Sequence[float],
                  lengths: Sequence[int], samples: int, seed: int, corpus: str, chunk: int,
                  progress: bool = False) -> list[dict]:
    """Perplexity (decode variant) of dense once and of every method at every target sparsity."""
    from eval.harness import EvalSpec, evaluate

    records = []
    runs = [("dense", 0.0, 1.0)] + [(m, s, round(1.0 - s, 6)) for s in sparsities for m in methods]
    for name, target, budget in runs:
        spec = EvalSpec(methods=(name,), tasks=("ppl",), lengths=tuple(lengths), budget=budget,
                        samples=samples, seed=seed, corpus=corpus, ppl_variants=("decode",), chunk=chunk,
                        artifacts={name: artifact} if name.startswith("butler") else {})
        for r in evaluate(model, spec, progress=progress).records:
            r = dict(r)
            r["target_sparsity"] = target
            records.append(r)
    return records


def run_coref_task(model, methods: dict, length: int, samples: int, seed: int, new_tokens: int = 4,
                   rows: int = 4) -> tuple[list[dict], list[dict]]:
    """Accuracy and coverage per method (dense included in `methods` when wanted), and the completions."""
    prompts = coref_task.make_prompts(model.tokenizer, length, samples, seed)
    coverable = {n: m for n, m in methods.items() if n.startswith("butler") or n in BASELINES}
    coverage = {}
    for s in range(0, len(prompts), rows):
        part = prompts[s:s + rows]
        for n, v in token_coverage(model, coverable, part).items():
            coverage.setdefault(n, []).append((v, len(part)))
    records, outputs = [], []
    for name, method in methods.items():
        t0 = time.perf_counter()
        completions = coref_task.run_coref(model, method, prompts, new_tokens=new_tokens, rows=rows)
        correct = [coref_task.is_correct(c, p.answer) for c, p in zip(completions, prompts)]
        for p, c, ok in zip(prompts, completions, correct):
            outputs.append({"method": name, "length": length, "answer": p.answer, "completion": c, "correct": ok})
        cov = None
        if name in coverage:
            cov = float(sum(v * n for v, n in coverage[name]) / sum(n for _, n in coverage[name]))
        elif name == "dense":
            cov = 1.0
        records.append(_record("coref", name, length, "accuracy", float(np.mean(correct)), n=len(correct),
                               coverage=cov, budget=getattr(method, "budget", 1.0),
                               seconds=time.perf_counter() - t0))
    return records, outputs


def summary_markdown(records: Sequence[dict], meta: dict) -> str:
    lines = ["# TokenButler evaluation", "", "```", meta.get("command", ""), "```", ""]
    lines += [f"- {k}: {meta[k]}" for k in ("model", "artifact", "device", "jax", "commit", "date") if meta.get(k)]
    lines.append("")
    acc = [r for r in records if r["task"] == "accuracy"]
    if acc:
        lines += ["## Top-50% token classification accuracy", "", "| length | windows | rows/window | accuracy |",
                  "|---|---|---|---|"]
        lines += [f"| {r['length']} | {r['n']} | {r['rows_per_window']} | {r['value']:.4f} |" for r in acc]
        per = acc[0]["per_layer"]
        lines += ["", "Per layer (1..L-1): " + ", ".join(f"{v:.3f}" for v in per), ""]
    ppl = [r for r in records if r["task"] == "ppl"]
    if ppl:
        lines += ["## Perplexity (decode simulated per row)", ""]
        for L in sorted({r["length"] for r in ppl}):
            rs = [r for r in ppl if r["length"] == L]
            dense = next((r["value"] for r in rs if r["method"] == "dense"), None)
            targets = sorted({r["target_sparsity"] for r in rs if r["method"] != "dense"})
            names = [m for m in dict.fromkeys(r["method"] for r in rs) if m != "dense"]
            lines += [f"Length {L}; dense: {dense:.3f}" if dense else f"Length {L}", "",
                      "| method | " + " | ".join(f"sparsity {t:g}" for t in targets) + " |",
                      "|---|" + "---|" * len(targets)]
            for m in names:
                cells = []
                for t in targets:
                    r = next((x for x in rs if x["method"] == m and x["target_sparsity"] == t), None)
                    cells.append("" if r is None else f"{r['value']:.3f} (achieved {r['sparsity']:.2f})"
                                 if r.get("sparsity") is not None else f"{r['value']:.3f}")
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            lines.append("")
    co = [r for r in records if r["task"] == "coref"]
    if co:
        lines += ["## Co-reference retrieval", "", "| method | length | budget | accuracy | token coverage |",
                  "|---|---|---|---|---|"]
        for r in co:
            cov = "" if r["coverage"] is None else f"{r['coverage']:.3f}"
            lines.append(f"| {r['method']} | {r['length']} | {r['budget']:g} | {r['value']:.2f} "
                         f"({round(r['value'] * r['n'])}/{r['n']}) | {cov} |")
        lines.append("")
    return "\n".join(lines)


def check_args(args) -> tuple[list[str], list[str], list[float], tuple[int, ...]]:
    """(tasks, methods beside butler, sparsities, ppl lengths) of `main`'s arguments, each checked before the model
    loads; ValueError (FileNotFoundError for a missing corpus) naming the flag and the value."""
    from eval.harness import check_methods, parse_lengths, parse_list

    tasks = list(parse_list(args.tasks, "--tasks"))
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; expected some of {TASKS}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"--tasks {args.tasks!r} names a task twice: expected each once")
    baselines = list(check_methods(parse_list(args.methods, "--methods")))
    always = [m for m in baselines if m in ("dense", "butler")]
    if always:
        raise ValueError(f"--methods {args.methods!r} names {always[0]!r}, which runs anyway: expected the methods "
                         "beside dense and butler")
    sparsities = []
    for item in parse_list(args.sparsities, "--sparsities"):
        try:
            s = float(item)
        except ValueError:
            raise ValueError(f"--sparsities {args.sparsities!r}: {item!r} is not a number; expected comma-separated "
                             "fractions in [0, 1)") from None
        if not 0.0 <= s < 1.0:
            raise ValueError(f"sparsity {s}: expected a fraction in [0, 1)")
        sparsities.append(s)
    if len(set(sparsities)) != len(sparsities):
        raise ValueError(f"--sparsities {args.sparsities!r} names a sparsity twice: expected each once")
    if not 0.0 <= args.coref_sparsity < 1.0:
        raise ValueError(f"--coref-sparsity {args.coref_sparsity}: expected a fraction in [0, 1)")
    lengths = parse_lengths(args.lengths)
    for flag, value, least in (("--samples", args.samples, 1), ("--acc-samples", args.acc_samples, 1),
                               ("--coref-samples", args.coref_samples, 1), ("--chunk", args.chunk, 1),
                               ("--acc-length", args.acc_length, 16), ("--coref-length", args.coref_length, 16),
                               ("--seed", args.seed, 0)):
        if value < least:
            raise ValueError(f"{flag} {value}: expected an integer >= {least}")
    if "accuracy" in tasks or "ppl" in tasks:
        ppl_task.read_corpus(args.corpus)  # missing, empty or not text: named now, not after the model loads
    from jsparse.artifacts import artifact_kind

    kind = artifact_kind(args.artifact)  # missing or unreadable: named by artifact_kind
    if kind != "butler":
        raise ValueError(f"--artifact {args.artifact!r} is a {kind!r} artifact: expected a 'butler' one (jsparse "
                         "train-predictor --out)")
    return tasks, baselines, sparsities, lengths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.butler_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--artifact", required=True, help="the butler artifact folder (jsparse train-predictor --out)")
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--methods", default=",".join(("butler-paper",) + BASELINES),
                   help="methods beside butler (default: butler-paper, the paper's rule, and every baseline)")
    p.add_argument("--sparsities", default=",".join(f"{s:g}" for s in DEFAULT_SPARSITIES))
    p.add_argument("--lengths", default="2048", help="ppl window lengths")
    p.add_argument("--samples", type=int, default=4, help="ppl windows per length")
    p.add_argument("--acc-length", type=int, default=2048)
    p.add_argument("--acc-samples", type=int, default=4)
    p.add_argument("--coref-length", type=int, default=2048)
    p.add_argument("--coref-samples", type=int, default=8)
    p.add_argument("--coref-sparsity", type=float, default=0.5)
    p.add_argument("--corpus", default=ppl_task.DEFAULT_CORPUS)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)

    import jsparse
    from eval.report import run_metadata

    try:  # every argument before the model loads (the ppl sweep runs last: a bad --lengths failed after the rest)
        tasks, baselines, sparsities, lengths = check_args(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"python -m eval.butler_eval: error: {e}") from None
    if "accuracy" in tasks or "ppl" in tasks:  # never scored on the predictor's own training text
        from eval.harness import EvalSpec, check_calibration_corpus

        check_calibration_corpus(EvalSpec(methods=("butler",), tasks=("ppl",), corpus=args.corpus,
                                          artifacts={"butler": args.artifact}))
    from eval.cli_eval import check_out

    try:  # made (and found writable) before the model loads
        check_out(args.out, "results.json and summary.md")
    except ValueError as e:
        raise SystemExit(f"python -m eval.butler_eval: error: {e}") from None
    model = jsparse.load(args.model, args.dtype)
    meta = run_metadata(command=shlex.join(["python", "-m", "eval.butler_eval", *(argv or sys.argv[1:])]),
                        model=model.name, artifact=os.path.abspath(args.artifact), tasks=tasks)
    records: list[dict] = []
    outputs: list[dict] = []

    def write():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(summary_markdown(records, meta))
        if outputs:
            with open(os.path.join(args.out, "coref_outputs.json"), "w") as f:
                json.dump(outputs, f, indent=1)

    butler = jsparse.build_method("butler", model, artifact=args.artifact, budget=0.5)
    if "accuracy" in tasks:
        records += run_accuracy(model, butler, args.acc_length, args.acc_samples, args.seed, args.corpus)
        write()
    if "coref" in tasks:
        budget = round(1.0 - args.coref_sparsity, 6)
        methods = {"dense": jsparse.build_method("dense", model)}
        for name in ["butler", *baselines]:
            methods[name] = jsparse.build_method(
                name, model, budget=budget, **({"artifact": args.artifact} if name.startswith("butler") else {}))
        recs, outs = run_coref_task(model, methods, args.coref_length, args.coref_samples, args.seed)
        records += recs
        outputs += outs
        write()
    if "ppl" in tasks:
        records += run_ppl_sweep(model, args.artifact, ["butler", *baselines], sparsities, lengths, args.samples,
                                 args.seed, args.corpus, args.chunk, progress=args.progress)
        write()
    print(summary_markdown(records, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
