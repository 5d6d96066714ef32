"""A budget of kb blocks split among components by fractions (EvoSparse's sink / local / retrieval / heat).

A query at position p sees n = p + 1 keys and keeps k of them: k = min(tokens, n) with a token count, else the
fraction rule k = min(max(ceil(budget * n), min_tokens), n) (`selection.budget_tokens`: an f32 product); that is
kb = ceil(k / block_size) blocks. With cumulative fractions c_i taken as the nearest fractions of denominator at most
4096 (so 1/3 is 1/3 and 0.1 is 1/10, not the floats' nearest 4096ths) in integer arithmetic, component i gets
ceil(c_i * kb) - ceil(c_{i-1} * kb) blocks: the counts always sum to kb, equal fractions split kb evenly when they can
(1/3 each: 1, 1, 1 blocks of 3), and small budgets favour the first components, except one component that may be
given at least one block (EvoSparse's local window, which holds the query's own position).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from jsparse import selection as sel

FIX = 4096  # the largest denominator of a cumulative fraction (`cumulative_fixed`)


def check_fractions(fractions: Sequence[float], names: Sequence[str]) -> tuple[float, ...]:
    """Fractions >= 0 that sum to 1 (names: the option names, for the error), as floats."""
    desc = ", ".join(f"{n}={f!r}" for n, f in zip(names, fractions))
    for f in fractions:
        if not sel.is_real(f) or not math.isfinite(f) or f < 0:
            raise ValueError(f"budget fractions ({desc}): expected numbers >= 0 that sum to 1")
    total = float(sum(fractions))
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"budget fractions sum to {total:g} ({desc}): expected {' + '.join(names)} = 1")
    return tuple(float(f) for f in fractions)


def cumulative_fixed(fractions: Sequence[float]) -> tuple[Fraction, ...]:
    """Cumulative fractions as exact rationals: each the nearest fraction of denominator at most FIX (1/3 + 1/3 is
    2/3, where its nearest 4096th, 2731/4096, split 3 blocks as 1, 2, 0), the last exactly 1."""
    cum = np.cumsum(np.asarray(fractions, np.float64))
    fixed = [Fraction(float(c)).limit_denominator(FIX) for c in cum]
    fixed[-1] = Fraction(1)
    return tuple(fixed)


def split_counts(kb, cum_fixed: Sequence[Fraction], ensure: Optional[int] = None):
    """Blocks per component for kb budget blocks (int or int array): a tuple of counts summing to kb.

    ensure: a component (index) with a fraction > 0 that gets at least one block whenever kb >= 1 (EvoSparse's
    local window, which holds the query's own position): when the rounding left it none, it takes one from the
    first component that has one."""
    ends = [(c.numerator * kb + c.denominator - 1) // c.denominator for c in cum_fixed]  # ceil(c * kb), exactly
    starts = [0 * kb] + ends[:-1]
    counts = [e - s for s, e in zip(starts, ends)]
    if ensure is not None and cum_fixed[ensure] > (cum_fixed[ensure - 1] if ensure else 0):
        add = ((counts[ensure] == 0) & (kb >= 1)) * 1  # 0 or 1, an int (array) for numpy and jax alike
        need = add
        for j in range(len(counts)):
            if j != ensure:
                give = (counts[j] > 0) * need
                counts[j] = counts[j] - give
                need = need - give
        counts[ensure] = counts[ensure] + add
    return tuple(counts)


def max_counts(Kb: int, cum_fixed: Sequence[Fraction], ensure: Optional[int] = None) -> tuple[int, ...]:
    """Static width of each component: the largest count over budgets of 1..Kb blocks."""
    kb = np.arange(1, Kb + 1, dtype=np.int64)
    return tuple(int(np.max(c)) for c in split_counts(kb, cum_fixed, ensure))


def drop_components(fractions: Sequence[float], names: Sequence[str], drop: Sequence[str]) -> tuple[float, ...]:
    """The fractions with the `drop` components set to 0 and the rest scaled up in proportion (sum 1)."""
    kept = [0.0 if c in drop else float(f) for c, f in zip(names, fractions)]
    total = sum(kept)
    if total <= 0:
        raise ValueError(f"fractions {tuple(fractions)} leave nothing once {list(drop)} is dropped")
    return tuple(f / total for f in kept)


@dataclasses.dataclass(frozen=True)
class BlockBudget:
    """The budget rule of the module docstring: kb blocks per query, split by `fractions` (summing to 1)."""

    budget: float
    min_tokens: int
    block_size: int
    fractions: tuple
    tokens: Optional[int] = None
    ensure: Optional[int] = None  # a component given at least one block (`split_counts`)

    def keys(self, n):
        """Keys kept among n visible ones (int or int array)."""
        return sel.keys_to_keep(n, self.budget, self.min_tokens, self.tokens)

    def widths(self, N: int) -> tuple[int, int, tuple[int, ...]]:
        """(nb blocks of an N-token cache, Kb: the static number of selected blocks, each component's static
        width: its largest count over budgets of 1..Kb blocks)."""
        nb = N // self.block_size
        Kb = min(-(-self.keys(N) // self.block_size), nb)
        return nb, Kb, max_counts(max(Kb, 1), cumulative_fixed(self.fractions), self.ensure)

    def row(self, pos):
        """pos: i32[...] query positions -> (kb blocks, visible blocks pos // block_size + 1, the component
        counts, a tuple of i32[...] summing to kb)."""
        bs = self.block_size
        kb = (self.keys(pos + 1) + bs - 1) // bs
        return kb, pos // bs + 1, split_counts(kb, cumulative_fixed(self.fractions), self.ensure)

    def attended_fraction(self, positions) -> np.ndarray:
        """f64[...]: the fraction of its visible keys a query at each position attends to (whole blocks, its own
        block partial)."""
        return attended_fraction(positions, self.budget, self.min_tokens, self.block_size, self.tokens)


def attended_fraction(positions, budget: float, min_tokens: int, block_size: int,
                      tokens: Optional[int] = None) -> np.ndarray:
    """f64[...]: the fraction of its n = p + 1 visible keys a query at each position p attends to when it takes
    ceil(k / block_size) whole blocks of the budget's k keys (`tokens`, else the fraction rule), its own block
    among them and partial (EvoSparse's blocks, Quest's pages): between k - block_size + 1 and k + block_size - 1
    keys."""
    p = np.asarray(positions, np.int64)
    n = p + 1
    if tokens is not None:
        k = np.minimum(tokens, n)
    else:
        k = np.minimum(np.maximum(np.ceil(np.float32(budget) * n.astype(np.float32)), min_tokens), n)
    return blocks_fraction(-(-k // block_size), p, block_size)


def blocks_fraction(blocks, positions, block_size: int) -> np.ndarray:
    """f64[...]: the fraction of its n = p + 1 visible keys a query at each position p attends to in `blocks` whole
    blocks of `block_size` keys, its own block among them and partial (at most n)."""
    p = np.asarray(positions, np.int64)
    bs = block_size
    return np.minimum(np.asarray(blocks) * bs - (bs - 1 - p % bs), p + 1) / (p + 1)
