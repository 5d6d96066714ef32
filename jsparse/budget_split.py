"""A budget of kb blocks split among components by fractions (EvoSparse's sink / local / retrieval / heat).

With cumulative fractions c_i resolved to 1/4096 in integer arithmetic, component i gets
ceil(c_i * kb) - ceil(c_{i-1} * kb) blocks: the counts always sum to kb, and small budgets favour the first
components.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

FIX = 4096  # fractions are resolved to 1/FIX in integer arithmetic


def check_fractions(fractions: Sequence[float], names: Sequence[str]) -> tuple[float, ...]:
    """Fractions >= 0 that sum to 1 (names: the option names, for the error), as floats."""
    desc = ", ".join(f"{n}={f!r}" for n, f in zip(names, fractions))
    for f in fractions:
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not math.isfinite(f) or f < 0:
            raise ValueError(f"budget fractions ({desc}): expected numbers >= 0 that sum to 1")
    total = float(sum(fractions))
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"budget fractions sum to {total:g} ({desc}): expected {' + '.join(names)} = 1")
    return tuple(float(f) for f in fractions)


def cumulative_fixed(fractions: Sequence[float]) -> tuple[int, ...]:
    """Cumulative fractions in units of 1/FIX, the last exactly FIX."""
    cum = np.cumsum(np.asarray(fractions, np.float64))
    fixed = [int(round(c * FIX)) for c in cum]
    fixed[-1] = FIX
    return tuple(fixed)


def split_counts(kb, cum_fixed: Sequence[int]):
    """Blocks per component for kb budget blocks (int or int array): a tuple of counts summing to kb."""
    ends = [(c * kb + FIX - 1) // FIX for c in cum_fixed]
    starts = [0 * kb] + ends[:-1]
    return tuple(e - s for s, e in zip(starts, ends))


def max_counts(Kb: int, cum_fixed: Sequence[int]) -> tuple[int, ...]:
    """Static width of each component: the largest count over budgets of 1..Kb blocks."""
    kb = np.arange(1, Kb + 1, dtype=np.int64)
    return tuple(int(np.max(c)) for c in split_counts(kb, cum_fixed))


def drop_components(fractions: Sequence[float], names: Sequence[str], drop: Sequence[str]) -> tuple[float, ...]:
    """The fractions with the `drop` components set to 0 and the rest scaled up in proportion (sum 1)."""
    kept = [0.0 if c in drop else float(f) for c, f in zip(names, fractions)]
    total = sum(kept)
    if total <= 0:
        raise ValueError(f"fractions {tuple(fractions)} leave nothing once {list(drop)} is dropped")
    return tuple(f / total for f in kept)
