"""One entry point for causal sliding-window attention with attention sinks, picking the backend.

  local_attention(q: [B, T, Hq, D], k, v: [B, T, Hkv, D], *, window, sinks=0, implementation=None)
      -> [B, T, Hq, D]

Query i attends key j iff j <= i and (i - j < window or j < sinks). `implementation`: "pallas_gpu" (the Triton
kernel, gpu.py), "pallas_tpu" (the Mosaic kernel, tpu.py: window <= 129, sinks <= 128) or "xla" (the blocked jnp
version, reference.py, O(T * window) work as well); None picks "pallas_gpu" on a GPU backend, "pallas_tpu" on a
TPU backend when the sizes fit it, and "xla" otherwise. Used by Token Sparse Attention's `fill="local"` for the
rows a head dropped.
"""

from __future__ import annotations

import operator

import jax

from pallas_kernels.local_attention import gpu, reference, tpu
from pallas_kernels.sharding import active_mesh, dims, per_shard
from pallas_kernels.sparse_attention.common import check_floating, default_scale

Array = jax.Array

IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu", "xla")


def _check_count(name: str, value, least: int) -> int:
    try:
        count = None if isinstance(value, bool) else operator.index(value)  # int or numpy integer
    except TypeError:
        count = None
    if count is None or count < least:
        raise ValueError(f"{name}={value!r}: expected an integer >= {least} (tokens)")
    return count


def check_inputs(q: Array, k: Array, v: Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected q [B, T, Hq, D] and k, v "
                         "[B, T, Hkv, D] of one shape")
    B, T, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D or Hq % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape}: expected the same B, T, D and Hq a multiple of Hkv")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: expected one dtype")
    check_floating(q=q, k=k, v=v)


def default_implementation(window: int, sinks: int) -> str:
    """The implementation `local_attention` uses when none is named, from `jax.default_backend()` and the sizes."""
    backend = jax.default_backend()
    if backend == "gpu":
        return "pallas_gpu"
    if backend == "tpu" and tpu.supported(window, sinks):
        return "pallas_tpu"
    return "xla"


def local_attention(q: Array, k: Array, v: Array, *, window: int, sinks: int = 0, scale: float | None = None,
                    implementation: str | None = None) -> Array:
    """Causal sliding-window attention over the last `window` keys plus the first `sinks` tokens.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (GQA: query head h reads KV head h // (Hq // Hkv)), one dtype.
      window: keys each query sees counting back from itself (itself included), >= 1.
      sinks: leading tokens every query sees as well (StreamingLLM's attention sinks), >= 0.
      scale: softmax scale (default 1 / sqrt(D)).
      implementation: "pallas_gpu", "pallas_tpu", "xla" or None (by backend and sizes).
    Returns:
      [B, T, Hq, D] in q's dtype (rows of right padding hold values nobody should read).
    Raises:
      ValueError: window < 1, sinks < 0, a scale that is not finite and positive, mismatched shapes, dtypes
        that are not one floating dtype, unknown implementation, "pallas_tpu" with
        sizes its kernel does not serve.
    """
    window = _check_count("window", window, 1)
    sinks = _check_count("sinks", sinks, 0)
    check_inputs(q, k, v)
    scale = default_scale(q.shape[-1], scale)
    if active_mesh() is not None:  # per shard (pallas_kernels.sharding): rows over data, heads over model
        t = dims(4, 0, 2)
        return per_shard(lambda q, k, v: local_attention(q, k, v, window=window, sinks=sinks, scale=scale,
                                                         implementation=implementation), [q, k, v], [t, t, t], t)
    impl = implementation or default_implementation(window, sinks)
    if impl == "pallas_gpu":
        return gpu.local_attention_gpu(q, k, v, window=window, sinks=sinks, scale=scale)
    if impl == "pallas_tpu":
        return tpu.local_attention_tpu(q, k, v, window=window, sinks=sinks, scale=scale)
    if impl == "xla":
        return reference.local_attention_reference(q, k, v, window=window, sinks=sinks, scale=scale)
    raise ValueError(f"implementation={implementation!r}: expected one of {list(IMPLEMENTATIONS)} or None")
