"""EvoSparse's benchmark layout, shared by `jsparse bench evosparse` and `jsparse bench model`: its budget, the
random retrieval heads of a model of random weights, the layer kinds they make and the bytes floors."""

from __future__ import annotations

import numpy as np

from jsparse.methods.evosparse import default_num_heads
from models.presets import preset

BUDGET_TOKENS, BLOCK = 2048, 16
CFG8B = preset("llama3-8b")


def layer_kinds(cfg, heads) -> dict[int, int]:
    """How many sparse layers (>= 2) hold retrieval heads in R distinct KV heads: {R: layers} (R = 0: inherit)."""
    G = cfg.num_heads // cfg.num_kv_heads
    kv = {}
    for l, h in heads:
        kv.setdefault(l, set()).add(h // G)
    counts = {}
    for l in range(2, cfg.num_layers):
        R = len(kv.get(l, ()))
        counts[R] = counts.get(R, 0) + 1
    return counts


def model_heads(cfg, seed: int = 0) -> list[tuple[int, int]]:
    """1.5% of the heads, drawn at random in layers >= 2 (random weights have no real retrieval heads)."""
    rng = np.random.default_rng(seed)
    n = default_num_heads(cfg)
    flat = rng.choice((cfg.num_layers - 2) * cfg.num_heads, size=n, replace=False)
    return sorted((2 + int(i) // cfg.num_heads, int(i) % cfg.num_heads) for i in flat)


def attention_floors(B, N, hbm_gbs, R: int, cfg=CFG8B):
    """Bytes (and ms at hbm_gbs) of a dense layer, an EvoSparse sparse layer and one with retrieval heads in R KV
    heads, at batch B and context N."""
    Hkv, D = cfg.num_kv_heads, cfg.head_dim
    dense = 2 * B * Hkv * N * D * 2
    sel = BUDGET_TOKENS  # selected tokens per KV head
    nb = N // BLOCK
    sparse = 2 * B * Hkv * sel * D * 2 + 3 * B * Hkv * nb * 4  # K, V of the selection; heat read twice, written
    ret = sparse + B * R * N * D * 2
    ms = lambda b: b / (hbm_gbs * 1e9) * 1e3  # noqa: E731
    return dict(dense_bytes=dense, sparse_bytes=sparse, retrieval_bytes=ret, dense_floor_ms=ms(dense),
                sparse_floor_ms=ms(sparse), retrieval_floor_ms=ms(ret))
