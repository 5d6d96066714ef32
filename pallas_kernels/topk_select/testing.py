"""Adversarial inputs for testing the selection kernels against `reference.topk_select_reference` (shared by the
CPU tests and the GPU check script eval/bench/topk_select.py)."""

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
