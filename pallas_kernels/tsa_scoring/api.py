"""One entry point for Token Sparse Attention key scoring, picking the backend.

  tsa_scores(q: [B, T, Hq, D], k: [B, T, Hkv, D], *, window=128, pool_kernel=7, lengths=None,
             implementation=None) -> f32[B, Hq, T]

`implementation`: "pallas_gpu" (Triton kernels), "pallas_tpu" (Mosaic kernels) or "xla" (the jnp
reference, which materialises [B, Hq, W, T] in f32); None picks by `jax.default_backend()`: gpu ->
"pallas_gpu", tpu -> "pallas_tpu", anything else (cpu) -> "xla".
"""

from __future__ import annotations

import jax

from pallas_kernels.sharding import active_mesh, dims, per_shard
from pallas_kernels.tsa_scoring import common, gpu, reference, tpu

Array = jax.Array

_BY_BACKEND = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}


def default_implementation() -> str:
    """The implementation `tsa_scores` uses when none is named, from `jax.default_backend()`."""
    return _BY_BACKEND.get(jax.default_backend(), "xla")


def tsa_scores(
    q: Array,
    k: Array,
    *,
    window: int = 128,
    pool_kernel: int = 7,
    lengths: Array | None = None,
    implementation: str | None = None,
    scale: float | None = None,
) -> Array:
    """Token Sparse Attention key scores (Jo et al.): how much the last W queries attend to each key.

    For each row, the last W valid queries (positions len - W .. len - 1, or all of them when len < W)
    take a softmax over all keys 0 .. len - 1, causal inside the window (the query at position p sees keys
    <= p). The probabilities are averaged over those queries per (query head, key), then average-pooled over
    keys (kernel `pool_kernel`, stride 1, zero 'same' padding, divided by `pool_kernel` as torch's
    `avg_pool1d` with `count_include_pad=True` does). Keys >= len score 0. GQA: query head h reads KV
    head h // (Hq // Hkv).

    Differences from the official TSA code (dongwonjo/Token-Sparse-Attention, `sparse_cluster.py`), which
    scores only the keys before the window (positions < len - W) and pools that prefix alone: here the
    window's own keys are scored too and the pooling runs over [0, len), so the last pool_kernel // 2 keys
    before the window also average in window keys. The window keys are always kept by TSA, so only those
    few boundary keys can rank differently. The official prefix-only pooling is
    `avg_pool_keys(tsa_mean_probs_*(...), pool_kernel, jnp.maximum(lengths - window, 0))` with the
    unpooled `tsa_mean_probs_{reference,gpu,tpu}` of the backend modules.

    Args:
      q: [B, T, Hq, D] queries after RoPE (bf16, f16 or f32).
      k: [B, T, Hkv, D] keys after RoPE, same dtype; Hq must be a multiple of Hkv.
      window: W, the positive number of trailing queries that score the keys (default 128).
      pool_kernel: positive odd pooling kernel over keys (default 7; 1 = no pooling).
      lengths: i32[B] valid tokens per right-padded row, each in [0, T]; None = all T valid.
      implementation: "pallas_gpu", "pallas_tpu", "xla" or None (by backend).
      scale: softmax scale (default 1 / sqrt(D), Llama's).

    Returns:
      f32[B, Hq, T] pooled scores.

    Raises:
      ValueError: window or pool_kernel not a positive int, pool_kernel even, mismatched shapes or dtypes,
        concrete lengths outside [0, T], unknown implementation.
    """
    window = common.check_window(window)
    pool_kernel = common.check_pool_kernel(pool_kernel)
    common.check_inputs(q, k, lengths)
    if active_mesh() is not None:  # per shard (pallas_kernels.sharding): rows over data, heads over model
        t = dims(4, 0, 2)
        if lengths is None:
            return per_shard(lambda q, k: tsa_scores(q, k, window=window, pool_kernel=pool_kernel,
                                                     implementation=implementation, scale=scale),
                             [q, k], [t, t], dims(3, 0, 1))
        return per_shard(lambda q, k, n: tsa_scores(q, k, window=window, pool_kernel=pool_kernel, lengths=n,
                                                    implementation=implementation, scale=scale),
                         [q, k, lengths], [t, t, dims(1, 0)], dims(3, 0, 1))
    impl = default_implementation() if implementation is None else implementation
    if impl == "xla":
        return reference.tsa_scores_reference(
            q, k, window=window, pool_kernel=pool_kernel, lengths=lengths, scale=scale)
    if impl == "pallas_gpu":
        return gpu.tsa_scores_gpu(q, k, window=window, pool_kernel=pool_kernel, lengths=lengths, scale=scale)
    if impl == "pallas_tpu":
        return tpu.tsa_scores_tpu(q, k, window=window, pool_kernel=pool_kernel, lengths=lengths, scale=scale)
    raise ValueError(f"implementation must be one of {common.IMPLEMENTATIONS} or None, got {implementation!r}")
