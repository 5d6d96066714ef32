"""Attention-mass coverage of TokenButler's selection against the baselines, per layer (diagnosis; CPU or GPU).

For windows of a corpus (default: the development corpus, Alice in Wonderland, `eval.ppl.DEV_CORPUS`), the dense
model's per-layer queries and keys are recorded once; for a set of query rows, every method's decode selection
(applied to the dense q/k, as `eval.butler_eval.token_coverage` does) is compared with the true per-query-head
attention distribution:

    coverage = sum over the selected keys of softmax(q k^T / sqrt(d))  (per query head and row; 1 = dense)

averaged over heads and rows, per layer and overall. Also reported: mean |predicted - true| logit error and the
top-50% label agreement per layer, to separate "the predictor is wrong" from "the selection rule is wrong".

    jsparse bench butler_coverage --artifact jsparse/shipped/smollm2/butler --length 1024 --samples 2 \\
        --out /tmp/cov.json
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval import ppl as ppl_task
from eval.bench.common import (add_out_argument, check_budget, check_contexts, device_facts, out_path, positive_int,
                               write_json)
from jsparse import selection as sel
from jsparse.artifacts import shipped_artifact
from jsparse.methods import butler as bt
from jsparse.methods.oracle import select_decode
from jsparse.methods.quest import page_mask
from jsparse.methods.streaming import sink_window
from pallas_kernels.sparse_attention.reference import decode_indices_to_mask
from train.loop import predictor_qk, record_qk





def layer_masks(q_rows, k_l, qp_rows, kp_l, pos, budget, min_tokens, N, Hq, Hkv, butler_variants):
    """Masks of every method for one layer: dict name -> bool[B, Hq, R, N]."""
    B, R = pos.shape
    G = Hq // Hkv
    K = sel.budget_tokens(budget, N, min_tokens)
    k_dyn = sel.budget_tokens(budget, pos + 1, min_tokens)  # [B, R]
    lengths = jnp.full((B,), N, jnp.int32)
    out = {}
    idx = select_decode(q_rows, k_l, pos, budget, min_tokens, K)
    out["oracle"] = jnp.repeat(decode_indices_to_mask(idx, lengths, N), G, axis=1)
    out["quest"] = page_mask(q_rows, k_l, pos, budget, min_tokens, 16)
    idx = sink_window(pos + 1, k_dyn, 4, K)  # [B, R, K]
    out["streaming"] = jnp.broadcast_to(decode_indices_to_mask(idx[:, None], lengths, N), (B, Hq, R, N))
    logits = bt.predicted_logits(qp_rows, kp_l, pos)  # [B, Hq, R, N]
    for name, (mode, local) in butler_variants.items():
        if mode == "head":
            out[name] = bt.head_mask(logits, pos, lengths, budget, min_tokens, K, 4, local)
        else:
            idx = bt.group_indices(logits, Hkv, pos, budget, min_tokens, K, 4, local)
            out[name] = jnp.repeat(decode_indices_to_mask(idx, lengths, N), G, axis=1)
    return out, logits


def dense_values(model, tokens):
    """f32[L, B, Hkv, N, D]: every layer's values from a dense prefill."""
    from models import llama
    from models.cache import init_cache

    import jsparse

    B, N = tokens.shape

    @jax.jit
    def run(params, tokens):
        cache = init_cache(model.cfg, B, N, params.embed.dtype)
        dense = jsparse.make_method("dense")
        _, cache, _ = llama.prefill(params, model.cfg, dense, tokens, jnp.full((B,), N, jnp.int32), cache, None)
        return cache.v.astype(jnp.float32)

    return run(model.params, tokens)


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model spec, as `jsparse generate --model` (default smollm2)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the device's)")
    p.add_argument("--artifact", default=shipped_artifact("butler"),
                   help="TokenButler predictor artifact (default: the shipped jsparse/shipped/smollm2/butler)")
    p.add_argument("--corpus", default=ppl_task.DEV_CORPUS,
                   help="text file the windows are cut from (default: the shipped eval/data/alice_in_wonderland.txt)")
    p.add_argument("--length", type=positive_int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--samples", type=positive_int, default=2, help="windows (default 2)")
    p.add_argument("--seed", type=int, default=0, help="window sampling seed (default 0)")
    p.add_argument("--budget", type=float, default=0.5, help="fraction of the visible keys selected (default 0.5)")
    p.add_argument("--min-tokens", type=int, default=128, help="least keys selected per row (default 128)")
    p.add_argument("--row-start", type=int, default=256, help="first query row scored (default 256)")
    p.add_argument("--row-stride", type=int, default=16, help="stride between scored query rows (default 16)")
    add_out_argument(p, "butler_coverage.json", optional=True)
    p.add_argument("--dense-count", type=int, default=0,
                   help="calibrate: write into the artifact's metadata dense_set = the layers (>= the default "
                        "dense_layers) where butler's default selection has the largest attention-output error")
    args = p.parse_args(argv)
    if args.row_stride < 1 or not 0 <= args.row_start < args.length:
        p.error(f"--row-start {args.row_start} --row-stride {args.row_stride} with --length {args.length}: expected "
                "0 <= --row-start < --length and --row-stride >= 1 (the scored query rows lie in the window)")
    if args.dense_count < 0:
        p.error(f"--dense-count {args.dense_count}: expected a number of layers >= 0 (0: no calibration)")
    try:
        check_budget(args.budget)
        out = out_path(args.out, "butler_coverage.json")  # before the work: a bad --out ends none
    except ValueError as e:
        p.error(str(e))

    import jsparse

    model = jsparse.load(args.model, args.dtype)
    cfg = model.cfg
    try:
        check_contexts("--length", [args.length], cfg, args.model, kind="model")
    except ValueError as e:
        p.error(str(e))
    if args.dense_count > (eligible := cfg.num_layers - bt.DEFAULT_DENSE_LAYERS):  # layers DEFAULT..L-1
        p.error(f"--dense-count {args.dense_count}: the model has {eligible} layers past its default dense_layers "
                f"({bt.DEFAULT_DENSE_LAYERS}) to choose from; expected at most {eligible}")
    butler = jsparse.build_method("butler", model, artifact=args.artifact, budget=args.budget)
    ids = ppl_task.tokenize_corpus(model.tokenizer, ppl_task.read_corpus(args.corpus))
    windows = ppl_task.make_windows(model.tokenizer, ids, args.length, args.samples, args.seed)
    tokens = jnp.asarray(windows)
    B, N = tokens.shape
    Lp, Hq, Hkv, D = cfg.num_layers - 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t0 = time.perf_counter()
    h0, q, k = jax.jit(record_qk, static_argnums=1)(model.params, cfg, tokens)
    v = dense_values(model, tokens)  # [L, B, Hkv, N, D]
    qp, kp = jax.jit(predictor_qk, static_argnums=1)(butler.params, butler.pcfg, h0)
    q = q.reshape(B, Lp, Hq, N, D).astype(jnp.float32)
    k = k.reshape(B, Lp, Hkv, N, D).astype(jnp.float32)
    qp = qp.reshape(B, Lp, Hq, N, -1)
    kp = kp.reshape(B, Lp, butler.pcfg.key_heads, N, -1)
    rows = np.arange(args.row_start, N, args.row_stride)
    pos = jnp.broadcast_to(jnp.asarray(rows, jnp.int32), (B, len(rows)))
    bvars = {"butler-default": ("head", bt.DEFAULT_LOCAL), "butler": ("head", 0), "butler-local32": ("head", 32),
             "butler-group": ("group", 0),
             "butler-group-local32": ("group", 32)}
    print(f"recorded in {time.perf_counter() - t0:.1f}s; rows {len(rows)}", flush=True)

    @jax.jit
    def one_layer(ql, kl, qpl, kpl, vl):
        q_rows = jnp.swapaxes(ql[:, :, rows], 1, 2)  # [B, R, Hq, D]
        masks, plog = layer_masks(q_rows, kl, qpl[:, :, rows], kpl, pos, args.budget, args.min_tokens, N, Hq, Hkv,
                                  bvars)
        true = jnp.einsum("bhrd,bhnd->bhrn", ql[:, :, rows], jnp.repeat(kl, Hq // Hkv, axis=1)) / math.sqrt(D)
        visible = jnp.arange(N)[None, :] <= pos[:, :, None]  # [B, R, N]
        true = jnp.where(visible[:, None], true, -jnp.inf)
        probs = jax.nn.softmax(true, axis=-1)
        cov = {}
        vq = jnp.repeat(vl, Hq // Hkv, axis=1)  # [B, Hq, N, D]
        dense_out = jnp.einsum("bhrn,bhnd->bhrd", probs, vq)
        masks = dict(masks)
        for n, m in masks.items():
            pm = jnp.where(m, probs, 0.0)
            out = jnp.einsum("bhrn,bhnd->bhrd", pm / jnp.sum(pm, -1, keepdims=True), vq)
            rel = jnp.linalg.norm(out - dense_out, axis=-1) / jnp.linalg.norm(dense_out, axis=-1)
            cov[n + ":outerr"] = jnp.mean(rel)
            c = jnp.sum(jnp.where(m, probs, 0.0), axis=-1)  # [B, Hq, R]
            cov[n] = jnp.mean(c)
            cov[n + ":lt80"] = jnp.mean(c < 0.8)  # share of (row, head) pairs missing over 20% of the mass
            cov[n + ":logmiss"] = jnp.mean(-jnp.log(jnp.maximum(c, 1e-6)))  # KL(dense || renormalised kept)
        # per-head oracle (upper bound of a per-query-head selection)
        kd = sel.budget_tokens(args.budget, pos + 1, args.min_tokens)
        idx = sel.topk_indices(true, jnp.broadcast_to(kd[:, None], true.shape[:3]), sel.budget_tokens(
            args.budget, N, args.min_tokens))
        m = decode_indices_to_mask(idx, jnp.full((B,), N, jnp.int32), N)
        cov["oracle-head"] = jnp.mean(jnp.sum(jnp.where(m, probs, 0.0), axis=-1))
        pm = jnp.where(m, probs, 0.0)
        out = jnp.einsum("bhrn,bhnd->bhrd", pm / jnp.sum(pm, -1, keepdims=True), vq)
        cov["oracle-head:outerr"] = jnp.mean(jnp.linalg.norm(out - dense_out, axis=-1)
                                             / jnp.linalg.norm(dense_out, axis=-1))
        # predicted-vs-true logits: centered error (softmax is shift-invariant) and rank correlation proxy
        tc = jnp.where(visible[:, None], true - jnp.sum(jnp.where(visible[:, None], true, 0), -1, keepdims=True)
                       / visible.sum(-1)[:, None, :, None], 0.0)
        pc = jnp.where(visible[:, None], plog - jnp.sum(jnp.where(visible[:, None], plog, 0), -1, keepdims=True)
                       / visible.sum(-1)[:, None, :, None], 0.0)
        err = jnp.sum(jnp.abs(tc - pc)) / (Hq * visible.sum())
        tstd = jnp.sqrt(jnp.sum(tc ** 2) / (Hq * visible.sum()))
        pstd = jnp.sqrt(jnp.sum(pc ** 2) / (Hq * visible.sum()))
        corr = jnp.sum(tc * pc) / jnp.sqrt(jnp.sum(tc ** 2) * jnp.sum(pc ** 2))
        # where is the mass: last 32 keys, first 4
        n = jnp.arange(N)
        recent = (n[None, None, :] > pos[:, :, None] - 32)[:, None]
        cov["mass-last32"] = jnp.mean(jnp.sum(jnp.where(recent, probs, 0.0), -1))
        cov["mass-first4"] = jnp.mean(jnp.sum(probs[..., :4], -1))
        cov["err_abs"] = err
        cov["true_std"] = tstd
        cov["pred_std"] = pstd
        cov["corr"] = corr
        return cov

    per_layer = []
    for l in range(Lp):
        c = {n: float(x) for n, x in one_layer(q[:, l], k[:, l], qp[:, l], kp[:, l], v[l + 1]).items()}
        per_layer.append(c)
        print(f"layer {l + 1:2d} " + " ".join(f"{n}={v:.3f}" for n, v in c.items()), flush=True)
    names = list(per_layer[0])
    mean = {n: float(np.mean([c[n] for c in per_layer])) for n in names}
    mean2 = {n: float(np.mean([c[n] for c in per_layer[1:]])) for n in names}
    print("mean layers 1..L-1: " + " ".join(f"{n}={v:.4f}" for n, v in mean.items()))
    print("mean layers 2..L-1: " + " ".join(f"{n}={v:.4f}" for n, v in mean2.items()))
    if args.dense_count:
        from jsparse.artifacts import update_artifact_meta

        err = {l + 1: c["butler-default:outerr"] for l, c in enumerate(per_layer)
               if l + 1 >= bt.DEFAULT_DENSE_LAYERS}
        dense_set = sorted(sorted(err, key=lambda l: -err[l])[:args.dense_count])
        # Only the metadata changes, rewritten atomically; arrays.npz is left as it is.
        update_artifact_meta(args.artifact, "butler", dense_set=dense_set, dense_set_calibration={
            "rule": "layers with the largest mean relative attention-output error of butler's default selection "
                    "(dense q/k/v, per query head and row)",
            "corpus": os.path.basename(args.corpus), "length": args.length, "samples": args.samples,
            "budget": args.budget, "rows": f"{args.row_start}::{args.row_stride}",
            "outerr_per_layer": {str(l): round(v, 5) for l, v in err.items()}})
        print(f"wrote dense_set={dense_set} into {args.artifact}")
    if out:
        write_json(out, {**device_facts(), "args": {k: v for k, v in vars(args).items() if not callable(v)},
                         "per_layer": per_layer, "mean": mean, "mean_from_layer2": mean2})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
