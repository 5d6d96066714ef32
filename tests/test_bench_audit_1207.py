"""`jsparse bench` audit: bad arguments end in one error naming the flag, the value and what was expected, before any
model, cache or timing (counts of zero or less, contexts past the model shape's positions, an --out with a file in
its way, a --budget that no listed method reads, damaged `model_table` inputs)."""

import json
import types

import jax
import pytest

from eval.bench import common
from eval.bench import model as bench_model


def _module(name):
    import importlib

    return importlib.import_module(f"eval.bench.{name}")


def _refused(capsys, name, argv) -> str:
    """The error line `jsparse bench NAME argv` exits with (argparse's exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        _module(name).main(argv, **({} if name == "attention" else {"prog": f"jsparse bench {name}"}))
    assert exit_.value.code == 2, (name, argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("name,argv,message", [
    ("model", ["--steps", "0"], "argument --steps: '0': expected a positive integer"),
    ("model", ["--context", "1024,-5"], "argument --context: '-5': expected a positive integer"),
    ("model", ["--methods", "dense,kascade", "--prefill-context", "4K"],
     "argument --prefill-context: '4K': expected a positive integer"),
    ("attention", ["--batch", "0"], "argument --batch: '0': expected a positive integer"),
    ("profile_decode_step", ["--steps", "-1"], "argument --steps: '-1': expected a positive integer"),
    ("sharded", ["--rounds", "0", "--compare-unsharded"], "argument --rounds: '0': expected a positive integer"),
    ("sharded", ["--devices", "1,x"], "argument --devices: 'x': expected a positive integer"),
    ("evosparse", ["--batches", "1,0"], "argument --batches: '0': expected a positive integer"),
    ("evosparse", ["--batches", ""], "--batches is empty"),
    ("tsa", ["--lengths", "32768,abc"], "argument --lengths: 'abc': expected a positive integer"),
    ("tsa", ["--fractions", "0.5,1.5"], "--fractions 0.5,1.5: kept_fraction=1.5: expected"),
    ("tsa_scoring", ["--lengths", "0"], "argument --lengths: '0': expected a positive integer"),
    ("logit_mse", ["--heads", "0"], "argument --heads: '0': expected a positive integer"),
    ("sparse_attention", ["--contexts", "32768,-1"], "argument --contexts: '-1': expected a positive integer"),
    ("sparse_prefill_mgpu", ["--tiles", "128,0"], "argument --tiles: '0': expected a positive integer"),
    ("sparse_prefill_mgpu", ["--min-tokens", "-1"], "argument --min-tokens: '-1': expected an integer >= 0"),
    ("attention", ["--min-tokens", "-5"], "argument --min-tokens: '-5': expected an integer >= 0"),
    ("decode_step", ["--steps", "0"], "argument --steps: '0': expected a positive integer"),
    ("decode_step", ["--cases", "32768:1,100000"], "--cases: '100000' is not a case: expected context:batch"),
    ("decode_step", ["--paths", "dense_inplace,sparse"], "unknown ['sparse']; expected some of"),
    ("butler_coverage", ["--samples", "0"], "argument --samples: '0': expected a positive integer"),
    ("butler_coverage", ["--dense-count", "-2"], "--dense-count -2: expected a number of layers >= 0"),
    ("recipe_time", ["--repeat", "-1"], "--repeat -1: expected an integer >= 0"),
])
def test_counts_and_lists_name_the_flag_and_the_bad_value(capsys, name, argv, message):
    """Before: --steps 0 divided by zero after the model was built, a negative context reached the cache's shape,
    'abc' read as `invalid literal for int()`, --dense-count -2 wrote all but two layers into the artifact, a bad
    --cases or --paths of decode_step failed in its child processes and the JSON came back empty."""
    assert message in _refused(capsys, name, argv)


@pytest.mark.parametrize("name,argv,message", [
    ("model", ["--context", "8192,200000"], "--context 200000: longer than the llama3-8b shape's context of 131072"),
    ("model", ["--methods", "dense,kascade", "--context", "1024", "--prefill-context", "140000", "--shape", "qwen3-8b"],
     "--prefill-context 140000: longer than the qwen3-8b shape's context of 131072"),
    ("op_census", ["--method", "kascade", "--context", "131073"], "--context 131073: longer than the llama3-8b"),
    ("profile_decode_step", ["--context", "200000"], "--context 200000: longer than the llama3-8b"),
    ("sharded", ["--context", "140000"], "--context 140000: longer than the llama3-8b"),
    ("decode_step", ["--cases", "32768:1,200000:4"], "--cases 200000: longer than the llama3-8b"),
    ("model", ["--shape", "llama-8b"], "--shape: unknown model shape 'llama-8b'; expected one of"),
    ("profile_decode_step", ["--shape", "nope"], "unknown model shape 'nope'; expected one of"),
])
def test_a_context_past_the_shapes_positions_is_refused(capsys, name, argv, message):
    """Before: the cache and RoPE ran past max_position_embeddings without a word (traced lengths are not checked)."""
    assert message in _refused(capsys, name, argv)


def test_attention_refuses_a_context_past_the_shape_and_a_word_naming_the_flag():
    attention = _module("attention")
    with pytest.raises(ValueError, match=r"--context 200000: longer than the llama3-8b shape's context of 131072"):
        attention.main(["--context", "200000", "--interpret"])
    with pytest.raises(ValueError, match=r"--context '64,abc': 'abc': expected a positive integer"):
        attention.main(["--context", "64,abc", "--interpret"])  # before: invalid literal for int() with base 10


@pytest.mark.parametrize("name,argv,message", [
    ("model", ["--methods", "dense,evosparse", "--budget", "0.3"],
     "--budget 0.3: ['dense', 'evosparse'] are built without it"),
    ("profile_decode_step", ["--method", "evosparse", "--budget", "0.2"], "--budget 0.2: ['evosparse'] are built"),
    ("profile_decode_step", ["--method", "kascade", "--budget", "1.5"], "--budget 1.5: expected a kept fraction"),
])
def test_a_budget_no_listed_method_reads_is_refused(capsys, name, argv, message):
    """Before: EvoSparse (its 2048-token budget) and dense ran as if no --budget had been given, and the JSON
    recorded the budget; profile_decode_step took --budget 1.5 unchecked."""
    assert message in _refused(capsys, name, argv)


def test_model_accepts_a_budget_when_one_listed_method_reads_it(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_model, "run_methods", lambda *a, **k: calls.append(a))
    bench_model.main(["--methods", "dense,evosparse,kascade", "--budget", "0.3", "--context", "1024", "--batch", "1",
                      "--out", ""])
    assert calls and calls[0][6] == 0.3  # the budget reaches the run


def test_an_out_with_a_file_in_its_way_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    """Before: os.makedirs raised FileExistsError / NotADirectoryError (a traceback), and in most benchmarks only
    after the whole run, when the JSON was written."""
    blocker = tmp_path / "results.json"
    blocker.write_text("{}")
    for out in (str(blocker) + "/", str(blocker / "run.json")):
        with pytest.raises(ValueError, match=rf"--out {out}: .*results.json cannot be a folder, a file is in its way"):
            common.out_path(out, "x.json")
    monkeypatch.setattr(bench_model, "run", lambda *a, **k: pytest.fail("ran with an --out it cannot write"))
    message = _refused(capsys, "model", ["--context", "1024", "--batch", "1", "--out", str(blocker / "b.json")])
    assert "results.json cannot be a folder" in message and "bench_model.json" in message
    message = _refused(capsys, "op_census", ["--method", "dense", "--out", str(blocker) + "/"])
    assert f"--out {blocker}/" in message and "op_census.json" in message


def test_sharded_refuses_more_devices_than_the_host_has_before_timing(capsys, monkeypatch):
    """Before: the 1-device cases ran, then mesh_for raised for 2 and nothing was written."""
    sharded = _module("sharded")
    monkeypatch.setattr(sharded, "run_sharded", lambda *a, **k: pytest.fail("timed with a device count it lacks"))
    n = len(jax.devices()) + 1
    message = _refused(capsys, "sharded", ["--tiny", "--devices", f"1,{n}"])
    assert f"--devices 1,{n}: {n} devices asked, {n - 1} available" in message


def test_butler_coverage_refuses_a_dense_count_above_the_layers_and_a_long_window(capsys, monkeypatch):
    """Before: --dense-count above the eligible layers was cut to them silently, and written into the artifact."""
    import dataclasses

    import jsparse
    from models.presets import preset

    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=6, max_position_embeddings=2048)
    monkeypatch.setattr(jsparse, "load", lambda *a, **k: types.SimpleNamespace(cfg=cfg))
    message = _refused(capsys, "butler_coverage", ["--dense-count", "5"])
    assert "--dense-count 5: the model has 4 layers past its default dense_layers (2)" in message
    message = _refused(capsys, "butler_coverage", ["--length", "4096"])
    assert "--length 4096: longer than the smollm2 model's context of 2048 tokens" in message


def _write(path, payload):
    path.write_text(json.dumps(payload))
    return str(path)


def test_model_table_names_a_damaged_row_and_writes_into_a_folder_out(tmp_path, capsys):
    """Before: rows of another kind ended in AttributeError / KeyError tracebacks; --out DIR raised
    IsADirectoryError and --out into a new folder FileNotFoundError (after the table was made)."""
    model_table = _module("model_table")
    rows_dict = _write(tmp_path / "a.json", {"benchmark": "model_methods", "rows": {"dense": 1}})
    assert "a.json: rows is a dict: expected a list of rows" in _refused(capsys, "model_table", [rows_dict])
    no_tps = _write(tmp_path / "b.json", {"benchmark": "model_methods", "rows": [
        {"phase": "decode", "method": "kascade", "context": 1024, "batch": "4"}]})
    message = _refused(capsys, "model_table", [no_tps])
    assert "b.json: decode row 0 ('kascade') lacks ['batch', 'tokens_per_s']" in message
    good = _write(tmp_path / "c.json", {"benchmark": "model_methods", "rows": [
        {"phase": "decode", "method": "dense", "context": 1024, "batch": 1, "tokens_per_s": 50.0}]})
    folder = tmp_path / "tables"
    folder.mkdir()
    assert model_table.main([good, "--out", str(folder)]) == 0
    assert "| dense | [50](" in (folder / "model_table.md").read_text()
    assert model_table.main([good, "--out", str(tmp_path / "new" / "t.md")]) == 0
    assert (tmp_path / "new" / "t.md").read_text() == (folder / "model_table.md").read_text()
    capsys.readouterr()
    assert "c.json cannot be a folder" in _refused(capsys, "model_table", [good, "--out", good + "/t.md"])


def test_positive_int_helpers_as_argparse_types():
    import argparse

    assert common.positive_ints(" 8192, 32768,") == [8192, 32768] and common.positive_ints("") == []
    for bad in ("0", "-3", "1.5", "2e3", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"'{bad}': expected a positive integer"):
            common.positive_int(bad)
    assert common.nonnegative_int("0") == 0 and common.nonnegative_int(" 7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match=r"'-1': expected an integer >= 0"):
        common.nonnegative_int("-1")
    cfg = bench_model.preset("llama3-8b")
    common.check_contexts("--context", [131072], cfg, "llama3-8b")  # the shape's own context fits
    with pytest.raises(ValueError, match=r"--context 131073,200000: longer"):
        common.check_contexts("--context", [1024, 131073, 200000], cfg, "llama3-8b")


@pytest.mark.parametrize("name,argv,smoke", [
    ("evosparse", [], None), ("tsa", [], None), ("sparse_attention", [], None), ("prefill_gqa", [], "--smoke"),
    ("topk_select", [], "TOPK_SMOKE=1"), ("local_attention", [], None), ("profile_ops", [], None),
    ("evosparse_parts", [], None), ("anchor_mgpu", ["--out", "OUT"], None),
    ("sparse_prefill_mgpu", [], "--interpret"), ("anchor_variants", [], None), ("tsa_scoring", [], None),
])
def test_a_gpu_benchmark_on_a_cpu_host_is_refused_before_it_measures(tmp_path, capsys, monkeypatch, name, argv,
                                                                       smoke):
    """Before: these started timing Llama-3.1-8B shapes on the CPU (hours, or out of memory), and anchor_variants and
    tsa_scoring printed a line of their own; now each ends in one error naming the backend (and the CPU smoke run's
    flag where there is one), before its --out is made. (The backend is the CPU's here on any host.)"""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    out = tmp_path / "out"
    message = _refused(capsys, name, [str(out) if a == "OUT" else a for a in argv])
    assert f"jsparse bench {name} times GPU kernels at real model shapes; this host's JAX backend is 'cpu': " \
           "expected 'gpu'" in message
    assert (f"(or {smoke} for a CPU smoke run at tiny sizes)" in message) == (smoke is not None)
    assert not out.exists()


def test_attention_checks_its_flags_before_making_out_and_refuses_a_cpu_backend(tmp_path, monkeypatch):
    """A bad --budget left the --out folder made before it was checked; the CPU refusal is the shared one, naming
    --interpret."""
    attention = _module("attention")
    out = tmp_path / "runs" / "attn.json"
    with pytest.raises(ValueError, match=r"--budget"):
        attention.main(["--context", "256", "--budget", "1.5", "--interpret", "--out", str(out)])
    assert not out.parent.exists()
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(ValueError, match=r"jsparse bench attention times GPU kernels .* \(or --interpret for a CPU "):
        attention.main(["--context", "256", "--out", str(out)])
    assert not out.parent.exists()


def test_decode_step_on_a_cpu_host_stops_at_its_first_child(tmp_path, capsys):
    """Before: its orchestrator (which starts no JAX backend: the children need the GPU's memory) ran the main child
    and every XLA-flag variant on the CPU for about five minutes and wrote a JSON of skipped rows; now the first child
    refuses (the tests' backend is the CPU's) and the orchestrator stops with that error, writing no JSON."""
    out = tmp_path / "out"
    assert _module("decode_step").main(["--out", str(out)], prog="jsparse bench decode_step") == 2
    err = capsys.readouterr().err
    assert "jsparse bench decode_step: error: jsparse bench decode_step times GPU kernels at real model shapes; " \
           "this host's JAX backend is 'cpu': expected 'gpu' (or --smoke for a CPU smoke run at tiny sizes)" in err
    assert not any(out.rglob("*.json"))
