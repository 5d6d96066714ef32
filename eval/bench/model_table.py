"""The README's end-to-end table from `jsparse bench model --methods ...` JSONs: method x (context, batch) ->
decode tokens/s, each cell linked to the JSON it comes from, with the speedup over the dense step of the same run,
the speedup the method's bytes floor allows, and the share of it.

    jsparse bench model_table eval/results/h100/e2e/e2e_[abc].json --link-root . --bar 0.85 --out table.md

A cell reads `670 (2.77x / 3.33x, 0.830)`: tokens/s, then the speedup over dense / the bytes floor's speedup,
share of it (bold at or past `--bar`). A case that failed reads its error (out of memory: the bytes it could not
get); a method whose correctness check failed in that run reads "check failed" beside its figure (the JSON's `methods`).
The header names the device, commits and dates of the runs, so a table never mixes cards silently: JSONs of
different devices or model shapes are an error, and so is one (method, context, batch) in two JSONs, except dense:
each run measures its own, and a column's second dense is a row of its own ("dense (run 2)").
"""

from __future__ import annotations

import argparse
import json
import os
import re

BENCHMARK = "model_methods"
OUT_NAME = "model_table.md"  # what `--out FOLDER` writes


def load_runs(paths) -> list[tuple[str, dict]]:
    """[(path, payload)] of `jsparse bench model --methods` JSONs; ValueError naming a file that is not one, or
    runs of different devices or shapes."""
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                payload = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable JSON file ({e})") from None
        if not isinstance(payload, dict) or payload.get("benchmark") != BENCHMARK:
            raise ValueError(f"{path}: benchmark {payload.get('benchmark') if isinstance(payload, dict) else None!r}:"
                             f" expected {BENCHMARK!r} (a `jsparse bench model --methods ...` JSON)")
        runs.append((path, payload))
    if not runs:
        raise ValueError("no JSON given: expected one or more `jsparse bench model --methods ...` JSONs")
    for key in ("device", "shape"):
        seen = sorted({str(p.get(key)) for _, p in runs})
        if len(seen) > 1:
            raise ValueError(f"the runs differ in {key}: {seen}; expected one table per {key}")
    return runs


def decode_cells(runs) -> tuple[list[str], list[tuple[int, int]], dict]:
    """(methods in order of first appearance, dense first, columns (context, batch) sorted, {(method, column):
    (path, row, check)}). Each run has its own dense: a column's second dense is the row "dense (run 2)", and so
    on. ValueError for one case of another method in two JSONs."""
    methods, columns, cells = [], set(), {}
    for path, payload in runs:
        checks = payload.get("methods") or {}
        rows = payload.get("rows", [])
        if not isinstance(rows, list):
            raise ValueError(f"{path}: rows is a {type(rows).__name__}: expected a list of rows (a `jsparse bench "
                             "model --methods ...` JSON)")
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or row.get("phase") != "decode":
                continue
            _check_decode_row(path, i, row)
            m, col = row["method"], (int(row["context"]), int(row["batch"]))
            if m == "dense":  # every run measures its own dense: a second run's is a row of its own
                k = 1
                while (m, col) in cells:
                    k += 1
                    m = f"dense (run {k})"
            if (m, col) in cells:
                raise ValueError(f"{m} at context {col[0]}, batch {col[1]} is in {cells[(m, col)][0]} and in {path}: "
                                 "expected each case in one JSON (pass one of them)")
            check = (checks.get(m) or {}).get("check")
            cells[(m, col)] = (path, row, check)
            columns.add(col)
            if m not in methods:
                methods.append(m)
    if not cells:
        raise ValueError(f"no decode rows in {', '.join(path for path, _ in runs)}: the table is of decode rows "
                         "(expected `jsparse bench model --methods ... --context ...` JSONs, not prefill-only runs)")
    dense = sorted((m for m in methods if m.startswith("dense")), key=lambda m: (m != "dense", m))
    return dense + [m for m in methods if not m.startswith("dense")], sorted(columns), cells


DECODE_KEYS = {"method": str, "context": int, "batch": int}  # and tokens_per_s, or the error of a failed case
SPEEDUP_KEYS = ("speedup", "floor_speedup", "floor_fraction")  # a method's row beside dense: all or none


def _check_decode_row(path: str, i: int, row: dict) -> None:
    """ValueError naming the file and row when a decode row lacks what its cell reads (a damaged or hand-made JSON,
    not one of `jsparse bench model --methods`)."""
    missing = [k for k, kind in DECODE_KEYS.items() if not isinstance(row.get(k), kind) or isinstance(row[k], bool)]
    if "error" not in row:
        missing += [k for k in ("tokens_per_s",) + (SPEEDUP_KEYS if "speedup" in row else ())
                    if not isinstance(row.get(k), (int, float)) or isinstance(row[k], bool)]
    if missing:
        raise ValueError(f"{path}: decode row {i} ({row.get('method')!r}) lacks {missing} or has them of another "
                         "kind: expected a `jsparse bench model --methods ...` row (method, context, batch, "
                         "tokens_per_s, or the error of a failed case)")


def _cell(path: str, row: dict, check, link_root: str | None, bar: float | None) -> str:
    link = os.path.relpath(path, link_root) if link_root else path
    if "error" in row:
        oom = re.search(r"Out of memory while trying to allocate ([\d.]+\s*\w+)", row["error"])
        text = f"out of memory ({oom.group(1)} more)" if oom else row["error"][:60]
        return f"[{text}]({link})"
    text = f"[{row['tokens_per_s']:.0f}]({link})"
    if row["method"] != "dense" and "speedup" in row:
        share = f"{row['floor_fraction']:.3f}"
        if bar is not None and row["floor_fraction"] >= bar:
            share = f"**{share}**"
        text += f" ({row['speedup']:.2f}x / {row['floor_speedup']:.2f}x, {share})"
    if isinstance(check, dict) and not check.get("passed", True):
        text += " check failed"
    return text


def context_label(c: int) -> str:
    """32768 -> '32K', 131072 -> '128K', 100000 -> '100K', else the number."""
    if c % 1024 == 0:
        return f"{c // 1024}K"
    return f"{c // 1000}K" if c % 1000 == 0 else str(c)


def markdown(runs, link_root: str | None = None, bar: float | None = None) -> str:
    """The table with a line naming its runs above it."""
    methods, columns, cells = decode_cells(runs)
    largest = {col for (_, col), (_, row, _) in cells.items() if row.get("batch_asked") is not None}
    devices = sorted({str(p.get("device")) for _, p in runs})
    commits = sorted({str(p.get("commit")) for _, p in runs})
    dates = sorted({str(p.get("date", ""))[:10] for _, p in runs})
    shape = runs[0][1].get("shape")
    lines = [f"{', '.join(devices)}; {shape} shapes, random weights; commit {', '.join(commits)}; "
             f"{', '.join(dates)}; {len(runs)} run(s), each with its own dense. Tokens/s (speedup over dense / "
             "bytes floor's speedup, share of it" + (f"; bold: at least {bar}" if bar is not None else "") + "):",
             "",
             "| method | " + " | ".join(f"{context_label(c)}, batch {b}" + (" (max)" if (c, b) in largest else "")
                                       for c, b in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for m in methods:
        row = [(_cell(*cells[(m, col)], link_root, bar) if (m, col) in cells else "") for col in columns]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jsons", nargs="+", help="`jsparse bench model --methods ...` JSON files")
    p.add_argument("--link-root", default=None,
                   help="folder the cells' links are relative to (e.g. the repository root, for README.md); "
                        "default: the paths as given")
    p.add_argument("--bar", type=float, default=None, help="bold the shares of the bytes floor at or past this")
    p.add_argument("--out", default=None, metavar="PATH",
                   help=f"markdown file to write, or a folder to write {OUT_NAME} in (default: print only)")
    a = p.parse_args(argv)
    if a.bar is not None and not 0.0 < a.bar <= 1.0:
        p.error(f"--bar {a.bar}: expected a share in (0, 1]")
    from eval.bench.common import out_path
    try:
        out = out_path(a.out, OUT_NAME)
        text = markdown(load_runs(a.jsons), a.link_root, a.bar)
    except ValueError as e:
        p.error(str(e))
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    main()
