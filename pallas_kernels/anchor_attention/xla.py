"""The anchor decode layer in plain XLA: einsum logits, a per-head logsumexp, pooling, then the shared
selection and gathered attention (each through its entry point, so on a GPU or TPU they are the Pallas ones)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.anchor_attention.common import (check_args, default_scale, layer_of, pool_scores, positions,
                                                    select, unstack)

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("scale", "dense_output"))
def decode_scores_xla(q: Array, k: Array, v: Array, lengths: Array, *, scale: float | None = None,
                      dense_output: bool = False) -> tuple[Array, Array | None]:
    """Pooled scores f32[B, Hkv, T, N] (and the dense attention with dense_output); see gpu.decode_scores_gpu."""
    B, T, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = default_scale(D, scale)
    pos = positions(lengths, T)
    qg = q.reshape(B, T, Hkv, G, D)
    logits = jnp.einsum("btkgd,bknd->bktgn", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (jnp.arange(N)[None, None, :] <= pos[:, :, None])[:, None, :, None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, Hkv, T, G]
    scores = pool_scores(logits, lse, pos)
    out = None
    if dense_output:
        p = jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)
        o = jnp.einsum("bktgn,bknd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        out = o.reshape(B, T, Hq, D).astype(q.dtype)
    return scores, out


@functools.partial(jax.jit, static_argnames=("budget", "min_tokens", "K", "scale", "dense_output"))
def anchor_decode_xla(q: Array, k: Array, v: Array, lengths: Array, *, budget: float, min_tokens: int = 128,
                      K: int | None = None, layer: Array | None = None, scale: float | None = None,
                      dense_output: bool = False) -> tuple[Array, Array]:
    """Anchor decode layer with XLA scores; args and returns as `reference.anchor_decode_reference` (with
    `layer`, k and v are the stacked cache; XLA slices the layer)."""
    from pallas_kernels.sparse_attention import sparse_decode

    K = check_args(q, *unstack(k, v, layer), lengths, budget, min_tokens, K)
    if layer is not None:
        lay = layer_of(layer, k.shape[0])[0]
        k, v = k[lay], v[lay]
    scores, out = decode_scores_xla(q, k, v, lengths, scale=scale, dense_output=dense_output)
    indices = select(scores, positions(lengths, q.shape[1]), budget, min_tokens, K, None)
    if out is None:
        out = sparse_decode(q, k, v, indices, lengths, scale=scale)
    return out, indices
