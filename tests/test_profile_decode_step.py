"""`jsparse bench profile_decode_step`: the per-kernel table of a trace, and a whole run on the CPU at a tiny shape."""

import dataclasses
import gzip
import json

import jax
import pytest

from eval.bench import model as bench_model
from eval.bench import profile_decode_step as prof
from models.presets import preset


def _trace(tmp_path, events):
    d = tmp_path / "trace" / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return str(tmp_path / "trace")


def test_kernel_table_counts_gpu_ops_per_step_and_the_gaps_between_them(tmp_path):
    X = lambda name, ts, dur, pid=1, tid=7: {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    events = [X("sm90_xmma_gemm_bf16", 0, 40), X("loop_add_fusion", 50, 2), X("anchor_decode_logits", 60, 100),
              X("loop_add_fusion", 170, 2), X("topk_select_row", 150, 30, tid=8),  # overlaps the logits kernel
              X("PjitFunction(step)", 0, 500, pid=2)]  # a host event: not a device op
    t = prof.kernel_table(_trace(tmp_path, events), steps=2, top=10)
    assert t["kernels_per_step"] == 2.5 and t["device_us_per_step"] == pytest.approx(174 / 2)
    # busy: [0, 40) + [50, 52) + [60, 180) = 162 of the span [0, 180): 18 us idle (over 2 steps)
    assert t["gpu_busy_us_per_step"] == pytest.approx(81) and t["gpu_span_us_per_step"] == pytest.approx(90)
    assert t["gpu_idle_us_per_step"] == pytest.approx(9)
    assert t["largest_gaps"] == [{"idle_us": 10, "before": "loop_add_fusion", "at_us": 50},
                                 {"idle_us": 8, "before": "anchor_decode_logits", "at_us": 60}]
    assert [r["kernel"] for r in t["top"]] == ["anchor_decode_logits", "sm90_xmma_gemm_bf16", "topk_select_row",
                                               "loop_add_fusion"]
    assert [r["kind"] for r in t["top"]] == ["custom", "gemm", "custom", "xla"]
    assert t["top"][3]["launches_per_step"] == 1.0 and t["top"][3]["us_per_step"] == 2.0
    assert t["small_xla_launches_per_step"] == 1.0 and t["small_xla_us_per_step"] == 2.0
    assert t["by_kind"]["custom"] == {"launches_per_step": 1.0, "us_per_step": 65.0}
    assert [prof.kernel_kind(n) for n in ("transpose.12", "input_reduce_fusion.1", "MemcpyDtoH", "nvjet_hsh_64x8",
                                          "sparse_decode_gathered_stacked", "anchor_decode_pool")] == [
        "xla", "xla", "xla", "gemm", "custom", "custom"]
    # CUTLASS GEMMs are named by their template (no "gemm" in the name); XLA's GPU fusions carry a "_N" suffix
    assert [prof.kernel_kind(n) for n in (
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816_128x64_64x3_tn_align8>(Params)",
        "loop_convert_fusion_2", "input_reduce_fusion_13", "dynamic_update_slice_3", "pallas_topk_fused_select")] == [
        "gemm", "xla", "xla", "xla", "custom"]


def test_profiles_the_kascade_step_as_bench_model_builds_it_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The tiny run: the Kascade step of `jsparse bench model` (its state and loop), dense and Kascade timed first in
    the same process; the JSON, the gzipped HLO and the timing table last. A CPU host's trace has no GPU streams; a
    GPU host's has its kernels."""
    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=6, hidden_size=128, intermediate_size=256, num_heads=4,
                              num_kv_heads=2, head_dim=32, vocab_size=256)
    monkeypatch.setattr(bench_model, "preset", lambda name: cfg)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    monkeypatch.setattr(bench_model.bm, "measure_hbm_gbs", lambda: 1000.0)
    out = tmp_path / "profile_kascade.json"
    assert prof.main(["--method", "kascade", "--dtype", "float32", "--context", "384", "--batch", "2", "--steps",
                      "2", "--time", "kascade,kascade:switch", "--trace-dir", str(tmp_path / "trace"), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["method"], r["context"], r["batch"], r["budget"], r["steps"]) == ("kascade", 384, 2, 0.1, 2)
    assert r["state"].startswith("synthetic: anchors [0, 1, 2, 4, 5], identity head map")
    assert r["wall_ms_per_step_traced"] > 0
    if jax.default_backend() == "gpu":  # a GPU host's trace has its streams and their kernels
        assert r["gpu_processes"] and r["top"] and r["kernels_per_step"] > 0
    else:
        assert r["gpu_processes"] == [] and r["top"] == []
    assert r["trace"].startswith(str(tmp_path / "trace")) and r["trace"].endswith(".trace.json.gz")
    assert [t["method"] for t in r["timed"]] == ["dense", "kascade", "kascade:switch"]  # dense first: the baseline
    assert all(t["step_ms"] > 0 and t["context"] == 384 and "error" not in t for t in r["timed"])
    assert r["timed"][0]["speedup"] == 1.0 and r["timed"][1]["floor_speedup"] > 1.0
    assert r["timed"][2]["floor_speedup"] == r["timed"][1]["floor_speedup"]  # Kascade's byte model
    assert r["timed"][2]["state"].endswith("a lax.switch on the role in every layer (anchor_layers=None), not as "
                                           "runs of layers of one role")
    with gzip.open(tmp_path / "profile_kascade.hlo.txt.gz", "rt") as f:
        assert f.read().startswith("HloModule")
    last = capsys.readouterr().out.strip().splitlines()
    assert last[-5].startswith("| method | context | batch | step_ms") and last[-2].startswith("| kascade | 384 | 2 |")
    assert last[-1].startswith("| kascade:switch | 384 | 2 |")


def test_the_switch_variant_is_kascade_without_static_anchors():
    cfg = preset("llama3-8b")
    m, how = prof.build_method("kascade", cfg, 0.1)
    v, how_v = prof.build_method("kascade:switch", cfg, 0.1)
    assert m.anchor_layers == (0, 6, 13, 19, 26) and v.anchor_layers is None and v.segments(cfg, "decode") is None
    assert (v.roles == m.roles).all() and (v.head_map == m.head_map).all() and v.budget == m.budget == 0.1
    assert how_v.startswith(how + "; decode as one layer scan")
    with pytest.raises(ValueError, match="unknown method 'dense:switch'"):
        prof.build_method("dense:switch", cfg, 0.1)


def test_rejects_an_unknown_method_to_time(capsys, monkeypatch):
    monkeypatch.setattr(bench_model, "preset", lambda name: pytest.fail("built the model of an unknown method"))
    with pytest.raises(SystemExit):
        prof.main(["--method", "kascade", "--time", "dense,nope"])
    assert "--time: unknown ['nope']" in capsys.readouterr().err


def test_kernel_table_small_xla_is_per_launch_busy_counts_nested_ops_once_and_gaps_are_from_the_first_op(tmp_path):
    """One step of a trace that starts at 1000 us: a 100 us kernel with two short ops inside it (on another stream),
    ten 3 us fusions 7-10 us apart, and a 1 us custom kernel. Small XLA kernels are those under SMALL_US (5 us) per
    launch (the fusions: 30 us a step but 3 us a launch; not the 5 us copy, not the 1 us custom kernel); ops inside
    a longer one neither add busy time nor open a gap; `at_us` counts from the first op; LARGEST_GAPS (8) of the 11
    gaps are listed; `top` lists exactly `top` kernels."""
    X = lambda name, ts, dur, tid=7: {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": 1000 + ts, "dur": dur}
    events = [X("anchor_decode_logits", 0, 100), X("topk_select_row", 10, 5, tid=8), X("copy.3", 20, 5, tid=8)]
    events += [X("loop_add_fusion", 110 + 10 * i, 3) for i in range(10)] + [X("tiny_pallas_kernel", 210, 1)]
    t = prof.kernel_table(_trace(tmp_path, events), steps=1, top=2)
    assert t["kernels_per_step"] == 14 and t["device_us_per_step"] == pytest.approx(100 + 5 + 5 + 30 + 1)
    # busy: [0, 100) + 10 x 3 + 1 = 131 of the span [0, 211): 80 us idle = 10 (before the first fusion) + 10 x 7
    assert t["gpu_busy_us_per_step"] == pytest.approx(131) and t["gpu_span_us_per_step"] == pytest.approx(211)
    assert t["gpu_idle_us_per_step"] == pytest.approx(80)
    assert t["small_xla_launches_per_step"] == 10 and t["small_xla_us_per_step"] == pytest.approx(30)
    assert t["by_kind"] == {"custom": {"launches_per_step": 3, "us_per_step": 106},
                            "xla": {"launches_per_step": 11, "us_per_step": 35}}
    assert [r["kernel"] for r in t["top"]] == ["anchor_decode_logits", "loop_add_fusion"]
    assert t["largest_gaps"] == ([{"idle_us": 10, "before": "loop_add_fusion", "at_us": 110}]
                                 + [{"idle_us": 7, "before": "loop_add_fusion", "at_us": 120 + 10 * i}
                                    for i in range(7)])


def test_kernel_table_reads_the_newest_trace_and_a_trace_that_is_a_list_of_events(tmp_path):
    """Two profiler runs under one folder (run folders are named by time): the table is the newer one's; a Chrome
    trace may be a bare JSON list of events instead of {"traceEvents": [...]}."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
    for run, (name, dur) in (("2025_01_01_10_00_00", ("old_kernel", 50)), ("2025_01_02_09_00_00", ("new_kernel", 20))):
        d = tmp_path / "trace" / "plugins" / "profile" / run
        d.mkdir(parents=True)
        with gzip.open(d / "host.trace.json.gz", "wt") as f:
            json.dump(meta + [{"ph": "X", "name": name, "pid": 1, "tid": 1, "ts": 5, "dur": dur}], f)
    t = prof.kernel_table(str(tmp_path / "trace"), steps=1, top=5)
    assert t["trace"].endswith("2025_01_02_09_00_00/host.trace.json.gz")
    assert [(r["kernel"], r["us_per_step"]) for r in t["top"]] == [("new_kernel", 20.0)]
    assert t["gpu_processes"] == ["/device:GPU:0"] and t["gpu_busy_us_per_step"] == 20.0


def test_kernel_table_of_a_trace_without_gpu_streams_is_zeros(tmp_path):
    """A CPU host's trace (only host events): no kernels, and busy, span and idle time 0, not NaN (the JSON the CPU
    run writes)."""
    t = prof.kernel_table(_trace(tmp_path, [{"ph": "X", "name": "PjitFunction(step)", "pid": 2, "tid": 1, "ts": 3,
                                             "dur": 500}]), steps=2, top=5)
    assert (t["gpu_processes"], t["top"], t["largest_gaps"], t["by_kind"]) == (["/device:GPU:0"], [], [], {})
    assert [t[k] for k in ("kernels_per_step", "device_us_per_step", "gpu_busy_us_per_step", "gpu_span_us_per_step",
                           "gpu_idle_us_per_step", "small_xla_launches_per_step", "small_xla_us_per_step")] == [0] * 7


def test_time_puts_dense_first_once_whatever_its_place(monkeypatch):
    """`--time kascade,dense,kascade:switch` times dense first (the baseline of the speedups), once."""
    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=6, hidden_size=128, intermediate_size=256, num_heads=4,
                              num_kv_heads=2, head_dim=32, vocab_size=256)
    monkeypatch.setattr(bench_model, "preset", lambda name: cfg)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    monkeypatch.setattr(bench_model.bm, "measure_hbm_gbs", lambda: 1000.0)
    seen = []

    class Stop(Exception):
        pass

    def method_rows(cfg, params, methods, *a, built, **kw):
        seen.append((tuple(methods), sorted(built)))
        raise Stop

    monkeypatch.setattr(bench_model, "method_rows", method_rows)
    with pytest.raises(Stop):
        prof.main(["--method", "kascade", "--dtype", "float32", "--time", "kascade,dense,kascade:switch"])
    assert seen == [(("dense", "kascade", "kascade:switch"), ["dense", "kascade", "kascade:switch"])]


def test_wall_time_of_the_traced_call_is_per_step(tmp_path, monkeypatch):
    """`wall_ms_per_step_traced` is the traced call's wall time over --steps (a clock that reads 1 s across it)."""
    import types

    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2,
                              num_kv_heads=1, head_dim=32, vocab_size=128)
    monkeypatch.setattr(bench_model, "preset", lambda name: cfg)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    clock = iter([10.0, 11.0])
    monkeypatch.setattr(prof, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    out = tmp_path / "p.json"
    assert prof.main(["--method", "dense", "--dtype", "float32", "--context", "64", "--batch", "1", "--steps", "4",
                      "--trace-dir", str(tmp_path / "trace"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["wall_ms_per_step_traced"] == pytest.approx(1000 / 4)
