"""`jsparse bench model --methods`: every method's decode step in the library's own loop, with its bytes floor."""

import dataclasses
import math
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.bench import model as bench_model
from eval.bench import model_check
from models.params import random_params
from models.presets import preset


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=6, hidden_size=128, intermediate_size=256, num_heads=4,
                              num_kv_heads=2, head_dim=32, vocab_size=256)
    return cfg, random_params(cfg, jax.random.key(0), jnp.float32)  # CPU: f32 dots


def test_method_rows_time_every_method_beside_dense(tiny):
    cfg, params = tiny
    methods = ("dense", "kascade", "streaming", "h2o")
    rows = bench_model.method_rows(cfg, params, methods, [384], [2], 2, 1000.0, 0.25, prefill_contexts=[128],
                                   mm=100.0)
    decode = {r["method"]: r for r in rows if r["phase"] == "decode"}
    assert set(decode) == set(methods) and not any("error" in r for r in rows)
    assert decode["dense"]["speedup"] == 1.0 and decode["dense"]["floor_speedup"] == 1.0
    for m in methods[1:]:
        r = decode[m]
        assert r["step_ms"] > 0 and r["floor_speedup"] > 1.0  # reads fewer bytes than dense
        assert r["floor_fraction"] == pytest.approx(r["speedup"] / r["floor_speedup"])
    assert "synthetic" in decode["kascade"]["state"]
    assert {r["method"] for r in rows if r["phase"] == "prefill" and r["prefill_ms"] > 0} == set(methods)


def test_prefill_methods_get_prefill_rows_at_their_kept_share(tiny):
    """tsa and tsa+kascade: prefill rows only (their decode is dense's / Kascade's), each keeping the fixed share
    it was given on its sparse layers (random weights: coverage would keep nearly all)."""
    from jsparse.methods.kascade import Kascade
    from jsparse.methods.tsa import TSA
    cfg, params = tiny
    tsa, how = bench_model.bench_method("tsa", cfg, 0.25, tsa_kept=0.5)
    assert isinstance(tsa, TSA) and tsa.kept_fraction == 0.5 and tsa.inner is None and "0.5" in how
    both, how = bench_model.bench_method("tsa+kascade", cfg, 0.25, tsa_kept=0.5)
    assert isinstance(both.inner, Kascade) and both.kept_fraction == 0.5 and both.inner.budget == 0.25
    assert "anchors" in how and "0.5" in how
    small = dict(window=16, min_tokens=32)  # so that a 512-token prompt compresses (the defaults need > 1152)
    built = {"tsa": (tsa.replace(**small), "tsa"), "tsa+kascade": (both.replace(**small), "tsa+kascade")}
    methods = ("dense", "tsa", "tsa+kascade")
    rows = bench_model.method_rows(cfg, params, methods, [384], [1], 2, 1000.0, 0.25, prefill_contexts=[512],
                                   mm=100.0, built=built)
    assert not any("error" in r for r in rows), rows
    assert {r["method"] for r in rows if r["phase"] == "decode"} == {"dense"}
    pre = {r["method"]: r for r in rows if r["phase"] == "prefill"}
    assert set(pre) == set(methods) and all(r["prefill_ms"] > 0 and "speedup" in r for r in pre.values())
    for m in methods[1:]:
        assert pre[m]["tsa_sparse_layers"] == cfg.num_layers - 1  # every layer but 0
        assert pre[m]["tsa_kept_fraction"] == pytest.approx(0.5, abs=1e-3)
    assert "tsa_kept_fraction" not in pre["dense"]


def test_attention_bytes_follow_what_each_method_reads(tiny):
    cfg, _ = tiny
    n, B = 10_000, 2
    U = B * cfg.num_kv_heads * cfg.head_dim * 2
    dense = bench_model.attention_bytes("dense", None, cfg, B, n)
    assert dense == cfg.num_layers * 2 * n * U
    streaming, _ = bench_model.bench_method("streaming", cfg, 0.1)
    assert bench_model.attention_bytes("streaming", streaming, cfg, B, n) == cfg.num_layers * 2 * 1000 * U
    kascade, _ = bench_model.bench_method("kascade", cfg, 0.1)
    k_bytes = bench_model.attention_bytes("kascade", kascade, cfg, B, n)
    assert cfg.num_layers * 2 * 1000 * U < k_bytes < dense  # anchors read all of K, reuse layers the picked rows
    quest, _ = bench_model.bench_method("quest", cfg, 0.1)  # per query head: G sets of pages per KV head
    G, d, pages = cfg.num_heads // cfg.num_kv_heads, quest.dense_layers, -(-n // quest.page_size)
    assert bench_model.attention_bytes("quest", quest, cfg, B, n) == (  # f32 bounds: 2x a bf16 row of K
        d * 2 * n * U + (cfg.num_layers - d) * (2 * 2 * pages * U + G * 2 * 1000 * U))
    # H2O: its 500 carried candidates of each row (positions read and written, scores gathered; 500 = k - r, the most
    # heavy keys of 1000 with half of them the window), its 1000 kept entries' scores updated, and their entry sums
    # (each query head's f32, written by the decode and read by the mass add)
    h2o, _ = bench_model.bench_method("h2o", cfg, 0.1)
    rows = B * cfg.num_kv_heads
    assert h2o.kept_width(1000) == 500
    assert bench_model.attention_bytes("h2o", h2o, cfg, B, n) == cfg.num_layers * (
        2 * 1000 * U + 3 * rows * 500 * 4 + 2 * rows * 1000 * 4 + 2 * rows * 1000 * G * 4)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        bench_model.bench_method("nope", cfg, 0.1)


# ------------------------------------------------------------------------- the correctness check before timing


def _build(budget=0.1):
    """The methods as `jsparse bench model` builds them for its check (EvoSparse's budget scaled to the context)."""
    return lambda name, cfg: bench_model.bench_method(name, cfg, budget,
                                                      evo_budget_tokens=model_check.CHECK_EVO_TOKENS)[0]


@pytest.fixture
def fresh_jit():
    """Compiled steps traced with a patched module function must not outlive the patch (nor be reused by it)."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("name", bench_model.METHODS)
def test_check_passes_for_every_method(name):
    """Each method's real decode step (8 layers, 2 prompts of 384 and 301 tokens and 1 prompt of 301, 2 steps after
    the method's prefill) equals the masked reference over the keys it selected, layer by layer; the probe leaves
    the step's logits unchanged; the sparse methods select (well under every visible key) and a selection one key
    off would fail the tolerance."""
    shapes = (model_check.CHECK_LENGTHS, model_check.CHECK_ONE_ROW)
    c = model_check.run_checks(preset("llama3-8b"), [name], _build(), jnp.float32, shapes=shapes)[name]
    assert c["passed"], c
    assert [(s["batch"], s["lengths"], s["passed"]) for s in c["by_shape"]] == [(2, [384, 301], True),
                                                                               (1, [301], True)]
    assert c["err_over_tol"] == max(s["err_over_tol"] for s in c["by_shape"])  # the worst batch's fields
    assert c["err_over_tol"] <= 1.0 and c["max_abs_err"] < 1e-4  # f32 on the CPU: rounding only
    assert c["probe_logits_max_diff"] <= c["probe_logits_tol"]
    assert c["reference"].startswith("masked_attention_reference over the keys the method selected: ")
    assert c["shape"] == {"layers": 8, "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 128,
                          "batch": c["shape"]["batch"], "lengths": c["shape"]["lengths"], "decode_steps": 2,
                          "capacity": 512, "dtype": "float32"}
    kept = c["kept_fraction_per_layer"]
    if name == "dense":
        assert kept == [1.0] * 8
    else:
        assert 0.0 < min(kept) < 0.5 and c["wrong_selection_err_over_tol"] > 1.0


def test_check_measures_an_answer_in_the_gemm_rows(monkeypatch, fresh_jit):
    """On a GPU the model pads a forward's token rows for its GEMMs and a method may answer its decode attention in
    them ([1, R, Hq, D], `LayerContext.rows_out`: EvoSparse's one-launch finish). Padding forced on the CPU, the
    same method answering there passes its check (the probe measures its token rows: it compared the [1, R] rows
    with the [B, T] reference before, and failed), and an answer one token row off fails it."""
    from flax import struct

    from models import llama

    @struct.dataclass
    class InRows:  # a method answering in the GEMMs' rows when told them (shift: token rows moved down by one)
        inner: object
        shift: int = struct.field(pytree_node=False, default=0)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode(self, ctx, q, cache, state):
            out, state = self.inner.decode(ctx, q, cache, state)
            if ctx.rows_out is None:
                return out, state
            B, T = out.shape[:2]
            rows = jnp.roll(out.reshape((1, B * T) + out.shape[2:]), self.shift, axis=1)
            return jnp.pad(rows, [(0, 0), (0, ctx.rows_out - B * T), (0, 0), (0, 0)]), state

    monkeypatch.setattr(llama, "gemm_row_padding", lambda rows, dtype: -rows % 8 if rows > 1 else 0)
    for shift, passed in ((0, True), (1, False)):
        def build(name, cfg):
            return InRows(_build()(name, cfg), shift)
        c = model_check.run_checks(preset("llama3-8b"), ["streaming"], build, jnp.float32,
                                   raise_on_failure=False)["streaming"]
        assert c["passed"] is passed, c
    with pytest.raises(ValueError, match=r"decode attention of shape \(1, 3, 8, 4\): expected \[2, 2, ...\]"):
        model_check.token_rows(jnp.zeros((1, 3, 8, 4)), (2, 2, 8, 4))


def test_merge_checks_keeps_the_worst_batch_and_passes_only_if_every_batch_did():
    """A method checked at two batches: the merged check's fields are the failed batch's (even with the smaller
    err/tol: its logits failed), else the larger err/tol's; `by_shape` keeps each batch's verdict."""
    def check(batch, ratio, passed):
        return {"passed": passed, "err_over_tol": ratio, "max_abs_err": 2 * ratio,
                "shape": {"batch": batch, "lengths": [301] * batch}}
    merged = model_check.merge_checks([check(2, 0.4, True), check(1, 0.3, False)])
    assert not merged["passed"] and merged["err_over_tol"] == 0.3 and merged["shape"]["batch"] == 1
    assert merged["by_shape"] == [{"batch": 2, "lengths": [301, 301], "err_over_tol": 0.4, "passed": True},
                                  {"batch": 1, "lengths": [301], "err_over_tol": 0.3, "passed": False}]
    merged = model_check.merge_checks([check(2, 0.4, True), check(1, 0.7, True)])
    assert merged["passed"] and merged["err_over_tol"] == 0.7 and merged["max_abs_err"] == 1.4
    with pytest.raises(ValueError, match="expected at least one check"):
        model_check.merge_checks([])


@pytest.mark.parametrize("name", ["kascade", "evosparse"])
def test_check_fails_when_the_step_attends_other_keys(name, monkeypatch, fresh_jit):
    """An off-by-one in the indices handed to the attention kernel (Kascade's reuse layers; EvoSparse's blocks)
    fails the check in exactly the layers that have it, and the message names the method and its error."""
    from jsparse.methods import common, evosparse, kascade

    if name == "kascade":
        def shifted(q, cache, indices, lengths, head_map=None):
            return common.attend_selected(q, cache, jnp.where(indices >= 0, indices + 1, -1), lengths, head_map)
        monkeypatch.setattr(kascade, "attend_selected", shifted)
        bad_layers = [1, 4, 7]  # the reuse layers (anchors 0, 2, 3, 5, 6)
    else:
        real = evosparse.sparse_decode_heat

        def shifted(q, k_all, v_all, layer, idx, *args, **kw):
            return real(q, k_all, v_all, layer, jnp.where(idx >= 0, idx + 1, -1), *args, **kw)
        monkeypatch.setattr(evosparse, "sparse_decode_heat", shifted)
        bad_layers = list(range(2, 8))  # the sparse layers
    c = model_check.run_checks(preset("llama3-8b"), [name], _build(), jnp.float32, raise_on_failure=False)[name]
    assert not c["passed"] and c["err_over_tol"] > 1.0
    worst = [i for i, e in enumerate(c["err_per_layer"]) if e > 1e-3]
    assert worst == bad_layers, c["err_per_layer"]
    msg = model_check.failure_message({name: c})
    assert f"{name}: max_abs_err" in msg and "x the tolerance" in msg


def test_bench_checks_after_timing_and_exits_naming_a_failed_check(monkeypatch, tiny, tmp_path, capsys):
    """`jsparse bench model` times first, then checks each method in the same process (a check run before the
    timing slowed the timed steps): a failed check ends it with a non-zero exit naming the failed method, after
    the JSON is written with every check beside the rows; --no-check records the skip."""
    verdict = {"streaming": False}
    order = []

    def fake(name, method, cfg, params, lengths, **kw):
        order.append(("check", name, len(lengths)))
        return {"passed": verdict.get(name, True), "max_abs_err": 0.5, "err_over_tol": 7.0,
                "tol": {"rtol": 1e-3, "atol": 1e-3}, "wrong_selection_err_over_tol": 9.0,
                "probe_logits_max_diff": 0.0, "probe_logits_tol": 1e-3,
                "shape": {"batch": len(lengths), "lengths": list(lengths)}}
    cfg, _ = tiny
    monkeypatch.setattr(model_check, "check_method", fake)
    monkeypatch.setattr(model_check, "random_params", lambda *a: None)  # the fake check takes no weights
    monkeypatch.setattr(model_check, "with_layout", lambda params, *a, **k: params)
    monkeypatch.setattr(bench_model, "preset", lambda name: cfg)  # time the tiny model, not Llama-3.1-8B
    monkeypatch.setattr(bench_model.bm, "measure_hbm_gbs", lambda: order.append(("timing",)) or 1000.0)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    argv = ["--methods", "dense,streaming", "--context", "384", "--batch", "1", "--steps", "1", "--xla-flags", "",
            "--out", str(tmp_path / "bench.json")]
    with pytest.raises(SystemExit) as e:
        bench_model.main(argv, prog="jsparse bench model")
    # batch 1 timed: each method checked at the batch of two prompts and at one (the one-row paths)
    assert order == [("timing",), ("check", "dense", 2), ("check", "dense", 1), ("check", "streaming", 2),
                     ("check", "streaming", 1)]
    assert str(e.value.code).startswith("jsparse bench model: error: decode step differs from its masked reference")
    assert "streaming: max_abs_err 0.5, 7x the tolerance" in str(e.value.code) and "dense:" not in str(e.value.code)
    assert "do not use those methods' figures" in str(e.value.code)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert {m: c["check"]["passed"] for m, c in record["methods"].items()} == {"dense": True, "streaming": False}
    assert [s["batch"] for s in record["methods"]["dense"]["check"]["by_shape"]] == [2, 1]

    assert record["preallocate"] is None and "warning" not in capsys.readouterr().err

    verdict["streaming"] = True
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "False")  # the large rows' out-of-memory setting: a warning
    bench_model.main(argv, prog="jsparse bench model")
    assert ("jsparse bench model: warning: XLA_PYTHON_CLIENT_PREALLOCATE=False: the allocator grows on demand"
            in capsys.readouterr().err)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["preallocate"] == "False"
    assert {m: c["check"]["passed"] for m, c in record["methods"].items()} == {"dense": True, "streaming": True}
    assert {r["method"] for r in record["rows"] if "step_ms" in r} == {"dense", "streaming"}
    assert bench_model.method_checks(cfg, ("dense", "kascade"), 0.1, check=False) == {
        "dense": {"check": "skipped (--no-check)"}, "kascade": {"check": "skipped (--no-check)"}}


def test_prefill_flops_count_the_lm_head_once_per_row():
    cfg = preset("llama3-8b")
    T = 32768
    layers = cfg.num_layers * (cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
                               + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
    want = 2 * (layers + cfg.hidden_size) * T + 2 * cfg.vocab_size * cfg.hidden_size \
        + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T
    assert bench_model.prefill_flops(cfg, 1, T) == pytest.approx(want, rel=1e-12)
    assert bench_model.prefill_flops(cfg, 3, T) == pytest.approx(3 * want, rel=1e-12)


def test_attention_only_config_keeps_the_attention_and_cuts_the_rest():
    cfg = preset("llama3-8b")
    small = bench_model.attention_only_config(cfg)
    for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "rope", "vocab_size"):
        assert getattr(small, k) == getattr(cfg, k)
    assert small.hidden_size == small.intermediate_size == bench_model.ATTENTION_ONLY_WIDTH
    T = 131072
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T
    assert attn / bench_model.prefill_flops(small, 1, T) > 0.98  # the prefill is the attention's
    assert attn / bench_model.prefill_flops(cfg, 1, T) < 0.8


@pytest.mark.parametrize("argv,message", [
    (["--attention-only", "--context", "1024"], "--attention-only compares methods"),
    (["--methods", "dense,tsa", "--prefill-context", "4096", "--tsa-kept", "1.5"], "kept_fraction=1.5"),
    (["--methods", "dense,tsa", "--context", ""], "--prefill-context, or --methods without them"),
    (["--methods", "dense", "--context", ""], "--context is empty"),
    (["--context", "1024", "--budget", "0.2", "--prefill-context", "4096"],
     "--budget, --prefill-context: the per-method comparison's"),
    (["--context", "1024", "--tsa-kept", "0.5"], "--tsa-kept: the per-method comparison's"),
    (["--methods", "dense,kascade", "--context", "1024", "--budget", "7"], "--budget 7: expected a kept fraction"),
    (["--methods", "dense,kascade", "--context", "1024", "--budget", "0"], "--budget 0: expected a kept fraction"),
    (["--methods", "dense,kascade,tsa+kascade", "--context", "1024"], "['tsa+kascade'] time prefill rows only"),
    (["--methods", "dense,tsa+kascade,nope"], "unknown ['nope']"),
    (["--methods", "dense,kascade", "--method-option", "quest.page_size=16"], "names method 'quest'"),
    (["--method-option", "dense.tile=16", "--context", "1024"], "dense alone takes no options"),
    (["--methods", "dense,kascade", "--batch", "1,0"], "'0' is not a batch size"),
    (["--methods", "dense,kascade", "--batch", "4,most"], "'most' is not a batch size"),
    (["--methods", "dense,kascade", "--batch", "max"], "needs a device that reports its memory"),  # as the CPU
    (["--batch", "max", "--context", "1024"], "the decode comparison's"),
])
def test_cli_errors_name_the_value(argv, message, capsys, monkeypatch):
    if "reports its memory" in message:  # a device without memory_stats on any host (a GPU's reports it)
        monkeypatch.setattr(jax, "devices", lambda *a: [_Device(None)])
    with pytest.raises(SystemExit):
        bench_model.main(argv, prog="jsparse bench model")
    assert message in capsys.readouterr().err


def test_method_options_reach_the_method_and_misspellings_are_errors(tiny):
    """`--method-option`: kascade's options go to Kascade; tsa+kascade's are split as its builder splits them
    (Kascade's tile, TSA's capacity buckets); an option no method takes is an error naming it."""
    cfg, _ = tiny
    kascade, how = bench_model.bench_method("kascade", cfg, 0.25, options={"tile": 64, "prefill_block_size": 16})
    assert (kascade.tile, kascade.prefill_block_size, kascade.budget) == (64, 16, 0.25) and "tile" in how
    both, _ = bench_model.bench_method("tsa+kascade", cfg, 0.25, tsa_kept=0.5,
                                       options={"tile": 64, "capacity_buckets": 2})
    assert (both.inner.tile, both.capacity_buckets, both.kept_fraction) == (64, 2, 0.5)
    with pytest.raises(ValueError, match="'tilee'"):
        bench_model.bench_method("kascade", cfg, 0.25, options={"tilee": 64})
    with pytest.raises(ValueError, match="prefill_block_size=16"):
        bench_model.bench_method("tsa+kascade", cfg, 0.25, options={"prefill_block_size": 16})
    with pytest.raises(ValueError, match="dense takes no options"):
        bench_model.bench_method("dense", cfg, 0.25, options={"tile": 64})


def test_bench_params_are_random_weights_of_the_shapes_in_the_layout(tiny):
    """`bench_params` draws `random_params` and fuses them in one jitted program: the structure, shapes and dtypes
    of the eager build, weights of the same scale, norms ones; "separate" keeps the separate projections."""
    from models.params import is_fused, with_layout
    cfg, _ = tiny
    want = with_layout(random_params(cfg, jax.random.key(0), jnp.bfloat16), "default", donate=True)
    got = bench_model.bench_params(cfg)
    assert jax.tree.structure(got) == jax.tree.structure(want) and is_fused(got) == is_fused(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype == jnp.bfloat16
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        if bool(jnp.all(w == 1)):
            assert bool(jnp.all(g == 1))
        else:
            assert abs(float(jnp.std(g)) / float(jnp.std(w)) - 1) < 0.1
    assert not is_fused(bench_model.bench_params(cfg, "separate"))


class _Device:
    """A device whose allocator reports `stats` (jax Device.memory_stats)."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


# The H200 after `bench_params` at Llama-3.1-8B shapes, bf16 (eval/results/h200/largest_batch/oom_probe_b7_jit_*.json).
H200_AFTER_WEIGHTS = {"bytes_limit": int(132.8125 * 2**30), "bytes_in_use": int(14.957527 * 2**30),
                      "largest_free_block_bytes": int(117.854973 * 2**30)}


def test_largest_batch_is_what_the_h200_held_at_128k():
    """From the H200's allocator after the 8B weights: batch 7 at 128K (measured to fit; 8 needs 128 GiB of caches),
    a method's state lowers it only where it holds per-row memory, a fragmented pool counts its largest block, and a
    device without memory statistics or a context that leaves no room is an error naming it."""
    cfg = preset("llama3-8b")
    capacity = 131328  # round_up(131072 + 2 * 16 + 1, 256), as method_rows
    dense, _ = bench_model.bench_method("dense", cfg, 0.1)
    evo, _ = bench_model.bench_method("evosparse", cfg, 0.1)
    per_row, fixed = bench_model.decode_memory(cfg, dense, capacity, jnp.bfloat16)
    assert per_row == 2 * 32 * 8 * capacity * 128 * 2 and fixed == 0
    evo_row, _ = bench_model.decode_memory(cfg, evo, capacity, jnp.bfloat16)
    assert evo_row > per_row  # EvoSparse's heat: f32 per layer, row, KV head and position
    h200 = _Device(H200_AFTER_WEIGHTS)
    assert bench_model.largest_batch(cfg, [dense], capacity, jnp.bfloat16, h200) == 7
    assert bench_model.largest_batch(cfg, [dense, evo], capacity, jnp.bfloat16, h200) == 7
    assert bench_model.largest_batch(cfg, [dense], 100096, jnp.bfloat16, h200) == 9
    fragmented = _Device(dict(H200_AFTER_WEIGHTS, largest_free_block_bytes=int(109.35 * 2**30)))
    assert bench_model.largest_batch(cfg, [dense], capacity, jnp.bfloat16, fragmented) == 6
    with pytest.raises(ValueError, match="needs a device that reports its memory"):
        bench_model.largest_batch(cfg, [dense], capacity, jnp.bfloat16, _Device(None))
    with pytest.raises(ValueError, match="not even batch 1 fits at capacity 1048576"):
        bench_model.largest_batch(cfg, [dense], 1048576, jnp.bfloat16, h200)


def test_method_rows_at_batch_max_time_the_batch_largest_batch_gives(tiny, monkeypatch):
    """`--batch max` resolves per context to `largest_batch` of the run's decode methods (here stubbed: the CPU
    reports no memory) and every method's row runs at it, marked batch_asked="max"."""
    cfg, params = tiny
    seen = []

    def fake(cfg_, methods, capacity, dtype):
        seen.append((len(methods), capacity))
        return 3
    monkeypatch.setattr(bench_model, "largest_batch", fake)
    rows = bench_model.method_rows(cfg, params, ("dense", "streaming"), [64], ["max"], 2, 1000.0, 0.25)
    assert seen == [(2, 256)]
    assert [(r["method"], r["batch"], r["batch_asked"]) for r in rows] == [("dense", 3, "max"), ("streaming", 3, "max")]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows)


def test_xla_flags_are_appended_once():
    """`--xla-flags` repeats the defaults the `jsparse` command already set: each flag is appended once, a new value
    after the old one (the later flag wins in XLA), and nothing is lost."""
    from jsparse.xla_flags import GPU_XLA_FLAGS
    current = " ".join(GPU_XLA_FLAGS)
    assert bench_model.merged_xla_flags(current, current) == current
    merged = bench_model.merged_xla_flags(current + " --xla_a=1", "--xla_gpu_enable_triton_gemm=true --xla_a=1")
    assert merged == current + " --xla_a=1 --xla_gpu_enable_triton_gemm=true"
    assert bench_model.merged_xla_flags("", " --x=1  --y=2 ") == "--x=1 --y=2"


def test_filled_state_makes_each_head_choose_its_own_keys(tiny):
    """The timed step starts from a state as a run would leave it, not zeros: Quest's page bounds are the cache's
    (its prefill rule), other states random; with it, Quest's query heads choose different pages (with zeros all
    of them chose the same lowest pages, and the step read less than its byte model counts)."""
    from jsparse.methods.quest import finite_bounds, page_bounds, page_indices

    cfg, _ = tiny
    cache = bench_model.filled_cache(cfg, 2, 96, 128, jnp.float32)
    quest, _ = bench_model.bench_method("quest", cfg, 0.25)
    state, how = bench_model.filled_state(quest, cfg, cache, 128)
    assert "page bounds" in how
    kmin, kmax = finite_bounds(*page_bounds(cache.k[3], cache.lengths, quest.page_size))
    np.testing.assert_array_equal(state.kmin[3], kmin)
    np.testing.assert_array_equal(state.kmax[3], kmax)
    q = jax.random.normal(jax.random.key(1), (2, 1, cfg.num_heads, cfg.head_dim))
    pos = jnp.full((2, 1), 95, jnp.int32)
    pages = lambda st: np.asarray(page_indices(q, cache.k[3], pos, 0.25, 8, quest.page_size, 32,  # noqa: E731
                                               bounds=(st.kmin, st.kmax, 3)))
    assert len({tuple(r) for r in pages(state).reshape(-1, pages(state).shape[-1])}) > 1
    zero = quest.init_state(cfg, 2, 128)
    assert len({tuple(r) for r in pages(zero).reshape(-1, pages(zero).shape[-1])}) == 1  # what it timed before
    h2o, _ = bench_model.bench_method("h2o", cfg, 0.25)
    state, how = bench_model.filled_state(h2o, cfg, cache, 128)
    assert "random" in how and float(jnp.std(state.score)) > 0.5
    # The gathered H2O's carried candidates as init_state makes them: stale (-1), not zeros naming key 0 as every
    # candidate of a fresh set (its first step would keep key 0 alone and ranks nothing).
    h2o = bench_model.bench_method("h2o", cfg, 0.25, options={"gathered": True})[0]
    state, _ = bench_model.filled_state(h2o, cfg, cache, 128)
    assert np.all(np.asarray(state.cand_end) == -1) and np.all(np.asarray(state.cand) == -1)
    dense, _ = bench_model.bench_method("dense", cfg, 0.25)
    assert bench_model.filled_state(dense, cfg, cache, 128)[1] == "none"


@pytest.mark.parametrize("name", bench_model.METHODS + ("h2o:gathered",))
def test_unrolled_decode_steps_equal_the_rolled_scan(tiny, name):
    """`--unroll-layers` times the same steps: the layer scan unrolled in full (one scan, or Kascade's runs of
    layers of one role, EvoSparse's dense, scoring and inheriting runs) gives the rolled scan's tokens, cache and
    state, for every method of the benchmark (the unrolled scan is what a GPU runs by default), and for H2O's
    gathered decode (a GPU's path: every layer's keys chosen at the step's start, its carried candidates) from a
    filled state."""
    cfg, params = tiny
    name, _, variant = name.partition(":")
    # h2o: the mask path pinned (a GPU's default is the gathered one, its own case here)
    options = {"gathered": bool(variant)} if name == "h2o" else None
    method, _ = bench_model.bench_method(name, cfg, 0.25, options=options)
    out, loops = [], []
    for unroll in (1, True):
        cache = bench_model.filled_cache(cfg, 2, 96, 128, jnp.float32)
        state = bench_model.filled_state(method, cfg, cache, 128)[0] if variant else method.init_state(cfg, 2, 128)
        args = (params, method, jnp.zeros((2, 1), jnp.int32), cache, state)
        loops.append(bench_model.method_decode_steps.lower(*args, cfg=cfg, steps=3, unroll=unroll).as_text()
                     .count("stablehlo.while"))
        out.append(bench_model.method_decode_steps(*args, cfg=cfg, steps=3, unroll=unroll))
    if name == "h2o" and not variant:  # the mask path scans its rows in each layer: one such loop per layer unrolled
        assert loops == [3, 1 + cfg.num_layers]  # the steps, the layer scan, the rows' scan
    else:
        assert loops[1] < loops[0]  # the layer scans are gone; the steps' loop stays
    (tok1, cache1, state1), (tok2, cache2, state2) = out
    assert (tok1 == tok2).all() and (cache1.lengths == cache2.lengths).all()
    assert jnp.allclose(cache1.k, cache2.k, atol=1e-5) and jnp.allclose(cache1.v, cache2.v, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(state1), jax.tree_util.tree_leaves(state2)):
        assert jnp.allclose(a, b, atol=1e-5)


def test_unroll_layers_needs_the_methods_comparison(monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    for flag in ("--unroll-layers", "--rolled-layers"):
        with pytest.raises(SystemExit):
            bench_model.main([flag, "--context", "64", "--batch", "1"])
        assert f"{flag} times the methods' decode loop: give --methods" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_model.main(["--unroll-layers", "--rolled-layers", "--methods", "dense,kascade", "--context", "64"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_layer_unroll_follows_generate(monkeypatch):
    """The bench's default layer scan is generate's on the backend (unrolled on a GPU, rolled elsewhere)."""
    assert bench_model.layer_unroll("unrolled") is True and bench_model.layer_unroll("rolled") == 1
    monkeypatch.setattr(bench_model, "default_unroll_layers", lambda: True)
    assert bench_model.layer_unroll(None) is True
    monkeypatch.setattr(bench_model, "default_unroll_layers", lambda: False)
    assert bench_model.layer_unroll(None) == 1 and bench_model.layer_unroll(None) is not True
    with pytest.raises(ValueError, match="layer_scan='loop'"):
        bench_model.layer_unroll("loop")


@pytest.mark.parametrize("name", ["dense", "evosparse"])
def test_generate_loop_takes_the_fori_loops_steps(tiny, name):
    """`--loop generate` times `generate_tokens`' own loop (a while_loop, no known trip count) over the same
    steps: the fori loop's tokens, cache and state, its layer scan rolled or unrolled (`--unroll-layers`)."""
    cfg, params = tiny
    method, _ = bench_model.bench_method(name, cfg, 0.25)

    def args():
        cache = bench_model.filled_cache(cfg, 2, 96, 128, jnp.float32)
        state, _ = bench_model.filled_state(method, cfg, cache, 128)
        return params, method, jnp.array([[5], [9]], jnp.int32), cache, state

    (tok1, cache1, state1), *others = [bench_model.method_decode_steps(*args(), cfg=cfg, steps=3, loop=loop,
                                                                       unroll=unroll)
                                       for loop, unroll in (("fori", 1), ("generate", 1), ("generate", True))]
    assert tok1.shape == (2, 1) and (cache1.lengths == 96 + 3).all()
    for tok2, cache2, state2 in others:
        assert tok2.shape == tok1.shape and (tok1 == tok2).all() and (cache2.lengths == cache1.lengths).all()
        assert jnp.allclose(cache1.k, cache2.k, atol=1e-5) and jnp.allclose(cache1.v, cache2.v, atol=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(state1), jax.tree_util.tree_leaves(state2)):
            assert jnp.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="loop='scan'"):
        bench_model.method_decode_steps(*args(), cfg=cfg, steps=3, loop="scan")


def test_generate_loop_is_generate_tokens_loop(tiny):
    """generate_tokens runs `models.generate.decode_loop`: the tokens it gives after a prefill are the loop's,
    continued from the prefill's cache and first token."""
    from models import llama
    from models.cache import init_cache
    from models.generate import Sampling, decode_loop, generate_tokens, stop_ids

    cfg, params = tiny
    method, _ = bench_model.bench_method("dense", cfg, 0.25)
    tokens = jax.random.randint(jax.random.key(4), (2, 40), 0, cfg.vocab_size)
    lengths = jnp.array([40, 33], jnp.int32)
    want, num = generate_tokens(params, method, tokens, lengths, jax.random.key(0), cfg=cfg, max_new_tokens=6,
                                capacity=64)
    cache = init_cache(cfg, 2, 64, params.embed.dtype)
    logits, cache, state = llama.prefill(params, cfg, method, tokens, lengths, cache, method.init_state(cfg, 2, 64))
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    out = jnp.full((2, 6), -1, jnp.int32).at[:, 0].set(tok)
    res = decode_loop(params, method, tok, cache, state, jax.random.key(0), cfg=cfg, sampling=Sampling(),
                      eos=stop_ids(()), stop=6, out=out, done=jnp.zeros((2,), bool),
                      num=jnp.ones((2,), jnp.int32))
    np.testing.assert_array_equal(res[4], want)
    np.testing.assert_array_equal(res[5], num)
    assert (res[1].lengths == lengths + 5).all()
    from models.generate import default_unroll_layers
    assert default_unroll_layers() is (jax.default_backend() == "gpu")  # unrolled on a GPU only
    unrolled = generate_tokens(params, method, tokens, lengths, jax.random.key(0), cfg=cfg, max_new_tokens=6,
                               capacity=64, unroll_layers=True)
    np.testing.assert_array_equal(unrolled[0], want)
    np.testing.assert_array_equal(unrolled[1], num)


def test_loop_needs_the_methods_comparison(monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    with pytest.raises(SystemExit):
        bench_model.main(["--loop", "generate", "--context", "64", "--batch", "1"])
    assert "--loop times the methods' decode loop: give --methods" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bytes_read_every_weight_once_and_the_kv_of_the_context(tiny, tied):
    """Every weight once (the LM head's matrix once, tied or not; of the embedding one row per batch row) + K and V of
    every layer and KV head at the context, bf16."""
    cfg, _ = tiny
    cfg = dataclasses.replace(cfg, tie_word_embeddings=tied)
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    E, I, V, L, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers, cfg.head_dim
    Hq, Hkv, B, ctx = cfg.num_heads, cfg.num_kv_heads, 3, 1000
    layer = E * D * (Hq + 2 * Hkv) + Hq * D * E + 3 * E * I + 2 * E  # q, k, v, o; gate, up, down; two norms
    weights = 2 * (L * layer + E + E * V) + 2 * E * B  # + final norm, LM head; one embedding row per batch row
    kv = 2 * L * B * Hkv * ctx * D * 2
    assert bench_model.decode_bytes(cfg, params, B, ctx) == weights + kv


def test_kascade_and_oracle_bytes_are_a_hand_count_per_layer(tiny):
    """Kascade: layer 0 reads all of K and V, every other anchor all of K (its top-k scores) and the picked rows of K
    and V, a reuse layer the picked rows only (the method's own roles). Oracle: its dense layers all of K and V, the
    others all of K (exact scores) and the picked rows. Every layer that scores all of K also writes and reads each
    query head's f32 logits and the f32 pooled scores of each (row, KV head)."""
    from jsparse.methods.kascade import ROLE_ANCHOR, ROLE_DENSE_ANCHOR, ROLE_REUSE
    cfg, _ = tiny
    n, B, k = 10_000, 2, 1000  # k = ceil(0.1 * n)
    U = B * cfg.num_kv_heads * cfg.head_dim * 2  # one position of K (or V), bf16, every row and KV head
    kascade, _ = bench_model.bench_method("kascade", cfg, 0.1)
    G = cfg.num_heads // cfg.num_kv_heads
    scores = B * cfg.num_kv_heads * n * (2 * G * 4 + 2 * 4)  # logits (G a key) and pooled scores, f32, out and in
    per_role = {ROLE_DENSE_ANCHOR: 2 * n * U + scores, ROLE_ANCHOR: n * U + scores + 2 * k * U, ROLE_REUSE: 2 * k * U}
    roles = np.asarray(kascade.roles).tolist()
    assert roles.count(ROLE_REUSE) == 1  # the tiny model: anchors 0, 1, 2, 4, 5
    assert bench_model.attention_bytes("kascade", kascade, cfg, B, n) == sum(per_role[r] for r in roles)
    oracle, _ = bench_model.bench_method("oracle", cfg, 0.1)
    d = oracle.dense_layers
    assert 0 < d < cfg.num_layers
    assert bench_model.attention_bytes("oracle", oracle, cfg, B, n) == (
        d * 2 * n * U + (cfg.num_layers - d) * (n * U + scores + 2 * k * U))


def test_quest_bytes_count_the_partial_last_page(tiny):
    """Quest's f32 page bounds cover ceil(n / page_size) pages: a context that is not a multiple of the page size
    (100K + 8 at 16-token pages) reads its partial last page's bounds too."""
    cfg, _ = tiny
    quest, _ = bench_model.bench_method("quest", cfg, 0.1)
    n, B, k = 10_007, 2, 1001
    U = B * cfg.num_kv_heads * cfg.head_dim * 2
    pages = 626  # 625 full pages of 16 and one of 7 keys
    G, d, L = cfg.num_heads // cfg.num_kv_heads, quest.dense_layers, cfg.num_layers
    bounds = 2 * pages * B * cfg.num_kv_heads * cfg.head_dim * 4  # kmin and kmax, f32
    assert bench_model.attention_bytes("quest", quest, cfg, B, n) == (
        d * 2 * n * U + (L - d) * (bounds + G * 2 * k * U))


def _evo_bytes(cfg, evo, B, n, sel, heat_blocks, heads):
    """EvoSparse's bytes by hand: its dense layers all of K and V; each sparse layer the K and V of `sel` rows per KV
    head, its f32 block heat of `heat_blocks` blocks (read twice, written once) and all of K of each KV head that
    holds one of the retrieval `heads`."""
    Hkv, D, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    want = evo.dense_layers * 2 * B * Hkv * n * D * 2
    for layer in range(evo.dense_layers, cfg.num_layers):
        R = len({h // G for l, h in heads if l == layer})
        want += 2 * B * Hkv * sel * D * 2 + 3 * B * Hkv * heat_blocks * 4 + B * R * n * D * 2
    return want


@pytest.mark.parametrize("options, n, sel, heat_blocks", [
    ({}, 10_000, 2048, 625),  # its 2048-token budget, the heat of n // 16 blocks
    ({}, 10_007, 2048, 625),  # the heat of whole blocks only
    ({}, 1000, 63 * 16, 62),  # a context under the token budget: its min(2048, n) keys in 63 whole blocks
    ({"budget_tokens": 500}, 10_000, 512, 625),  # 500 tokens: ceil(500 / 16) = 32 whole blocks
    ({"budget_tokens": None, "min_tokens": 2048}, 10_000, 2048, 625),  # the fraction rule with its own min_tokens
    ({"block_size": 32}, 10_000, 2048, 312),
    ({"retrieval_fraction": 0.0, "heat_fraction": 0.5, "sink_fraction": 0.25, "local_fraction": 0.25}, 10_000, 2048,
     625)])  # no retrieval heads: no layer reads a whole K
def test_evosparse_bytes_are_a_hand_count_per_layer(tiny, options, n, sel, heat_blocks):
    """EvoSparse: its dense layers read all of K and V; each sparse layer the K and V of its selection (whole blocks)
    per KV head and its f32 block heat (read twice, written once), and a layer with retrieval heads all of K of each
    KV head that holds one."""
    from eval.bench import evo_layout as be
    cfg, _ = tiny
    evo, _ = bench_model.bench_method("evosparse", cfg, 0.1, options=options)
    heads = [] if options.get("retrieval_fraction") == 0 else be.model_heads(cfg)
    B = 2
    assert bench_model.attention_bytes("evosparse", evo, cfg, B, n) == _evo_bytes(cfg, evo, B, n, sel, heat_blocks,
                                                                                    heads)


def test_evo_layout_counts_distinct_kv_heads_in_layers_from_2():
    """`layer_kinds`: {R: sparse layers}, R the distinct KV heads that hold retrieval heads; `model_heads`: 1.5% of
    the heads, distinct, in layers >= 2; `attention_floors`: the hand count of a dense, a plain sparse and a
    retrieval layer."""
    from eval.bench import evo_layout as be
    from jsparse.methods.evosparse import default_num_heads
    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=6, num_heads=8, num_kv_heads=2)  # G = 4
    heads = [(2, 0), (2, 3), (3, 0), (3, 4), (4, 7)]  # layer 2: KV head 0 twice; 3: KV heads 0 and 1; 4: KV head 1
    assert be.layer_kinds(cfg, heads, 2) == {1: 2, 2: 1, 0: 1}
    assert be.layer_kinds(cfg, heads, 3) == {2: 1, 1: 1, 0: 1}
    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=3, num_heads=64, num_kv_heads=8)
    heads = be.model_heads(cfg)
    assert len(set(heads)) == len(heads) == default_num_heads(cfg) == 3
    assert all(layer == 2 and 0 <= h < 64 for layer, h in heads)
    B, N, Hkv, D = 2, 4096, 8, 128  # Llama-3.1-8B, R = 3, 2048 selected tokens, blocks of 16, at 1000 GB/s
    f = be.attention_floors(B, N, 1000.0, 3)
    dense = 2 * B * Hkv * N * D * 2
    sparse = 2 * B * Hkv * 2048 * D * 2 + 3 * B * Hkv * (N // 16) * 4
    assert (f["dense_bytes"], f["sparse_bytes"], f["retrieval_bytes"]) == (dense, sparse, sparse + B * 3 * N * D * 2)
    assert f["dense_floor_ms"] == pytest.approx(dense / 1e12 * 1e3, rel=1e-12)
    assert f["retrieval_floor_ms"] == pytest.approx((sparse + B * 3 * N * D * 2) / 1e12 * 1e3, rel=1e-12)


@pytest.mark.parametrize("options, sets, key_bytes", [({}, "G", 4), ({"selection": "group"}, 1, 4),
                                                      ({"key_dtype": "bfloat16"}, "G", 2)])
def test_butler_bytes_are_its_state_and_predictor_beside_the_picked_rows(tiny, options, sets, key_bytes):
    """TokenButler: its dense layers read all of K and V, the others the picked rows (selection "head": G sets per KV
    head, "group": one); every step also reads the whole state at the context (the predictor's f32 K/V cache and the
    predicted keys, f32 or bf16) and the predictor's f32 weights."""
    from jsparse.methods.butler_predictor import init_params
    cfg, _ = tiny
    butler, _ = bench_model.bench_method("butler", cfg, 0.1, options=options)
    n, B, k = 10_000, 2, 1000
    assert butler.sparse_budget(butler.pcfg.num_layers) == 0.1
    U = B * cfg.num_kv_heads * cfg.head_dim * 2
    G, d, L = cfg.num_heads // cfg.num_kv_heads, butler.dense_layers, cfg.num_layers
    state = butler.init_state(cfg, B, n)
    assert {x.dtype.itemsize for x in jax.tree.leaves(state.keys)} == {key_bytes}
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    predictor = sum(x.size * 4 for x in jax.tree.leaves(init_params(butler.pcfg, jax.random.key(7))))
    assert bench_model.attention_bytes("butler", butler, cfg, B, n) == (
        d * 2 * n * U + (L - d) * (G if sets == "G" else 1) * 2 * k * U + state_bytes + predictor)


def test_method_rows_count_the_bytes_at_the_timed_steps_mean_context(tiny):
    """A row's bytes are the weights once + its attention's at the mean context of the timed steps, which go on from
    the untimed first call's (context + steps + steps // 2), and floor_speedup is dense's bytes over the method's;
    the first call's time per step is kept beside the timed one."""
    cfg, params = tiny
    context, B, steps = 384, 2, 4
    rows = bench_model.method_rows(cfg, params, ("dense", "streaming"), [context], [B], steps, 1000.0, 0.25)
    r = {x["method"]: x for x in rows}
    assert all(x["first_call_step_ms"] > 0 and x["step_ms"] > 0 for x in rows)
    n = context + steps + steps // 2
    U = B * cfg.num_kv_heads * cfg.head_dim * 2
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) - params.embed.size * 4 \
        + cfg.hidden_size * 2
    assert r["dense"]["bytes"] == weights + cfg.num_layers * 2 * n * U
    k = 128  # max(ceil(0.25 * n), min_tokens 128): streaming's sink and window
    assert r["streaming"]["bytes"] == weights + cfg.num_layers * 2 * k * U
    assert r["streaming"]["floor_speedup"] == pytest.approx(r["dense"]["bytes"] / r["streaming"]["bytes"], rel=1e-12)


def test_prefill_flops_of_a_tied_model_count_its_lm_head_once(tiny):
    """Tied embeddings: the embedding is still a lookup and the LM head (the same matrix) runs once per row: the
    FLOPs of the untied model of the same shape."""
    cfg, _ = tiny
    T = 1000
    E, I, V, L, D, Hq, Hkv = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers, cfg.head_dim,
                              cfg.num_heads, cfg.num_kv_heads)
    layers = L * (E * D * (Hq + 2 * Hkv) + Hq * D * E + 3 * E * I + 2 * E)
    want = 2 * (layers + E) * T + 2 * V * E + 2 * L * Hq * D * T * T
    for tied in (False, True):
        c = dataclasses.replace(cfg, tie_word_embeddings=tied)
        assert bench_model.prefill_flops(c, 2, T) == pytest.approx(2 * want, rel=1e-12), tied


def test_largest_batch_leaves_the_headroom_beside_the_caches():
    """BATCH_HEADROOM stays free beside the caches: room for 7 rows and half the headroom fits 6, not 7."""
    from models.presets import preset
    cfg = preset("llama3-8b")
    capacity = 131328
    dense, _ = bench_model.bench_method("dense", cfg, 0.1)
    per_row = 2 * 32 * 8 * capacity * 128 * 2
    dev = _Device({"bytes_limit": 7 * per_row + bench_model.BATCH_HEADROOM // 2 + 2**30, "bytes_in_use": 2**30,
                   "largest_free_block_bytes": 7 * per_row + bench_model.BATCH_HEADROOM // 2})
    assert bench_model.largest_batch(cfg, [dense], capacity, jnp.bfloat16, dev) == 6
    dev = _Device({"bytes_limit": 7 * per_row + bench_model.BATCH_HEADROOM + 2**30, "bytes_in_use": 2**30})
    assert bench_model.largest_batch(cfg, [dense], capacity, jnp.bfloat16, dev) == 7


def test_check_fails_when_the_probed_logits_differ_from_the_plain_step(monkeypatch):
    """Step 3 of the check: the probe's logits must equal the plain step's within probe_logits_tol; a step whose
    attention matches its reference but whose probed logits differ fails, and the message says so."""
    from eval.bench import model_check
    from models.presets import preset
    real = model_check.checked_step

    def off(*args, **kw):
        out, (diff, big), probe = real(*args, **kw)
        return out, (diff + 1.0, big), probe  # the probed logits one unit off the plain step's
    monkeypatch.setattr(model_check, "checked_step", off)
    build = lambda name, cfg: bench_model.bench_method(name, cfg, 0.1)[0]  # noqa: E731
    c = model_check.run_checks(preset("llama3-8b"), ["dense"], build, jnp.float32, raise_on_failure=False)["dense"]
    assert c["err_over_tol"] <= 1.0 and c["probe_logits_max_diff"] >= 1.0 > c["probe_logits_tol"]
    assert not c["passed"]
    msg = model_check.failure_message({"dense": c})
    assert msg.startswith("decode step differs from its masked reference on the check shape: dense: probed logits "
                          f"differ from the plain step's by {c['probe_logits_max_diff']:.4g} > ")


def test_decode_memory_counts_a_row_of_state_once(tiny):
    """Per batch row: K and V of every layer at the capacity + the row's state (H2O: an f32 score per layer, KV head
    and position); nothing whatever the batch."""
    cfg, _ = tiny
    h2o, _ = bench_model.bench_method("h2o", cfg, 0.1)
    L, Hkv, D, N = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 512
    kv, score = 2 * L * Hkv * N * D * 2, L * Hkv * N * 4
    # The masked path (the CPU's default) keeps the scores; the gathered one (the GPU's) its carried candidates too:
    # i32 positions of the kept_width heavy keys per layer and KV head, and the row's i32 end.
    cand = L * Hkv * h2o.kept_width(h2o.k_static(N)) * 4 + 4
    for gathered, state in ((False, score), (True, score + cand)):
        method = dataclasses.replace(h2o, gathered=gathered)
        assert bench_model.decode_memory(cfg, method, N, jnp.bfloat16) == (kv + state, 0), gathered
    assert bench_model.decode_memory(cfg, h2o, N, jnp.bfloat16)[0] == kv + score + cand * h2o.is_gathered()


@pytest.mark.parametrize("name, options", [
    ("streaming", {"dense_layers": 2}), ("streaming", {"min_tokens": 2048}), ("h2o", {"dense_layers": 2}),
    ("h2o", {"carry": False}),  # the whole score row ranked at every step again
    ("oracle", {"dense_layers": 3}),
    ("kascade", {"reuse_scale": 2.0}), ("evosparse", {"budget_tokens": 512, "dense_layers": 3}),
    ("evosparse", {"heat_fraction": 0.0, "sink_fraction": 0.25, "local_fraction": 0.5, "retrieval_fraction": 0.25}),
    ("butler", {"dense_set": (3,)}), ("butler", {"dense_set": (1, 3)})])  # layer 1 is one of its dense layers
def test_method_options_reach_the_bytes_model(tiny, name, options):
    """--method-option changes what a step reads, so it changes the bytes floor: the bytes of the method built with
    the options are the hand count of its dense layers, budgets and state (they were those of the defaults before:
    2 dense layers and 2048 tokens for EvoSparse, no dense layers for StreamingLLM and H2O, Kascade's reuse layers at
    the anchors' budget, TokenButler without its calibrated dense layers)."""
    from eval.bench import evo_layout as be
    cfg, _ = tiny
    n, B, L = 10_000, 2, cfg.num_layers
    Hkv, D, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    U = B * Hkv * D * 2
    k = 1000  # ceil(0.1 * n)
    budget = 0.5 if name == "butler" else 0.1  # TokenButler's calibrated dense layer needs a budget > 1/4 here
    method, _ = bench_model.bench_method(name, cfg, budget, options=options)
    got = bench_model.attention_bytes(name, method, cfg, B, n)
    assert got != bench_model.attention_bytes(name, bench_model.bench_method(name, cfg, budget)[0], cfg, B, n)
    if name in ("streaming", "h2o", "oracle"):
        d, k = options.get("dense_layers", 0), max(k, options.get("min_tokens", 0))  # its own min_tokens
        # H2O's carried candidates per row (positions read and written, scores gathered), or its whole score row
        ranked = (3 * method.kept_width(k) if method.carry else n) if name == "h2o" else 0
        scores = B * Hkv * n * (2 * G + 2) * 4  # the oracle's logits and pooled scores (f32, written and read)
        per = {"streaming": 2 * k * U, "h2o": 2 * k * U + B * Hkv * (ranked + 2 * k + 2 * k * G) * 4,
               "oracle": n * U + scores + 2 * k * U}
        assert got == d * 2 * n * U + (L - d) * per[name]
    elif name == "kascade":
        from jsparse.methods.kascade import ROLE_ANCHOR, ROLE_DENSE_ANCHOR
        roles = np.asarray(method.roles).tolist()
        scores = B * Hkv * n * (2 * G + 2) * 4  # every anchor's logits and pooled scores
        per_role = {ROLE_DENSE_ANCHOR: 2 * n * U + scores, ROLE_ANCHOR: n * U + scores + 2 * k * U}
        assert got == sum(per_role.get(r, 2 * 2 * k * U) for r in roles)  # reuse layers at 2 * budget
    elif name == "evosparse":
        assert method.dense_layers == options.get("dense_layers", 2)
        heat_blocks = n // 16 if "heat_fraction" not in options else 0
        sel_rows = options.get("budget_tokens", 2048)
        assert got == _evo_bytes(cfg, method, B, n, sel_rows, heat_blocks, be.model_heads(cfg))
    else:  # TokenButler: layer 3 calibrated dense, the others at b' = (n_s * 0.5 - 1) / (n_s - 1), n_s = L - 2
        from jsparse.methods.butler_predictor import init_params
        b = ((L - 2) * 0.5 - 1) / (L - 3)
        assert method.sparse_budget(L) == pytest.approx(b) == 1 / 3
        kb = math.ceil(b * n)
        state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(method.init_state(cfg, B, n)))
        predictor = sum(x.size * 4 for x in jax.tree.leaves(init_params(method.pcfg, jax.random.key(7))))
        assert got == 3 * 2 * n * U + (L - 3) * G * 2 * kb * U + state + predictor


@pytest.mark.parametrize("value,warns", [(None, False), ("true", False), ("1", False), ("false", True),
                                         (" FALSE ", True), ("0", True)])
def test_allocator_warning_only_when_preallocation_is_off(value, warns):
    env = {} if value is None else {"XLA_PYTHON_CLIENT_PREALLOCATE": value}
    warning = bench_model.allocator_warning(env)
    assert (warning is not None) == warns
    if warns:
        assert warning.startswith(f"XLA_PYTHON_CLIENT_PREALLOCATE={value}:") and "run out of memory" in warning


def test_model_jit_options_are_xla_compile_options():
    """The model's compile options (models.compile_options) are options XLA knows: a misspelt one is refused at
    compile time ("No such compile option"), so a typo cannot silently leave, e.g., rematerialization on."""
    from models.compile_options import MODEL_COMPILER_OPTIONS, model_jit
    from jsparse.xla_flags import GPU_XLA_FLAGS
    assert MODEL_COMPILER_OPTIONS["xla_disable_hlo_passes"] == "rematerialization"
    assert "--xla_disable_hlo_passes=rematerialization" in GPU_XLA_FLAGS
    assert float(model_jit(lambda x: (x @ x.T).sum())(jnp.ones((4, 4)))) == 64.0
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x + 1, compiler_options={"xla_disable_hlo_passe": "rematerialization"})(1.0)


def test_probe_rows_apply_each_setting_and_record_failures(tiny, monkeypatch):
    """`probe_rows` (the probes under eval/results): each run's setting applied before its row, the library's (None)
    after the last; a run that raises (here: an unknown method) is a row with its error, and the others still run.
    `probe_record` names the command beside the device facts."""
    cfg, params = tiny
    applied = []
    rows = bench_model.probe_rows(cfg, params, [("a", "dense", 1, "x"), ("b", "no-such-method", 1, "y"),
                                                ("c", "streaming", 1, None)], applied.append, 256, 1000.0, steps=2)
    assert applied == ["x", "y", None, None]
    assert [r["variant"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["step_ms"] > 0 and rows[2]["step_ms"] > 0 and "no-such-method" in rows[1]["error"]
    record = bench_model.probe_record("python3 probe.py", rows, shape="tiny")
    assert record["command"] == "python3 probe.py" and record["rows"] is rows and record["shape"] == "tiny"
    assert {"device", "jax", "date", "commit"} <= set(record)
