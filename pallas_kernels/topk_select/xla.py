"""Top-k selection in plain XLA by the radix threshold search of `common.py` (no sort, no `lax.top_k`).

Counting is a fused compare-and-reduce per pass; the compaction is a cumulative sum and a scatter. It runs on
any backend, and is the TPU kernel's compaction step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.topk_select.common import (check_args, check_bits, float_keys, pad_output, radix_threshold,
                                               row_counts, selection_rule, split_plan)

Array = jax.Array


def compact_xla(x: Array, key: Array, kk: Array, lo: Array, done: Array, K: int) -> Array:
    """The chosen positions of every row, ascending, -1 padded.

    Args:
      x: f32[R, N] scores; key: i32[R, N] their keys; kk: i32[R]; lo, done: `radix_threshold`'s result.
      K: output width (<= N).

    Returns:
      int32[R, K].
    """
    R, N = x.shape
    a, t, bulk_on = selection_rule(lo, done, kk)
    fin = x > -jnp.inf
    bulk = (key >= a[:, None]) & (bulk_on[:, None] > 0)
    tie = key == t[:, None]
    count = lambda m: jnp.sum(m.astype(jnp.int32), axis=1, keepdims=True)
    quota, _, total = split_plan(kk, done, t, count(bulk), count(bulk & fin), count(tie))
    tie_i = tie.astype(jnp.int32)
    take = tie & (jnp.cumsum(tie_i, axis=1) - tie_i < quota) & fin
    sel = (bulk & fin) | take
    sel_i = sel.astype(jnp.int32)
    dst = jnp.where(sel, jnp.cumsum(sel_i, axis=1) - sel_i, K)  # K: out of range, dropped
    rows = jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32)[:, None], (R, N))
    pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None, :], (R, N))
    out = jnp.full((R, K), -1, jnp.int32).at[rows, dst].set(pos, mode="drop")
    return pad_output(out, total)


@functools.partial(jax.jit, static_argnames=("K", "bits_per_pass"))
def topk_select_xla(scores: Array, k, K: int, *, bits_per_pass: int = 4) -> Array:
    """Exact top-k positions per row (semantics of `reference.topk_select_reference`), in plain XLA.

    Args:
      scores: f32[..., N]; k: int or int array broadcastable to scores.shape[:-1]; K: static width.
      bits_per_pass: radix bits resolved per counting pass (1, 2, 4 or 8).

    Returns:
      int32[..., min(K, N)].
    """
    lead, N, Kp = check_args(scores, k, K)
    check_bits(bits_per_pass)
    x = scores.reshape(-1, N)
    kk = row_counts(k, lead, Kp)
    key = float_keys(x)

    def count_fn(cand, active, lo, shift):
        del active, lo, shift
        return jnp.sum((key[:, None, :] >= cand[:, :, None]).astype(jnp.int32), axis=-1)

    lo, done = radix_threshold(count_fn, kk, N, bits_per_pass)
    return compact_xla(x, key, kk, lo, done, Kp).reshape(*lead, Kp)
