"""`jsparse bench recipe_time`: the README recipe's arguments, the extrapolation arithmetic, the plan, and the tool
end to end on a tiny random model on the CPU (its own tokenizer, synthetic artifacts, the harness's calls)."""

import json
import os
import re
import shlex

import pytest

from eval.bench import recipe_time as rt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_recipe_args_are_the_readmes_recipe():
    """RECIPE_ARGS is the README's `jsparse eval` recipe less --model, --artifact and --out, in its order."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    line = re.search(r"^jsparse eval --model /models/Llama-3\.1-8B\S* .*$", readme, re.M).group(0)
    words, kept = shlex.split(line)[2:], []
    while words:
        w = words.pop(0)
        if w in ("--model", "--artifact", "--out"):
            words.pop(0)
        else:
            kept.append(w)
    assert kept == shlex.split(rt.RECIPE_ARGS)


def test_recipe_counts_batch_as_the_harness():
    """The README recipe at 4K: 11 prompts per sample (passkey + 10 generation tasks) x 20 = 220 in calls of 16 rows
    (65536 // 4096) -> 14 calls; 32K: rows 2, 110 calls; ppl continuation: 20 windows in batches of 16 / 2."""
    spec, _ = rt.recipe_spec(rt.RECIPE_ARGS)
    c4, c32 = rt.recipe_counts(spec, 4096), rt.recipe_counts(spec, 32768)
    assert (c4["gen_prompts"], c4["gen_rows"], c4["gen_calls"]) == (220, 16, 14)
    assert (c32["gen_prompts"], c32["gen_rows"], c32["gen_calls"]) == (220, 2, 110)
    assert c4["ppl"] == {"continuation": {"rows": 16, "calls": 2}}
    assert c32["ppl"] == {"continuation": {"rows": 2, "calls": 10}}
    assert rt.default_plan(spec.methods, spec.lengths) == "*@32768,dense@*,*@4096,*@16384,*@8192"
    assert rt.parse_plan(rt.default_plan(spec.methods, spec.lengths), spec.methods, spec.lengths)[9:12] == [
        ("dense", 4096), ("dense", 8192), ("dense", 16384)]  # every method at 32K, then dense at the others


def test_plan_cells_in_order_once():
    methods, lengths = ("dense", "kascade", "quest"), (1024, 4096)
    assert rt.parse_plan("dense@*,*@4096,kascade@1024,dense@1024", methods, lengths) == [
        ("dense", 1024), ("dense", 4096), ("kascade", 4096), ("quest", 4096), ("kascade", 1024)]
    with pytest.raises(ValueError, match="method 'h2o' is not in the recipe"):
        rt.parse_plan("h2o@1024", methods, lengths)
    with pytest.raises(ValueError, match="length 2048 is not in the recipe"):
        rt.parse_plan("dense@2048", methods, lengths)
    with pytest.raises(ValueError, match="expected METHOD@LENGTH"):
        rt.parse_plan("dense", methods, lengths)


def _t(run, comp):
    return {"run_s": run, "compile_s": comp}


COUNTS = {1024: {"gen_prompts": 10, "gen_rows": 4, "gen_calls": 3, "ppl": {"continuation": {"rows": 2, "calls": 5}}},
          4096: {"gen_prompts": 10, "gen_rows": 1, "gen_calls": 10,
                 "ppl": {"continuation": {"rows": 1, "calls": 10}}}}
RUNS = {1024: {"dense": 1, "kascade": 3}, 4096: {"dense": 1, "kascade": 3, "quest": 3}}
TIMES = {("dense", 1024): {"gen": _t(2.0, 10.0), "ppl:continuation": _t(1.0, 5.0)},
         ("dense", 4096): {"gen": _t(4.0, 12.0), "ppl:continuation": _t(3.0, 6.0)},
         ("kascade", 1024): {"gen": _t(3.0, 20.0), "ppl:continuation": _t(2.0, 8.0)}}


def test_extrapolation_sums_calls_compilations_and_fills_cells():
    x = rt.extrapolate(COUNTS, RUNS, TIMES, {"kascade": True, "quest": False}, {("kascade", 1024): 0.5},
                       {1024: 1.0, 4096: 2.0}, fixed_s=0.5)
    cells = {(c["method"], c["length"]): c for c in x["cells"]}
    assert set(cells) == {(m, L) for L, r in RUNS.items() for m in r}
    # dense at 1K: 3 gen calls x 2 s + 5 ppl batches x 1 s, one compilation of each (10 + 5 s).
    assert (cells["dense", 1024]["run_s"], cells["dense", 1024]["compile_s"]) == (11.0, 15.0)
    # kascade at 1K: 3 budgets x (3 x 3 + 5 x 2) + 3 x 0.5 s overhead; it recompiles per budget: 3 x (20 + 8).
    assert (cells["kascade", 1024]["run_s"], cells["kascade", 1024]["compile_s"]) == (58.5, 84.0)
    # kascade at 4K: dense's 4K time x kascade's ratio to dense at 1K (gen 4 x 3/2, ppl 3 x 2/1), its 1K compile.
    k4 = cells["kascade", 4096]
    assert k4["kinds"]["gen"]["source"] == "ratio to dense at 1024" and k4["kinds"]["gen"]["call_s"] == 6.0
    assert k4["kinds"]["ppl:continuation"]["call_s"] == 6.0
    assert (k4["run_s"], k4["compile_s"]) == (3 * (10 * 6 + 10 * 6) + 1.5, 84.0)
    # quest, never measured: dense's times; one compilation of each kind for its three budgets.
    q4 = cells["quest", 4096]
    assert q4["kinds"]["gen"]["source"] == "dense's (not measured)"
    assert (q4["run_s"], q4["compile_s"]) == (3 * (10 * 4 + 10 * 3), 18.0)
    assert cells["dense", 4096]["total_s"] == 10 * 4 + 10 * 3 + 18
    total = 26 + 142.5 + 88 + 445.5 + 228 + 3.0 + 0.5
    assert x["total_s"] == pytest.approx(total) and x["total_h"] == pytest.approx(total / 3600)
    assert x["total_s"] == pytest.approx(x["run_s"] + x["compile_s"] + x["prompts_s"] + x["fixed_s"])
    assert x["by_method_s"]["kascade"] == pytest.approx(142.5 + 445.5)
    assert x["by_length_s"]["4096"] == pytest.approx(88 + 445.5 + 228)
    assert cells["kascade", 1024]["kinds"]["gen"]["per_prompt_s"] == 0.75  # 3 s per call of 4 rows
    assert x["unknown"] == [] and x["failed"] == []


def test_extrapolation_without_dense_at_the_length_and_with_failures():
    times = {k: v for k, v in TIMES.items() if k != ("dense", 4096)}
    x = rt.extrapolate(COUNTS, RUNS, times, {}, failed=[("dense", 1024)])
    cells = {(c["method"], c["length"]): c for c in x["cells"]}
    assert ("dense", 1024) not in cells and x["failed"] == [["dense", 1024]]
    assert cells["kascade", 4096]["kinds"]["gen"]["source"] == "own time at 1024"
    assert cells["kascade", 4096]["kinds"]["gen"]["call_s"] == 3.0
    assert cells["dense", 4096]["kinds"]["gen"]["source"] == "own time at 1024"
    assert cells["quest", 4096]["kinds"]["gen"]["source"] == "unknown" and cells["quest", 4096]["total_s"] == 0.0
    assert ["quest", 4096, "gen"] in x["unknown"]


def test_nearest_length_in_log2_ties_to_the_longer():
    assert rt._nearest(2048, {1024, 4096}) == 4096
    assert rt._nearest(8192, {1024, 4096, 32768}) == 4096
    assert rt._nearest(8192, set()) is None


def test_compile_clock_counts_nested_spans_once():
    rt.CompileClock._spans[:] = [(1.0, 4.0), (2.0, 3.0), (5.0, 6.0), (9.0, 12.0)]
    try:
        assert rt.CompileClock.seconds(0.0, 10.0) == 3.0 + 1.0 + 1.0
    finally:
        rt.CompileClock._spans.clear()


TINY_RECIPE = ("--dtype float32 --methods dense,kascade,tsa+kascade,evosparse --tasks niah_single_number,passkey,coref,"
               "ppl --lengths 384,768 --budgets 0.1,0.2 --samples 3 --haystack corpus --ppl-variants continuation "
               "--max-batch-tokens 1536")


def test_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """Through `jsparse bench recipe_time`: the plan's cells are measured by the harness's calls at the recipe's
    shapes, the others extrapolated, and the JSON holds what was measured and the extrapolation."""
    from jsparse.cli import main

    out = tmp_path / "rt.json"
    assert main(["bench", "recipe_time", "--shape", "tiny", "--recipe", TINY_RECIPE, "--plan", "dense@*,kascade@384",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    d = json.loads(out.read_text())
    for key in ("device", "date", "commit", "command"):
        assert d[key]
    assert d["command"].startswith("jsparse bench recipe_time") and d["weights"] == "random"
    assert d["plan"]["cells"] == ["dense@384", "dense@768", "kascade@384"] and d["skipped_cells"] == []
    assert [(c["method"], c["length"]) for c in d["cells"]] == [("dense", 384), ("dense", 768), ("kascade", 384)]
    # 3 tasks built (coref with the recipe's corpus haystack uses its own story): 3 x 3 prompts in calls of at
    # most 1536 // 384 = 4 rows, balanced: 3 calls of 3 (at 768: 5 calls of 2).
    assert d["prompt_errors"] == {} and "note_prompt_errors" not in d
    assert d["recipe"]["calls"]["384"] == {"gen_prompts": 9, "gen_rows": 3, "gen_calls": 3,
                                           "ppl": {"continuation": {"rows": 3, "calls": 1}}}
    assert d["recipe"]["calls"]["768"]["gen_calls"] == 5 and d["recipe"]["decode_steps_per_gen_call"] == 12
    for c in d["cells"]:
        assert "error" not in c, c
        for kind in ("gen", "ppl:continuation"):
            assert c[kind]["run_s"] > 0 and c[kind]["compile_s"] > 0
            assert c[kind]["wall_s"] == pytest.approx(c[kind]["run_s"] + c[kind]["compile_s"])
    assert d["cells"][2]["budget"] == 0.2  # the middle of (0.1, 0.2)
    assert "synthetic" in d["state"]["kascade"] and "synthetic" in d["state"]["tsa+kascade"]
    assert d["recompiles_per_budget"]["dense"] is False
    x = d["extrapolation"]
    cells = {(c["method"], c["length"]): c for c in x["cells"]}
    assert len(cells) == 8 and x["unknown"] == [] and x["failed"] == []
    assert cells["kascade", 768]["kinds"]["gen"]["source"] == "ratio to dense at 384"
    assert cells["evosparse", 768]["kinds"]["gen"]["source"] == "dense's (not measured)"
    assert cells["kascade", 384]["runs"] == 2 and cells["dense", 384]["runs"] == 1
    measured = d["cells"][0]["gen"]["run_s"]
    assert cells["dense", 384]["kinds"]["gen"]["call_s"] == measured
    assert x["total_s"] == pytest.approx(sum(c["total_s"] for c in x["cells"]) + x["prompts_s"] + x["fixed_s"])
    assert x["prompts_s"] > 0 and x["not_counted"]
    assert printed[-1].startswith("extrapolated recipe:")


def test_time_limit_skips_cells_and_leaves_them_unknown(tmp_path, capsys):
    out = tmp_path / "rt.json"
    rt.main(["--shape", "tiny", "--recipe", TINY_RECIPE.replace("coref,", ""), "--time-limit", "0",
             "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["cells"] == [] and len(d["skipped_cells"]) == 8
    assert d["prompt_errors"] == {} and len(d["extrapolation"]["unknown"]) == 16
    assert "NOT in the total: 8 cells without a time" in capsys.readouterr().out


def _cell(method, length, gen=None, ppl=None, error=None, overhead=0.5):
    c = {"method": method, "length": length, "budget": 0.1}
    if error:
        return {**c, "error": error}
    return {**c, "overhead_s": overhead, "gen": {**_t(*gen), "rows": 4}, "ppl:continuation": {**_t(*ppl), "rows": 2}}


def _record(date, commit, cells, **over):
    """A recipe_time record of the COUNTS / RUNS recipe (as run() writes it) with the given cells."""
    d = {"benchmark": "recipe_time", "device": "NVIDIA H100 80GB HBM3", "platform": "gpu", "jax": "0.11.2",
         "xla_flags": "", "shape": "llama3-8b", "dtype": "bfloat16", "weights": "random", "measured_budget": 0.1,
         "state": {"kascade": "synthetic"}, "recompiles_per_budget": {"dense": False, "kascade": True, "quest": False},
         "recipe": {"args": "--methods dense,kascade,quest", "methods": ["dense", "kascade", "quest"],
                    "lengths": [1024, 4096], "calls": {str(L): c for L, c in COUNTS.items()},
                    "decode_steps_per_gen_call": 12},
         "runs_per_length": {str(L): r for L, r in RUNS.items()}, "prompts_s": {"1024": 1.0, "4096": 2.0},
         "setup_s": {"tokenizer": 9.0, "fingerprint": 0.25, "build_methods": 0.125, "tokenize_corpus": 0.125},
         "date": date, "commit": commit, "command": f"jsparse bench recipe_time ({commit})", "prompt_errors": {},
         "measured_part_s": 100.0, "cells": cells, "skipped_cells": []}
    d.update(over)
    return d


A = _record("2026-11-25T12:32:17+00:00", "aaa", [
    _cell("dense", 1024, (2.0, 10.0), (1.0, 5.0)), _cell("kascade", 1024, error="RESOURCE_EXHAUSTED: 63 GiB")])
B = _record("2026-11-25T12:36:01+00:00", "bbb", [
    _cell("dense", 1024, (2.5, 9.0), (1.5, 4.0)), _cell("dense", 4096, (4.0, 12.0), (3.0, 6.0)),
    _cell("kascade", 1024, (3.0, 20.0), (2.0, 8.0))])


def test_merge_takes_each_cell_from_the_latest_run_and_extrapolates_from_all():
    for order in ([("a.json", A), ("b.json", B)], [("b.json", B), ("a.json", A)]):  # by date, not by argument order
        m = rt.merge_runs(order)
        assert [(r["file"], r["commit"]) for r in m["runs"]] == [("a.json", "aaa"), ("b.json", "bbb")]
        cells = {(c["method"], c["length"]): c for c in m["cells"]}
        assert set(cells) == {("dense", 1024), ("dense", 4096), ("kascade", 1024)}
        d1 = cells["dense", 1024]
        assert (d1["run"], d1["file"], d1["gen"]["run_s"]) == (1, "b.json", 2.5)
        assert d1["superseded"] == [{"run": 0, "file": "a.json", "gen_run_s": 2.0, "gen_compile_s": 10.0}]
        k1 = cells["kascade", 1024]
        assert "error" not in k1 and k1["superseded"][0]["error"].startswith("RESOURCE_EXHAUSTED")
        # The extrapolation is extrapolate's over the chosen cells, with the latest run's prompts and setup.
        times = {("dense", 1024): {"gen": _t(2.5, 9.0), "ppl:continuation": _t(1.5, 4.0)},
                 ("dense", 4096): TIMES["dense", 4096], ("kascade", 1024): TIMES["kascade", 1024]}
        want = rt.extrapolate(COUNTS, RUNS, times, B["recompiles_per_budget"],
                              {("dense", 1024): 0.5, ("dense", 4096): 0.5, ("kascade", 1024): 0.5},
                              {1024: 1.0, 4096: 2.0}, fixed_s=0.5)
        x = m["extrapolation"]
        assert x["failed"] == [] and x["total_s"] == pytest.approx(want["total_s"])
        assert x["by_method_s"] == pytest.approx(want["by_method_s"]) and x["prompts_s"] == 3.0
        # dense at 1K: 3 x 2.5 + 5 x 1.5 + 0.5 overhead, compiled once (9 + 4).
        assert {(c["method"], c["length"]): c for c in x["cells"]}["dense", 1024]["total_s"] == 15.5 + 13.0
        assert m["device"] == "NVIDIA H100 80GB HBM3" and m["commit"] == "aaa, bbb"
        assert m["date"] == B["date"] and m["merged_by"]["commit"] and m["measured_part_s"] == 200.0
        assert m["not_measured"] == ["kascade@4096", "quest@4096"]  # the recipe's cells (RUNS) without a time


def test_merge_a_later_failure_wins_and_mismatches_are_refused():
    C = _record("2026-11-25T13:00:00+00:00", "ccc", [_cell("dense", 4096, error="RESOURCE_EXHAUSTED")])
    m = rt.merge_runs([("a.json", A), ("b.json", B), ("c.json", C)])
    cells = {(c["method"], c["length"]): c for c in m["cells"]}
    assert cells["dense", 4096]["run"] == 2 and m["extrapolation"]["failed"] == [["dense", 4096]]
    assert cells["dense", 4096]["superseded"] == [{"run": 1, "file": "b.json", "gen_run_s": 4.0,
                                                   "gen_compile_s": 12.0}]
    with pytest.raises(ValueError, match="b.json and a.json differ in shape"):
        rt.merge_runs([("a.json", A), ("b.json", {**B, "shape": "qwen3-8b"})])
    with pytest.raises(ValueError, match="differ in recipe"):
        rt.merge_runs([("a.json", A), ("b.json", {**B, "recipe": {**B["recipe"], "args": "--methods dense"}})])
    with pytest.raises(ValueError, match="differ in device"):
        rt.merge_runs([("a.json", A), ("b.json", {**B, "device": "NVIDIA H200"})])


def test_merge_older_records_and_merged_files():
    """Records written before runs_per_length / prompts_s take them from their extrapolation; a merged file merges
    again as its runs."""
    old = {k: v for k, v in A.items() if k not in ("runs_per_length", "prompts_s")}
    old["extrapolation"] = rt.extrapolate(COUNTS, RUNS, {("dense", 1024): TIMES["dense", 1024]}, {}, {},
                                          {1024: 1.0, 4096: 2.0}, failed=[("kascade", 1024)])
    m = rt.merge_runs([("old.json", old)])
    # Every method of the recipe at every length (kascade@1K failed: its count at another length; quest too).
    assert m["runs_per_length"] == {"1024": {"dense": 1, "kascade": 3, "quest": 3}, "4096": RUNS[4096]}
    assert m["prompts_s"] == {"all": 3.0} and m["extrapolation"]["prompts_s"] == 3.0
    assert m["runs"][0]["extrapolated_total_h"] == old["extrapolation"]["total_h"]
    again = rt.merge_runs([("m.json", rt.merge_runs([("a.json", A), ("b.json", B)])),
                           ("c.json", _record("2026-11-25T13:00:00+00:00", "ccc",
                                              [_cell("quest", 4096, (5.0, 1.0), (4.0, 1.0))]))])
    assert [r["file"] for r in again["runs"]] == ["a.json", "b.json", "c.json"]
    cells = {(c["method"], c["length"]): c for c in again["cells"]}
    assert cells["dense", 1024]["file"] == "b.json" and cells["quest", 4096]["run"] == 2


def test_merge_command_measures_nothing(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    rt.main(["--merge", str(a), str(b), "--out", str(out)])
    m = json.loads(out.read_text())
    assert [r["file"] for r in m["runs"]] == [str(a), str(b)] and m["platform"] == "gpu"
    assert m["extrapolation"]["total_s"] == pytest.approx(rt.merge_runs([(str(a), A), (str(b), B)])[
        "extrapolation"]["total_s"])
    printed = capsys.readouterr().out
    assert "2 runs merged" in printed and "extrapolated recipe:" in printed
    with pytest.raises(SystemExit, match="not a recipe_time JSON"):
        (tmp_path / "x.json").write_text(json.dumps({"benchmark": "model"}))
        rt.main(["--merge", str(tmp_path / "x.json"), "--out", str(out)])


def test_a_run_merges_with_an_earlier_file(tmp_path):
    """--merge with --plan: the plan is measured and merged with the file's cells (this run the latest); a file
    of another recipe is refused before any forward."""
    first, out = tmp_path / "first.json", tmp_path / "merged.json"
    recipe = TINY_RECIPE.replace("--lengths 384,768", "--lengths 384")
    rt.main(["--shape", "tiny", "--recipe", recipe, "--plan", "dense@384", "--out", str(first)])
    rt.main(["--shape", "tiny", "--recipe", recipe, "--plan", "dense@384,kascade@384", "--merge", str(first),
             "--out", str(out)])
    m = json.loads(out.read_text())
    assert [r["file"] for r in m["runs"]] == [str(first), "this run"]
    cells = {(c["method"], c["length"]): c for c in m["cells"]}
    assert cells["dense", 384]["run"] == 1 and cells["dense", 384]["superseded"][0]["file"] == str(first)
    assert cells["kascade", 384]["run"] == 1 and m["not_measured"] == ["tsa+kascade@384", "evosparse@384"]
    assert m["runs"][0]["cells"][0]["gen"]["run_s"] == json.loads(first.read_text())["cells"][0]["gen"]["run_s"]
    with pytest.raises(SystemExit, match="differ in recipe"):
        rt.main(["--shape", "tiny", "--recipe", recipe.replace("--samples 3", "--samples 2"), "--plan", "dense@384",
                 "--merge", str(first), "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
