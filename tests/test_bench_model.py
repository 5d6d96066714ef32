"""`jsparse bench model --methods`: every method's decode step in the library's own loop, with its bytes floor."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from eval.bench import model as bench_model
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
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        bench_model.bench_method("nope", cfg, 0.1)
