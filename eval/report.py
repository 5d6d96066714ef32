"""Writing an evaluation run: results.json (the records), summary.md (tables), report.md + plots, run.json.

results.json, schema version 2 (`SCHEMA_VERSION`; version 1 was the bare list of records):

    {"schema_version": 2,
     "meta": {...},      # the metadata of the latest run into the folder: command, model, date, commit, device,
                         #   config (what must match for a run to resume into the folder), ...
     "runs": [{...}],    # one entry per `jsparse eval` / `jsparse demo` invocation that wrote records here:
                         #   command, date, commit, records (records it added)
     "records": [...]}   # flat records, keys `eval.harness.RECORD_KEYS` (described in eval/harness.py)

summary.md holds
  - the results table: one row per method (per method and budget, `kascade b=0.05` / `kascade k=512`, when the
    run swept budgets), one column per (task [variant], length): passkey accuracy as `0.80 (8/10)`, generation
    tasks as their mean score, perplexity as `12.340`, with the change relative to dense in the same column when
    dense was run (`12.50 (+1.3%)`);
  - the fidelity gate, achieved sparsity per method and (task [variant], length), measured prefill sparsity
    per layer, and
    accuracy per needle depth.

report.md (`write_report(run_dir)`, regenerated from results.json alone) holds the leaderboard and the plots
(PNG, matplotlib's Agg backend, in `plots/`): accuracy against achieved sparsity per task, perplexity change
against achieved sparsity, and a needle depth x length heatmap per method; then summary.md's tables.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping, Sequence

RESULTS_JSON = "results.json"
SUMMARY_MD = "summary.md"
RUN_JSON = "run.json"
OUTPUTS_JSON = "outputs.json"
REPORT_MD = "report.md"
PLOTS_DIR = "plots"
SCHEMA_VERSION = 2  # = eval.harness.SCHEMA_VERSION (tests/test_eval_sweep.py checks); bump both with RECORD_KEYS


def run_metadata(**extra: Any) -> dict:
    """Date, git commit, jax version and devices, plus `extra` (model, command, ...)."""
    import jax

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    from jsparse.provenance import source_commit

    commit = source_commit()  # $GIT_COMMIT first: a copy of the tree (e.g. on a GPU machine) may carry a stale .git
    meta["commit"] = None if commit == "unknown" else commit
    meta["jax"] = jax.__version__
    meta["device"] = str(jax.devices()[0].device_kind)
    meta["backend"] = jax.default_backend()
    meta.update(extra)
    return meta


def _column(r: Mapping) -> tuple:
    """(length, order, label) of a record's column: passkey first, then the generation tasks, then ppl."""
    if r["task"] == "passkey":
        return (r["length"], 0, "passkey")
    if r["task"] == "ppl":
        return (r["length"], 2, f"ppl {r['variant']}")
    return (r["length"], 1, r["task"] if r["variant"] == "generate" else f"{r['task']} {r['variant']}")


BELOW_DENSE = "**below dense**"


def is_accuracy(r: Mapping) -> bool:
    """Records of a task scored in [0, 1], higher is better (passkey and the generation tasks)."""
    return r["metric"] != "perplexity"


def below_dense(records: Sequence[Mapping]) -> list[tuple[str, int, Mapping, Mapping]]:
    """The fidelity gate: (row label, length, record, dense record) for every passkey or generation-task result
    (all depths pooled) that scores below dense's at the same (task, variant, length). Nothing a summary shows can
    hide these. The row label names the task unless it is passkey."""
    label, main, dense = _against_dense(records)
    return [(label(r), r["length"], r, d) for r in main
            if r["method"] != "dense" and (d := dense.get(_unit(r))) is not None and r["value"] < d["value"]]


def _unit(r: Mapping) -> tuple:
    return r["task"], r["variant"], r["length"]


def _against_dense(records: Sequence[Mapping]):
    """(the gate's row label of a record, the passkey and generation-task results over all depths, dense's of
    them by (task, variant, length)): what `below_dense` and `unchecked` compare. The label names the task unless
    it is passkey."""
    row = row_labeler(records)
    main = [r for r in records if is_accuracy(r) and r["depth"] is None]
    dense = {_unit(r): r for r in main if r["method"] == "dense"}
    return (lambda r: row(r) if r["task"] == "passkey" else f"{row(r)} {_column(r)[2]}"), main, dense


def unchecked(records: Sequence[Mapping]) -> list[tuple[str, int, Mapping]]:
    """(row label, length, record) of every passkey or generation-task result (all depths pooled) of a method other
    than dense with no dense result at the same (task, variant, length) to check it against: the gate says nothing
    of these (a folder can gather runs of other tasks, lengths or methods by resuming)."""
    label, main, dense = _against_dense(records)
    return [(label(r), r["length"], r) for r in main if r["method"] != "dense" and _unit(r) not in dense]


def _score(r: Mapping) -> str:
    """An accuracy-like record's score for the fidelity gate: hits/n for passkey's exact-match accuracy, else the
    task's mean metric (a mean of fractions for string_match_all, not a count of hits)."""
    return f"{round(r['value'] * r['n'])}/{r['n']}" if r["metric"] == "accuracy" else f"{r['value']:.2f}"


def _cell(r: Mapping, dense: Mapping | None) -> str:
    if r["metric"] == "accuracy":
        hits = round(r["value"] * r["n"])
        text = f"{r['value']:.2f} ({hits}/{r['n']})"
    elif is_accuracy(r):
        text = f"{r['value']:.2f}"
    else:
        text = f"{r['value']:.3f}"
        if dense is not None and r["method"] != "dense":
            text += f" ({100.0 * (r['value'] / dense['value'] - 1.0):+.1f}%)"
        return text
    if dense is not None and r["method"] != "dense" and r["value"] < dense["value"]:
        text += " " + BELOW_DENSE
    return text


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _row(r: Mapping, fractions: bool = False) -> str:
    """The row label of a record: its method, with its token budget when it has one (`k=N`), and with its budget
    fraction (`b=0.1`) when `fractions` (a run that swept several)."""
    k = r.get("budget_tokens")
    if k is not None:
        return f"{r['method']} k={k}"
    if fractions and r.get("budget") is not None:
        return f"{r['method']} b={r['budget']:g}"
    return r["method"]


def row_labeler(records: Sequence[Mapping]):
    """The row label function of a set of records: budget fractions shown when the records hold several."""
    fractions = {r["budget"] for r in records if r.get("budget_tokens") is None and r.get("budget") is not None}
    return lambda r: _row(r, len(fractions) > 1)


def _methods(records: Sequence[Mapping]) -> list[str]:
    row = row_labeler(records)
    seen: list[str] = []
    for r in records:
        if row(r) not in seen:
            seen.append(row(r))
    return seen


def summary_markdown(records: Sequence[Mapping], meta: Mapping | None = None) -> str:
    """The Markdown summary of a run's records (rows: methods; columns: task [variant] @ length)."""
    meta = dict(meta or {})
    _row = row_labeler(records)  # noqa: N806  (shadows the module's: budget fractions when several)
    methods = _methods(records)
    main = [r for r in records if r["depth"] is None]
    columns = sorted({_column(r) for r in main})
    cells = {(_row(r), _column(r)): r for r in main}
    budget = sorted({r["budget"] for r in records if r.get("budget_tokens") is None and r.get("budget") is not None})
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
             ("samples", meta.get("samples")),
             ("ppl windows", meta.get("ppl_samples") if meta.get("ppl_samples") != meta.get("samples") else None),
             ("ppl windows overlapping (the corpus holds fewer without overlap: they share text)",
              "; ".join(f"{n} windows at {length} tokens, {o['non_overlapping']} without overlap"
                        for length, o in meta["ppl_overlap"].items() for n in [o["windows"]])
              if meta.get("ppl_overlap") else None),
             ("seed", meta.get("seed")), ("corpus", meta.get("corpus")),
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
              "passkey: exact-match accuracy of the key's digits (correct/total); generation tasks (eval/tasks): "
              "the mean of the task's metric (string_match_all / string_match_part) over the samples; ppl: perplexity over every "
              "token after the first (ppl continuation: over the last C tokens, the method's decode after its "
              "prefill of the rest), with the change relative to dense; `b=F`: a budget of the fraction F of the "
              "context; `k=N`: a fixed budget of N tokens.", ""]
    lines += _table(header, rows) + [""]

    gate = below_dense(records)
    lines += ["## Fidelity gate", "",
              "Passkey and generation-task results below dense's at the same task and length (marked " + BELOW_DENSE
              + " above):", ""]
    missing = unchecked(records)
    has_dense = any(r["method"] == "dense" and is_accuracy(r) for r in main)
    lines += [f"- {m} @{L}: {_score(r)} against dense's {_score(d)}" for m, L, r, d in gate]
    if not has_dense:
        lines += ["- not checked: the run has no dense passkey or generation-task result."]
    elif missing:  # a folder that gathered runs of other tasks, lengths or methods
        lines += ["- not checked, no dense result at the same task and length: "
                  + ", ".join(f"{m} @{L}" for m, L, _ in missing)]
    elif not gate:
        lines += ["- none: every method scores at least dense's passkey." if all(
            r["task"] == "passkey" for r in main if is_accuracy(r)) else "- none: every method scores at least dense's."]
    lines += [""]

    # One column per (task [variant], length), as in the results table: a record's sparsity is that of the phase
    # that computes what it scores (the prompt's prefill for passkey and the generation tasks, the decode for ppl
    # decode / continuation), so one method has different values in different columns (Quest: 0 in its dense
    # prefill, its page rule in decode).
    lengths = sorted({r["length"] for r in records})
    label_of = row_labeler(records)
    scols = sorted({_column(r) for r in main})
    sparsity = {(label_of(r), _column(r)): r["sparsity"] for r in main}
    lines += ["## Achieved sparsity", "", "Fraction of the visible keys not attended, averaged over layers and the "
              "query positions each record scores, by the rule of the phase that computes them: the prompt's "
              "prefill for passkey, the generation tasks and ppl prefill, the decode for ppl decode and "
              "continuation (blank: the method does not report it).", ""]
    srows = [[m] + ["" if sparsity.get((m, c)) is None else f"{sparsity[(m, c)]:.3f}" for c in scols]
             for m in methods]
    lines += _table(["method"] + [f"{c[2]} @{c[0]}" for c in scols], srows) + [""]

    measured = [r for r in main if r.get("layer_sparsity")]
    if measured:
        layers = sorted({int(l) for r in measured for l in r["layer_sparsity"]})
        lines += ["## Prefill attention-map sparsity per sparse layer", "",
                  "Fraction of the causal attention map the method's prefill skipped in each sparse layer, "
                  "averaged over the samples (measured on the record's prefills: the whole window for ppl "
                  "prefill, the first length - C tokens for ppl continuation, the prompt for passkey and the "
                  "generation tasks); mean: over the sparse layers.", ""]
        mrows = []
        for r in measured:
            task = f"ppl {r['variant']}" if r["task"] == "ppl" else r["task"]
            vals = [r["layer_sparsity"].get(str(l)) for l in layers]
            mean = sum(v for v in vals if v is not None) / max(sum(v is not None for v in vals), 1)
            mrows.append([_row(r), f"{task} @{r['length']}", f"{mean:.3f}"]
                         + ["" if v is None else f"{v:.3f}" for v in vals])
        lines += _table(["method", "task", "mean"] + [f"L{l}" for l in layers], mrows) + [""]

    spec = [r for r in main if r.get("acceptance_rate") is not None]
    if spec:
        lines += ["## Speculative decoding acceptance rate", "",
                  "Accepted draft tokens / proposed ones over the rounds of the answers (passkey and the "
                  "generation tasks).", ""]
        acc = {(_row(r), _column(r)): r["acceptance_rate"] for r in spec}
        acols = sorted({_column(r) for r in spec})
        arows = [[m] + ["" if acc.get((m, c)) is None else f"{acc[(m, c)]:.3f}" for c in acols] for m in methods]
        lines += _table(["method"] + [f"{label} @{L}" for L, _, label in acols], arows) + [""]

    by_depth = [r for r in records if r["depth"] is not None]
    if by_depth:
        lines += ["## Accuracy by needle depth", "",
                  "passkey, and the needle tasks of eval/tasks (one table per length and task).", ""]
        for L in lengths:
            for col in sorted({_column(r) for r in by_depth if r["length"] == L}):
                rs = [r for r in by_depth if _column(r) == col]
                depths = sorted({r["depth"] for r in rs})
                cell = {(_row(r), r["depth"]): r for r in rs}
                drows = [[m] + ["" if (m, d) not in cell else _cell(cell[(m, d)], None) for d in depths]
                         for m in methods if any((m, d) in cell for d in depths)]
                title = f"Length {L}:" if col[2] == "passkey" else f"Length {L}, {col[2]}:"
                lines += [title, ""] + _table(["method"] + [f"depth {d:g}" for d in depths], drows) + [""]
    return "\n".join(lines)


def _dump(out_dir: str, name: str, obj: Any) -> None:
    tmp = os.path.join(out_dir, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, name))  # a run killed mid-write leaves the previous file whole


def read_results(run_dir: str) -> dict:
    """The results.json of `run_dir` as {"schema_version", "meta", "runs", "records"}.

    A version-1 file (a bare list of records) reads as version 1 with the meta of run.json beside it (or {})
    and no runs. Raises FileNotFoundError when there is none, ValueError for a file of another form or a newer
    schema.
    """
    path = os.path.join(run_dir, RESULTS_JSON)
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"{path} {what}: expected the results.json of a `jsparse eval` run")
    data = read_json(path)
    if isinstance(data, list):
        meta = {}
        if os.path.isfile(os.path.join(run_dir, RUN_JSON)):
            meta = read_json(os.path.join(run_dir, RUN_JSON))
        return {"schema_version": 1, "meta": meta, "runs": [], "records": check_entries(data, path, RECORD_KEYS)}
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {version!r}, expected {SCHEMA_VERSION} (or a version-1 list of "
                         "records)")
    if not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: schema_version {version} without a list of records: expected the 'records' of a "
                         "`jsparse eval` run")
    return {"schema_version": version, "meta": data.get("meta") or {}, "runs": data.get("runs") or [],
            "records": check_entries(data["records"], path, RECORD_KEYS)}


# The keys every record has (`harness.record_key`'s, budget_tokens aside) and every outputs.json entry.
RECORD_KEYS = ("method", "budget", "task", "length", "variant")
OUTPUT_KEYS = ("task", "method", "budget", "length")


def read_json(path: str):
    """A JSON file's content; ValueError naming the file when it is not JSON (a damaged or cut file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): a damaged file") from None


def check_entries(entries, path: str, keys: tuple[str, ...]) -> list:
    """entries as a list of objects with `keys`; ValueError naming the file and the first entry that is not."""
    if not isinstance(entries, list):
        raise ValueError(f"{path} holds a {type(entries).__name__} where a list of entries was expected: a damaged "
                         "file")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or any(k not in e for k in keys):
            missing = [k for k in keys if k not in e] if isinstance(e, dict) else None
            raise ValueError(f"{path} entry {i} is {json.dumps(e)[:120]}: expected an object with the keys "
                             f"{', '.join(keys)}{f' (missing {missing})' if missing else ''}: a damaged file")
    return entries


def write_results(out_dir: str, records: Sequence[Mapping], meta: Mapping | None = None,
                  outputs: Sequence[Mapping] | None = None, runs: Sequence[Mapping] | None = None) -> None:
    """Writes results.json (schema `SCHEMA_VERSION`: meta, runs, records), summary.md, run.json (when meta is
    given) and outputs.json (per-sample completions of the generation tasks, when given)."""
    os.makedirs(out_dir, exist_ok=True)
    _dump(out_dir, RESULTS_JSON, {"schema_version": SCHEMA_VERSION, "meta": dict(meta or {}),
                                  "runs": list(runs or []), "records": list(records)})
    if meta is not None:
        _dump(out_dir, RUN_JSON, dict(meta))
    if outputs is not None:
        _dump(out_dir, OUTPUTS_JSON, list(outputs))
    with open(os.path.join(out_dir, SUMMARY_MD), "w") as f:
        f.write(summary_markdown(records, meta))


# ------------------------------------------------------------------------------------------------ the report


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def decode_phase(r: Mapping) -> bool:
    """Whether a record scores tokens computed in decode (ppl decode / continuation), not in a prefill."""
    return r["task"] == "ppl" and r["variant"] in ("decode", "continuation")


def leaderboard(records: Sequence[Mapping]) -> list[dict]:
    """One row per (method, budget), best first: {label, method, budget, budget_tokens, sparsity, accuracy,
    tasks: {task column: mean over lengths}, ppl_change, below_dense}.

    accuracy: the mean over the row's (task, variant, length) results of passkey and the generation tasks (each
    counts once); sparsity: its mean achieved sparsity over its records scored in the prefill (passkey, the
    generation tasks, ppl prefill), decode_sparsity over those scored in decode (ppl decode and continuation), each
    None when unreported or absent (the two phases' rules differ: a mean over both would be neither's); ppl_change:
    the mean relative
    perplexity change against dense at the same (variant, length), in percent (None without dense or ppl);
    below_dense: how many of its accuracy results fall below dense's; unchecked: how many have no dense result at
    the same (task, variant, length) (`unchecked`: rows of a folder that gathered several runs may be means over
    different results). Sorted by accuracy (high first), then perplexity change (low first).
    """
    row = row_labeler(records)
    main = [r for r in records if r["depth"] is None]
    dense_ppl = {(r["variant"], r["length"]): r["value"] for r in main if r["method"] == "dense" and not is_accuracy(r)}
    gate = {id(r) for _, _, r, _ in below_dense(records)}
    missing = {id(r) for _, _, r in unchecked(records)}
    rows: dict[str, dict] = {}
    for r in main:
        e = rows.setdefault(row(r), dict(label=row(r), method=r["method"], budget=r["budget"],
                                         budget_tokens=r.get("budget_tokens"), _acc=[], _sp=[], _sp_decode=[],
                                         _ppl=[], _tasks={},
                                         below_dense=0, unchecked=0))
        if r["sparsity"] is not None:
            e["_sp_decode" if decode_phase(r) else "_sp"].append(r["sparsity"])
        if is_accuracy(r):
            e["_acc"].append(r["value"])
            e["_tasks"].setdefault(_column(r)[2], []).append(r["value"])
            e["below_dense"] += id(r) in gate
            e["unchecked"] += id(r) in missing
        elif (r["variant"], r["length"]) in dense_ppl:
            e["_ppl"].append(100.0 * (r["value"] / dense_ppl[(r["variant"], r["length"])] - 1.0))
    out = []
    for e in rows.values():
        out.append(dict(label=e["label"], method=e["method"], budget=e["budget"], budget_tokens=e["budget_tokens"],
                        sparsity=_mean(e["_sp"]), decode_sparsity=_mean(e["_sp_decode"]), accuracy=_mean(e["_acc"]),
                        tasks={t: _mean(v) for t, v in e["_tasks"].items()}, ppl_change=_mean(e["_ppl"]),
                        below_dense=e["below_dense"], unchecked=e["unchecked"]))
    big = float("inf")
    out.sort(key=lambda e: (-(e["accuracy"] if e["accuracy"] is not None else -1.0),
                            e["ppl_change"] if e["ppl_change"] is not None else big, e["label"]))
    return out


def leaderboard_markdown(records: Sequence[Mapping]) -> list[str]:
    rows = leaderboard(records)
    tasks = sorted({t for e in rows for t in e["tasks"]}, key=lambda t: (t != "passkey", t))
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    header = ["rank", "method", "budget", "prefill sparsity", "decode sparsity", "mean accuracy"] + tasks + [
        "ppl change", "below dense"]
    some_unchecked = any(e["unchecked"] for e in rows)
    if some_unchecked:
        header.append("not checked against dense")
    table = []
    for i, e in enumerate(rows, 1):
        budget = "none" if e["budget"] is None else (f"{e['budget_tokens']} tokens" if e["budget_tokens"] is not None
                                                      else f"{e['budget']:g}")
        table.append([str(i), e["label"], budget, fmt(e["sparsity"], ".3f"), fmt(e["decode_sparsity"], ".3f"),
                      fmt(e["accuracy"], ".3f")]
                     + [fmt(e["tasks"].get(t), ".2f") for t in tasks]
                     + ["" if e["ppl_change"] is None else f"{e['ppl_change']:+.1f}%", str(e["below_dense"])]
                     + ([str(e["unchecked"])] if some_unchecked else []))
    return _table(header, table)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(i: int) -> dict:
    return dict(color=f"C{i % 10}", marker="osD^v<>ph*"[i % 10], linestyle=("-", "--", ":", "-.")[(i // 10) % 4])


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _save_lines(plt, fig, axes, out_dir: str, name: str) -> str:
    """Legend on the last panel, then the figure saved as `name` (relative to out_dir) and closed; returns name."""
    axes[-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=90)
    plt.close(fig)
    return name


def _grid(plt, n: int, width: float = 5.0, height: float = 3.8):
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def plot_accuracy_vs_sparsity(records: Sequence[Mapping], out_dir: str) -> list[tuple[str, str]]:
    """One PNG per accuracy task: score against achieved sparsity, one subplot per length, one line per method
    (its budgets), dense as a horizontal band (its score +- one binomial standard error). Returns [(path relative
    to out_dir, caption)]."""
    plt = _pyplot()
    main = [r for r in records if r["depth"] is None and is_accuracy(r)]
    methods = list(dict.fromkeys(r["method"] for r in records if r["method"] != "dense"))
    written = []
    for col in sorted({_column(r)[1:] for r in main}):
        rs = [r for r in main if _column(r)[1:] == col]
        lengths = sorted({r["length"] for r in rs})
        fig, axes = _grid(plt, len(lengths))
        unplotted = set()
        for ax, L in zip(axes, lengths):
            for r in rs:
                if r["length"] == L and r["method"] == "dense":
                    err = max((r["value"] * (1 - r["value"]) / max(r["n"], 1)) ** 0.5, 0.01)
                    ax.axhspan(r["value"] - err, r["value"] + err, color="0.8", zorder=0, label="dense (+-1 s.e.)")
                    ax.axhline(r["value"], color="0.4", linewidth=1, zorder=1)
            for i, m in enumerate(methods):
                pts = sorted((r["sparsity"], r["value"]) for r in rs
                             if r["length"] == L and r["method"] == m and r["sparsity"] is not None)
                if any(r["length"] == L and r["method"] == m and r["sparsity"] is None for r in rs):
                    unplotted.add(m)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, **_style(i))
            ax.set_title(f"{col[1]} @{L}")
            ax.set_xlabel("achieved sparsity")
            ax.set_ylabel("accuracy")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        name = _save_lines(plt, fig, axes, out_dir, f"{PLOTS_DIR}/accuracy_vs_sparsity_{_slug(col[1])}.png")
        caption = f"{col[1]}: accuracy against achieved sparsity (one line per method over its budgets; grey band: dense)"
        if unplotted:
            caption += f"; not plotted (no sparsity reported): {', '.join(sorted(unplotted))}"
        written.append((name, caption))
    return written


def plot_ppl_vs_sparsity(records: Sequence[Mapping], out_dir: str) -> list[tuple[str, str]]:
    """One PNG: perplexity change against dense (%) against achieved sparsity, one subplot per (variant, length),
    one line per method."""
    plt = _pyplot()
    main = [r for r in records if r["depth"] is None and not is_accuracy(r)]
    dense = {(r["variant"], r["length"]): r["value"] for r in main if r["method"] == "dense"}
    cols = sorted({(r["variant"], r["length"]) for r in main if (r["variant"], r["length"]) in dense},
                  key=lambda c: (c[1], c[0]))
    if not cols:
        return []
    methods = list(dict.fromkeys(r["method"] for r in records if r["method"] != "dense"))
    fig, axes = _grid(plt, len(cols))
    unplotted = set()
    for ax, (variant, L) in zip(axes, cols):
        ax.axhline(0.0, color="0.4", linewidth=1, label="dense")
        for i, m in enumerate(methods):
            rs = [r for r in main if r["variant"] == variant and r["length"] == L and r["method"] == m]
            unplotted |= {m for r in rs if r["sparsity"] is None}
            pts = sorted((r["sparsity"], 100.0 * (r["value"] / dense[(variant, L)] - 1.0)) for r in rs
                         if r["sparsity"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, **_style(i))
        ax.set_title(f"ppl {variant} @{L}")
        ax.set_xlabel("achieved sparsity")
        ax.set_ylabel("perplexity change vs dense (%)")
        ax.grid(alpha=0.3)
    name = _save_lines(plt, fig, axes, out_dir, f"{PLOTS_DIR}/ppl_vs_sparsity.png")
    caption = "perplexity change against dense (%) against achieved sparsity (one line per method over its budgets)"
    if unplotted:
        caption += f"; not plotted (no sparsity reported): {', '.join(sorted(unplotted))}"
    return [(name, caption)]


def plot_depth_heatmaps(records: Sequence[Mapping], out_dir: str) -> list[tuple[str, str]]:
    """One PNG per method: accuracy by needle depth (rows) x length (columns), pooled over the needle tasks
    (passkey and the eval/tasks needle tasks, weighted by samples), one panel per budget."""
    plt = _pyplot()
    row = row_labeler(records)
    rs = [r for r in records if r["depth"] is not None and is_accuracy(r)]
    written = []
    for m in dict.fromkeys(r["method"] for r in rs):
        mine = [r for r in rs if r["method"] == m]
        labels = list(dict.fromkeys(row(r) for r in mine))
        depths = sorted({r["depth"] for r in mine})
        lengths = sorted({r["length"] for r in mine})
        fig, axes = _grid(plt, len(labels), width=max(2.2 + 0.9 * len(lengths), 3.2), height=0.9 + 0.45 * len(depths))
        for ax, label in zip(axes, labels):
            grid = [[None] * len(lengths) for _ in depths]
            for i, d in enumerate(depths):
                for j, L in enumerate(lengths):
                    cell = [r for r in mine if row(r) == label and r["depth"] == d and r["length"] == L]
                    n = sum(r["n"] for r in cell)
                    if n:
                        grid[i][j] = sum(r["value"] * r["n"] for r in cell) / n
            data = [[float("nan") if v is None else v for v in line] for line in grid]
            ax.imshow(data, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if grid[i][j] is not None:
                        ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=7,
                                color="white" if grid[i][j] < 0.6 else "black")
            ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("length (tokens)")
            ax.set_ylabel("needle depth")
            ax.set_title(label, fontsize=9)
        fig.tight_layout()
        name = f"{PLOTS_DIR}/depth_heatmap_{_slug(m)}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=90)
        plt.close(fig)
        written.append((name, f"{m}: accuracy by needle depth x length (needle tasks pooled; one panel per budget)"))
    return written


def report_markdown(records: Sequence[Mapping], meta: Mapping | None, plots: Sequence[tuple[str, str]]) -> str:
    """report.md: the leaderboard, the plots, then the tables of summary.md."""
    summary = summary_markdown(records, meta).split("\n")
    head = summary[:summary.index("## Results")] if "## Results" in summary else summary
    rest = summary[len(head):]
    lines = ["# Evaluation report"] + head[1:]
    lines += ["## Leaderboard", "",
              "One row per method and budget, best first: mean accuracy over passkey and the generation tasks (each "
              "task and length once), then the mean perplexity change against dense (every ppl variant and length); "
              "prefill / decode sparsity: mean achieved sparsity of the results scored in the prompt's prefill "
              "(passkey, the generation tasks, ppl prefill) and in decode (ppl decode, continuation) (blank: not "
              "reported or not run); below dense: results under dense's (the "
              "fidelity gate below).", ""]
    lines += leaderboard_markdown(records) + [""]
    if plots:
        lines += ["## Plots", ""]
        for path, caption in plots:
            lines += [f"![{caption}]({path})", "", f"*{caption}*", ""]
    return "\n".join(lines + rest)


def write_report(run_dir: str) -> list[str]:
    """Regenerates report.md, summary.md and the PNG plots of `run_dir` from its results.json alone.

    Returns the paths written (report.md first). Plots: `plots/accuracy_vs_sparsity_TASK.png` per accuracy task,
    `plots/ppl_vs_sparsity.png` (with dense perplexity in the run), `plots/depth_heatmap_METHOD.png` per method
    with needle-depth records; other PNGs in plots/ (of records an --overwrite run discarded) are removed.
    """
    data = read_results(run_dir)
    records, meta = data["records"], data["meta"]
    os.makedirs(os.path.join(run_dir, PLOTS_DIR), exist_ok=True)
    plots = (plot_accuracy_vs_sparsity(records, run_dir) + plot_ppl_vs_sparsity(records, run_dir)
             + plot_depth_heatmaps(records, run_dir))
    made = {os.path.normpath(p) for p, _ in plots}
    for name in os.listdir(os.path.join(run_dir, PLOTS_DIR)):  # plots of records no longer there (a rerun's)
        if name.endswith(".png") and os.path.normpath(f"{PLOTS_DIR}/{name}") not in made:
            os.remove(os.path.join(run_dir, PLOTS_DIR, name))
    with open(os.path.join(run_dir, REPORT_MD), "w") as f:
        f.write(report_markdown(records, meta, plots))
    with open(os.path.join(run_dir, SUMMARY_MD), "w") as f:
        f.write(summary_markdown(records, meta))
    return [os.path.join(run_dir, REPORT_MD)] + [os.path.join(run_dir, p) for p, _ in plots]
