"""Writing an evaluation run: results.json (the records), summary.md (tables for people), run.json (metadata).

summary.md holds
  - the results table: one row per method (per method and token budget, `kascade k=512`, when the run used
    --budget-tokens), one column per (task [variant], length): passkey accuracy as `0.80 (8/10)`, perplexity
    as `12.34`, with the change relative to dense in the same column when dense was run (`12.50 (+1.3%)`);
  - achieved sparsity per method and length;
  - the measured prefill attention-map sparsity per sparse layer (methods that report it, e.g. tsa);
  - passkey accuracy per needle depth, one table per length.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from typing import Any, Mapping, Sequence

RESULTS_JSON = "results.json"
SUMMARY_MD = "summary.md"
RUN_JSON = "run.json"
PASSKEY_OUTPUTS_JSON = "passkey_outputs.json"


def _git_head() -> dict:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return {"commit": subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                         timeout=10).stdout.strip() or None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


def run_metadata(**extra: Any) -> dict:
    """Date, git commit, jax version and devices, plus `extra` (model, command, ...)."""
    import jax

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if os.environ.get("GIT_COMMIT"):  # a copy of the tree (e.g. on a GPU machine) may carry a stale .git
        meta["commit"] = os.environ["GIT_COMMIT"]
    else:
        meta.update(_git_head())
    meta["jax"] = jax.__version__
    meta["device"] = str(jax.devices()[0].device_kind)
    meta["backend"] = jax.default_backend()
    meta.update(extra)
    return meta


def _column(r: Mapping) -> tuple:
    task = r["task"] if r["task"] == "passkey" else f"ppl {r['variant']}"
    return (r["length"], 0 if r["task"] == "passkey" else 1, task)


BELOW_DENSE = "**below dense**"


def below_dense(records: Sequence[Mapping]) -> list[tuple[str, int, Mapping, Mapping]]:
    """The fidelity gate: (row label, length, record, dense record) for every passkey result (all depths pooled)
    that scores below dense's at the same length. Nothing a summary shows can hide these."""
    main = [r for r in records if r["task"] == "passkey" and r["depth"] is None]
    dense = {r["length"]: r for r in main if r["method"] == "dense"}
    return [(_row(r), r["length"], r, dense[r["length"]]) for r in main
            if r["method"] != "dense" and r["length"] in dense and r["value"] < dense[r["length"]]["value"]]


def _cell(r: Mapping, dense: Mapping | None) -> str:
    if r["metric"] == "accuracy":
        hits = round(r["value"] * r["n"])
        text = f"{r['value']:.2f} ({hits}/{r['n']})"
        if dense is not None and r["method"] != "dense" and r["value"] < dense["value"]:
            text += " " + BELOW_DENSE
        return text
    text = f"{r['value']:.3f}"
    if dense is not None and r["method"] != "dense":
        text += f" ({100.0 * (r['value'] / dense['value'] - 1.0):+.1f}%)"
    return text


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _row(r: Mapping) -> str:
    """The row label of a record: its method, with its token budget when it has one."""
    k = r.get("budget_tokens")
    return r["method"] if k is None else f"{r['method']} k={k}"


def _methods(records: Sequence[Mapping]) -> list[str]:
    seen: list[str] = []
    for r in records:
        if _row(r) not in seen:
            seen.append(_row(r))
    return seen


def summary_markdown(records: Sequence[Mapping], meta: Mapping | None = None) -> str:
    """The Markdown summary of a run's records (rows: methods; columns: task [variant] @ length)."""
    meta = dict(meta or {})
    methods = _methods(records)
    main = [r for r in records if r["depth"] is None]
    columns = sorted({_column(r) for r in main})
    cells = {(_row(r), _column(r)): r for r in main}
    budget = sorted({r["budget"] for r in records if r.get("budget_tokens") is None})
    tokens = sorted({r["budget_tokens"] for r in records if r.get("budget_tokens") is not None})

    lines = ["# Evaluation summary", ""]
    if meta.get("command"):
        lines += ["```", meta["command"], "```", ""]
    facts = [("model", meta.get("model")), ("budget", ", ".join(f"{b:g}" for b in budget) or None),
             ("budget tokens", ", ".join(str(k) for k in tokens) or None),
             ("method options", meta.get("method_options") or None),
             ("continuation tokens", meta.get("continuation")
              if "continuation" in (meta.get("ppl_variants") or ()) else None),
             ("draft", meta.get("draft")), ("gamma", meta.get("gamma")),
             ("samples", meta.get("samples")), ("seed", meta.get("seed")), ("corpus", meta.get("corpus")),
             ("device", meta.get("device")), ("jax", meta.get("jax")), ("commit", meta.get("commit")),
             ("date", meta.get("date"))]
    lines += [f"- {k}: {v}" for k, v in facts if v is not None] + [""]

    header = ["method"] + [f"{task} @{length}" for length, _, task in columns]
    rows = []
    for m in methods:
        row = [m]
        for col in columns:
            r = cells.get((m, col))
            row.append("" if r is None else _cell(r, cells.get(("dense", col))))
        rows.append(row)
    lines += ["## Results", "",
              "passkey: exact-match accuracy of the key's digits (correct/total); ppl: perplexity over every "
              "token after the first (ppl continuation: over the last C tokens, the method's decode after its "
              "prefill of the rest), with the change relative to dense; `k=N`: a fixed budget of N tokens.", ""]
    lines += _table(header, rows) + [""]

    gate = below_dense(records)
    lines += ["## Fidelity gate", "",
              "Passkey results below dense's at the same length (marked " + BELOW_DENSE + " above):", ""]
    if gate:
        lines += [f"- {m} @{L}: {round(r['value'] * r['n'])}/{r['n']} against dense's "
                  f"{round(d['value'] * d['n'])}/{d['n']}" for m, L, r, d in gate]
    elif any(r["method"] == "dense" and r["task"] == "passkey" for r in main):
        lines += ["- none: every method scores at least dense's passkey."]
    else:
        lines += ["- not checked: the run has no dense passkey result."]
    lines += [""]

    lengths = sorted({r["length"] for r in records})
    sparsity = {}
    for r in main:
        if sparsity.get((_row(r), r["length"])) is None:
            sparsity[(_row(r), r["length"])] = r["sparsity"]
    lines += ["## Achieved sparsity", "", "Fraction of the visible keys not attended, averaged over layers and "
              "query positions (blank: the method does not report it).", ""]
    srows = [[m] + ["" if sparsity.get((m, L)) is None else f"{sparsity[(m, L)]:.3f}" for L in lengths]
             for m in methods]
    lines += _table(["method"] + [f"@{L}" for L in lengths], srows) + [""]

    measured = [r for r in main if r.get("layer_sparsity")]
    if measured:
        layers = sorted({int(l) for r in measured for l in r["layer_sparsity"]})
        lines += ["## Prefill attention-map sparsity per sparse layer", "",
                  "Fraction of the causal attention map the method's prefill skipped in each sparse layer, "
                  "averaged over the samples (measured on the record's prefills: the whole window for ppl "
                  "prefill, the first length - C tokens for ppl continuation, the prompt for passkey); mean: "
                  "over the sparse layers.", ""]
        mrows = []
        for r in measured:
            task = r["task"] if r["task"] == "passkey" else f"ppl {r['variant']}"
            vals = [r["layer_sparsity"].get(str(l)) for l in layers]
            mean = sum(v for v in vals if v is not None) / max(sum(v is not None for v in vals), 1)
            mrows.append([_row(r), f"{task} @{r['length']}", f"{mean:.3f}"]
                         + ["" if v is None else f"{v:.3f}" for v in vals])
        lines += _table(["method", "task", "mean"] + [f"L{l}" for l in layers], mrows) + [""]

    spec = [r for r in main if r.get("acceptance_rate") is not None]
    if spec:
        lines += ["## Speculative decoding acceptance rate", "",
                  "Accepted draft tokens / proposed ones over the passkey answers' rounds.", ""]
        acc = {(_row(r), r["length"]): r["acceptance_rate"] for r in spec}
        arows = [[m] + ["" if acc.get((m, L)) is None else f"{acc[(m, L)]:.3f}" for L in lengths] for m in methods]
        lines += _table(["method"] + [f"@{L}" for L in lengths], arows) + [""]

    by_depth = [r for r in records if r["depth"] is not None]
    if by_depth:
        lines += ["## Passkey accuracy by needle depth", ""]
        for L in lengths:
            rs = [r for r in by_depth if r["length"] == L]
            if not rs:
                continue
            depths = sorted({r["depth"] for r in rs})
            cell = {(_row(r), r["depth"]): r for r in rs}
            drows = [[m] + ["" if (m, d) not in cell else _cell(cell[(m, d)], None) for d in depths]
                     for m in methods]
            lines += [f"Length {L}:", ""] + _table(["method"] + [f"depth {d:g}" for d in depths], drows) + [""]
    return "\n".join(lines)


def write_results(out_dir: str, records: Sequence[Mapping], meta: Mapping | None = None,
                  passkey_outputs: Sequence[Mapping] | None = None) -> None:
    """Writes results.json, summary.md, run.json (when meta is given) and passkey_outputs.json (when given)."""
    os.makedirs(out_dir, exist_ok=True)

    def dump(name: str, obj: Any) -> None:
        tmp = os.path.join(out_dir, name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, os.path.join(out_dir, name))

    dump(RESULTS_JSON, list(records))
    if meta is not None:
        dump(RUN_JSON, dict(meta))
    if passkey_outputs is not None:
        dump(PASSKEY_OUTPUTS_JSON, list(passkey_outputs))
    with open(os.path.join(out_dir, SUMMARY_MD), "w") as f:
        f.write(summary_markdown(records, meta))
