"""The entry point `head_probs_stacked`, dispatching over implementations.

  implementation=None   on a GPU with arguments the kernel takes: "pallas_gpu"; otherwise "reference".
  "pallas_gpu"          gpu.py: the Pallas Triton kernel reading the layer in place.
  "reference"           reference.py: plain jnp, which XLA compiles (CPU, TPU; on a GPU it slices the layer).

Naming an implementation never falls back: arguments it cannot take raise ValueError. Under a mesh
(`pallas_kernels.sharding`) it runs per shard: rows over `data`, heads over `model`.
"""

from __future__ import annotations

import jax

from pallas_kernels.head_probs import reference
from pallas_kernels.sharding import active_mesh, dims, per_shard

Array = jax.Array

IMPLEMENTATIONS = ("pallas_gpu", "reference")


def _unsupported_reason(implementation: str, q: Array) -> str | None:
    if implementation == "pallas_gpu":
        from pallas_kernels.head_probs import gpu
        return gpu.unsupported_reason(q.dtype, q.shape[-1])
    return None


def supported(implementation: str, q: Array) -> bool:
    """Whether `implementation` can run on queries like q: [B, T, Hq, D]."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
    return _unsupported_reason(implementation, q) is None


def head_probs_stacked(q: Array, k_all: Array, layer: Array, lengths: Array, lse: Array, *,
                       implementation: str | None = None) -> Array:
    """Post-softmax weights of the T newest queries over layer `layer` of a stacked cache, summed over T.

    Args:
      q: [B, T, Hq, D] queries of the tokens at positions lengths - T .. lengths - 1.
      k_all: [L, B, Hkv, N, D] stacked head-major key cache (the new tokens already written).
      layer: i32[] (traced) layer to read, as `k_all[layer]`.
      lengths: i32[B] valid tokens per row.
      lse: f32[B, T, Hq] log-sum-exp of each query row over its visible keys
        (`pallas_kernels.dense_decode.dense_decode_stacked(..., return_lse=True)`).
      implementation: see the module docstring.

    Returns:
      f32[B, Hq, N]: p[b, h, n] = sum over t of exp(q[b, t, h] . k[n] * scale - lse[b, t, h]) over the keys query
      t sees, 0 elsewhere (`reference.head_probs_stacked_reference`).
    """
    reference.check_args(q, k_all, layer, lengths, lse)
    if active_mesh() is not None:  # per shard (pallas_kernels.sharding): rows over data, heads over model
        return per_shard(lambda q, k, layer, lengths, lse: head_probs_stacked(
            q, k, layer, lengths, lse, implementation=implementation),
            [q, k_all, layer, lengths, lse], [dims(4, 0, 2), dims(5, 1, 2), (), dims(1, 0), dims(3, 0, 2)],
            dims(3, 0, 1))
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        implementation = "pallas_gpu" if on_gpu and supported("pallas_gpu", q) else "reference"
    elif implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    reason = _unsupported_reason(implementation, q)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    if implementation == "pallas_gpu":
        from pallas_kernels.head_probs import gpu
        return gpu.head_probs_stacked_gpu(q, k_all, layer, lengths, lse)
    return reference.head_probs_stacked_reference(q, k_all, layer, lengths, lse)
