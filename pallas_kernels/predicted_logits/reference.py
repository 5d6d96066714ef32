"""The plain-jnp specification of `predicted_logits` (XLA compiles it; the CPU's and TPU's implementation)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def check_args(q: Array, k: Array) -> None:
    """q: [..., Hk, G, T, d] and k: [..., Hk, N, d] with the same leading axes, Hk and d."""
    if q.ndim < 4 or k.ndim != q.ndim - 1 or q.shape[:-3] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}: expected q [..., Hk, G, T, "
                         "d] and k [..., Hk, N, d] with the same leading axes, Hk and d")


def check_bounds(q: Array, last, keep_first: int, keep_from) -> None:
    """last and keep_from: None or i32 arrays broadcastable to q.shape[:-1]; keep_first: an int >= 0; keeping keys
    (keep_first > 0 or keep_from) needs `last` (the keys kept are visible ones)."""
    rows = q.shape[:-1]
    for name, a in (("last", last), ("keep_from", keep_from)):
        if a is not None:
            try:
                fits = jnp.broadcast_shapes(jnp.shape(a), rows) == tuple(rows)
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(f"{name} of shape {tuple(jnp.shape(a))}: expected an i32 array broadcastable to the "
                                 f"query rows {tuple(rows)}")
            if not jnp.issubdtype(jnp.result_type(a), jnp.integer):  # a float was truncated to i32
                raise ValueError(f"{name} of dtype {jnp.result_type(a)}: expected integer key positions")
    if not isinstance(keep_first, int) or keep_first < 0:
        raise ValueError(f"keep_first={keep_first!r}: expected an int >= 0 (the leading keys every row keeps)")
    if last is None and (keep_first or keep_from is not None):
        raise ValueError("keep_first / keep_from without last: the keys a row keeps are among those it sees")


def bound_logits(s: Array, n: Array, last, keep_first: int, keep_from) -> Array:
    """s: f32 logits at key positions n; -inf past `last`, +inf on the kept keys (n < keep_first or n >= keep_from)
    that are visible (the rule of `predicted_logits`; the kernel applies it to its tiles)."""
    if last is None:
        return s
    kept = n < keep_first
    if keep_from is not None:
        kept = kept | (n >= keep_from)
    return jnp.where(n > last, -jnp.inf, jnp.where(kept, jnp.inf, s))


def predicted_logits_reference(q: Array, k: Array, *, last=None, keep_first: int = 0, keep_from=None) -> Array:
    """f32[..., Hk, G, T, N]: sum over d of q * k in f32, then / sqrt(d) (one fused reduction); bounded by
    `bound_logits` when `last` is given (arguments as `predicted_logits`)."""
    check_args(q, k)
    check_bounds(q, last, keep_first, keep_from)
    d, N = q.shape[-1], k.shape[-2]
    prod = q.astype(jnp.float32)[..., :, None, :] * k.astype(jnp.float32)[..., :, None, None, :, :]
    s = jnp.sum(prod, axis=-1) / math.sqrt(d)
    col = lambda a: None if a is None else jnp.asarray(a, jnp.int32)[..., None]  # noqa: E731  (over the keys)
    return bound_logits(s, jnp.arange(N, dtype=jnp.int32), col(last), keep_first, col(keep_from))
