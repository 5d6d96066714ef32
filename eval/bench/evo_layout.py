"""EvoSparse's benchmark layout, shared by `jsparse bench evosparse` and `jsparse bench model`: its budget, the
random retrieval heads of a model of random weights, the layer kinds they make and the bytes floors."""

from __future__ import annotations

import numpy as np

from jsparse.methods.evosparse import default_num_heads
from models.presets import preset

BUDGET_TOKENS, BLOCK = 2048, 16
CFG8B = preset("llama3-8b")


def layer_kinds(cfg, heads, dense_layers: int = 2) -> dict[int, int]:
    """How many sparse layers (>= dense_layers) hold retrieval heads in R distinct KV heads: {R: layers} (R = 0:
    inherit)."""
    G = cfg.num_heads // cfg.num_kv_heads
    kv = {}
    for l, h in heads:
        kv.setdefault(l, set()).add(h // G)
    counts = {}
    for l in range(dense_layers, cfg.num_layers):
        R = len(kv.get(l, ()))
        counts[R] = counts.get(R, 0) + 1
    return counts


def model_heads(cfg, seed: int = 0) -> list[tuple[int, int]]:
    """1.5% of the heads, drawn at random in layers >= 2 (random weights have no real retrieval heads)."""
    rng = np.random.default_rng(seed)
    n = default_num_heads(cfg)
    flat = rng.choice((cfg.num_layers - 2) * cfg.num_heads, size=n, replace=False)
    return sorted((2 + int(i) // cfg.num_heads, int(i) % cfg.num_heads) for i in flat)


def attention_floors(B, N, hbm_gbs, R: int, cfg=CFG8B, sel: int = BUDGET_TOKENS, block: int = BLOCK,
                     heat: bool = True):
    """Bytes (and ms at hbm_gbs) of a dense layer, an EvoSparse sparse layer and one with retrieval heads in R KV
    heads, at batch B and context N: the K and V of `sel` selected tokens per KV head, the heat of the N // block
    blocks read twice and written once (with `heat`), and the retrieval heads' whole K."""
    Hkv, D = cfg.num_kv_heads, cfg.head_dim
    dense = 2 * B * Hkv * N * D * 2
    nb = N // block
    sparse = 2 * B * Hkv * sel * D * 2 + (3 * B * Hkv * nb * 4 if heat else 0)
    ret = sparse + B * R * N * D * 2
    ms = lambda b: b / (hbm_gbs * 1e9) * 1e3  # noqa: E731
    return dict(dense_bytes=dense, sparse_bytes=sparse, retrieval_bytes=ret, dense_floor_ms=ms(dense),
                sparse_floor_ms=ms(sparse), retrieval_floor_ms=ms(ret))
