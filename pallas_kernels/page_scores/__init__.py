"""Quest's page scores: each query's upper bound on its logits over a page, from the page's key bounds.

  page_scores(q: f32[B, Hkv, R, D], kmin, kmax: f32[L, B, Hkv, P, D], layer: i32[]) -> f32[B, Hkv, R, P]
      sum over d of max(q_d * kmax_d, q_d * kmin_d) for every query row r (a KV head's G query heads times T tokens)
      and page p of layer `layer` of the stacked bounds (L = 1 for one layer's bounds).

On a GPU a Pallas Triton kernel (gpu.py) reads each page's bounds once, in place from the stacked state, for all the
rows of a KV head; elsewhere XLA computes the same sum (reference.py). As two dots (relu(q) . kmax + min(q, 0) .
kmin) XLA copied the layer's bounds out of the stacked state and multiplied in TF32; as one fused reduction it read
them once per query head. Each output element is computed by the same code whatever L, so one layer's scores equal
its row of a stack's (Quest's gathered decode and its mask path choose the same pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import GPU_OR_REFERENCE as IMPLEMENTATIONS, gpu_or_reference
from pallas_kernels.layers import check_layer
from pallas_kernels.page_scores import reference
from pallas_kernels.sharding import active_mesh, dims, per_shard

Array = jax.Array


def page_scores(q: Array, kmin: Array, kmax: Array, layer, *, implementation: str | None = None) -> Array:
    """The page scores of layer `layer` (module docstring): q f32[B, Hkv, R, D], kmin / kmax f32[L, B, Hkv, P, D],
    layer i32[] -> f32[B, Hkv, R, P]. implementation: None (on a GPU with D a power of two: "pallas_gpu"; else
    "reference") or one of IMPLEMENTATIONS (never falls back)."""
    reference.check_args(q, kmin, kmax)
    check_layer(layer, kmin.shape[0])
    if active_mesh() is not None:  # per shard (pallas_kernels.sharding): rows over data, heads over model
        return per_shard(lambda q, lo, hi, layer: page_scores(q, lo, hi, layer, implementation=implementation),
                         [q, kmin, kmax, jnp.asarray(layer, jnp.int32)],
                         [dims(4, 0, 1), dims(5, 1, 2), dims(5, 1, 2), ()], dims(4, 0, 1))
    from pallas_kernels.page_scores import gpu
    if gpu_or_reference(implementation, lambda: gpu.unsupported_reason(q)) == "pallas_gpu":
        return gpu.page_scores_gpu(q, kmin, kmax, layer)
    return reference.page_scores_reference(q, kmin, kmax, layer)


__all__ = ["IMPLEMENTATIONS", "page_scores"]
