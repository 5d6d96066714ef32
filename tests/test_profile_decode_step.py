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


def test_rejects_an_unknown_method_to_time(capsys):
    with pytest.raises(SystemExit):
        prof.main(["--method", "kascade", "--time", "dense,nope"])
    assert "--time: unknown ['nope']" in capsys.readouterr().err
