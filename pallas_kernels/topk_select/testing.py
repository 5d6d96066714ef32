"""Adversarial and Kascade-like inputs for testing the selection kernels against `reference.topk_select_reference`
(shared by the CPU tests and the GPU check script eval/bench/topk_select.py)."""

from __future__ import annotations

import numpy as np

NAN_BITS = np.array([0x7FFFFFFF, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0xFFC00000], np.uint32)  # +-NaNs, both ends


def adversarial(rng: np.random.Generator, R: int, N: int) -> np.ndarray:
    """f32[R, N] rows cycling through: heavy ties with specials, all equal, all -inf, NaN payloads with +-0.0
    and +-inf, continuous values, a few distinct values with -inf."""
    x = np.empty((R, N), np.float32)
    specials = np.concatenate([NAN_BITS.view(np.float32), np.array([0.0, -0.0, np.inf, -np.inf, 1.0], np.float32)])
    for r in range(R):
        kind = r % 6
        if kind == 0:
            row = rng.integers(-4, 4, N).astype(np.float32) / 2
            m = rng.random(N)
            row[m < 0.2] = -np.inf
            row[(m >= 0.2) & (m < 0.3)] = -0.0
            row[(m >= 0.3) & (m < 0.35)] = np.inf
        elif kind == 1:
            row = np.full(N, 0.75, np.float32)
        elif kind == 2:
            row = np.full(N, -np.inf, np.float32)
        elif kind == 3:
            row = specials[rng.integers(0, specials.size, N)]
        elif kind == 4:
            row = rng.standard_normal(N).astype(np.float32)
        else:
            row = np.array([-np.inf, 1.0, 2.0], np.float32)[rng.integers(0, 3, N)]
        x[r] = row
    return x


def kascade_like_rows(rng, R: int, context: int, capacity: int, period: int = 256, tile: int = 32):
    """Rows like a Kascade anchor's pooled scores on the cache `jsparse bench model` used before 2026-11-25 (keys
    tiled with a period of 256; a worst case of many ties that a periodic input can produce): the softmax weights of 4 query heads (Llama-3.1-8B's GQA group; logits N(0, 1.3**2),
    about the spread of q.k / sqrt(D) in the random-weight model) summed, over `period` distinct keys repeated
    over the context (each value tied ~context / period times) and 1 to 4 fresh keys after it (query position
    context + r % 4), +inf on the query's diagonal `tile` and -inf past its position.

    Returns:
      (x f32[R, capacity], k i32[R]: Kascade's k at budget 0.1, min(max(ceil(0.1 * n), 128), n), n visible).
    """
    x = np.full((R, capacity), -np.inf, np.float32)
    k = np.zeros((R,), np.int32)
    for r in range(R):
        pos = context + r % 4
        logits = rng.normal(0, 1.3, (4, period))
        full = np.concatenate([np.tile(logits, (1, -(-context // period)))[:, :context],
                               rng.normal(0, 1.3, (4, pos + 1 - context))], axis=1)
        p = np.exp(full - full.max(axis=1, keepdims=True))
        x[r, : pos + 1] = (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
        x[r, pos // tile * tile: pos + 1] = np.inf
        k[r] = min(max(int(np.ceil(0.1 * (pos + 1))), 128), pos + 1)
    return x, k
