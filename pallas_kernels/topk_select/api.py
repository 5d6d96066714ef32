"""One entry point, `topk_select`, dispatching over implementations.

  implementation=None   pick by `jax.default_backend()`: gpu -> "pallas_gpu", tpu -> "pallas_tpu", anything
                        else -> "top_k" (on a CPU, XLA's sort-based top-k is the fastest exact choice).
  "pallas_gpu"          `gpu.py`: Pallas Triton radix threshold search + ascending compaction; rows of up to
                        16384 scores in ONE launch (`gpu_row.py`), longer rows by a sampled threshold bracket
                        in 5 launches (`gpu_sample.py`; rows shorter than its sample: 32 / bits + 2 launches,
                        `gpu_fused.py`) or, for 512 rows or more of a small k, an ordered band above a sampled
                        bound in 3 launches (`gpu_ordered.py`), no XLA between them; `gpu.SelectConfig(path=...)`
                        picks another.
  "pallas_tpu"          `tpu.py`: Pallas TPU counting passes + XLA compaction (N < 2**24).
  "xla"                 `xla.py`: the same radix search in plain XLA (any backend).
  "top_k"               `reference.py`: `lax.top_k` and a sort; the specification.

Every implementation returns exactly the same indices (`reference.py` states the semantics). `span=(lo, hi)`
restricts each row to positions lo <= p < hi, as if the others held -inf: the GPU's "row", "ordered" and "sample"
kernels read the scores in place, the other implementations (and the GPU's "fused" path) mask a copy first.

Under a mesh (`pallas_kernels.sharding`: more than one device, axes `data` and `model`) the Pallas
implementations run per shard: the rows are independent, so a score array in the index contract's layout
[B, H, ..., N] splits its batch over `data` and its heads over `model` (XLA cannot partition the Pallas call and
would otherwise gather every row onto every device). "xla" and "top_k" are plain XLA, partitioned by XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sharding import active_mesh, dims, per_shard
from pallas_kernels.topk_select import reference, xla
from pallas_kernels.topk_select.common import check_args, mask_span

Array = jax.Array

IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu", "xla", "top_k")


def _pick(implementation: str | None) -> str:
    if implementation is None:
        return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "top_k")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    return implementation


def topk_select(scores: Array, k, K: int, *, span=None, implementation: str | None = None, config=None) -> Array:
    """Exact top-k positions per row, in the index contract.

    Args:
      scores: f32[..., N] (positions that may not be chosen hold -inf).
      k: int or int array broadcastable to scores.shape[:-1]: positions to keep per row (clipped to
        [0, min(K, N)]).
      K: static output width.
      span: None or (lo, hi), int arrays broadcastable to scores.shape[:-1]: only positions lo <= p < hi of a row
        may be chosen, exactly as if the others held -inf (`common.mask_span`). The GPU's "row", "ordered" and
        "sample" paths read the scores in place (no masked copy of them); the other implementations mask a copy.
      implementation: see the module docstring.
      config: tuning of the picked implementation (`gpu.SelectConfig`, `tpu.TpuSelectConfig`, or for "xla"
        the int bits_per_pass); None: the default.

    Under a mesh, a Pallas implementation runs per shard (see the module docstring).

    Returns:
      int32[..., min(K, N)]: the kept positions ascending (largest scores first by `lax.top_k`'s order, ties to
      the lower position; picks whose score is -inf or NaN dropped), then -1 padding.
    """
    impl = _pick(implementation)
    if impl in ("pallas_gpu", "pallas_tpu") and scores.ndim >= 3 and active_mesh() is not None:
        lead = check_args(scores, k, K)[0]  # the errors of the unsharded call, before k is broadcast to the rows
        rows = [jnp.broadcast_to(jnp.asarray(a, jnp.int32), lead) for a in ([k] if span is None else [k, *span])]
        return per_shard(lambda s, k, *sp: topk_select(s, k, K, span=sp or None, implementation=impl, config=config),
                         [scores, *rows], [dims(scores.ndim, 0, 1)] + [dims(scores.ndim - 1, 0, 1)] * len(rows),
                         dims(scores.ndim, 0, 1))
    if impl == "pallas_gpu":
        from pallas_kernels.topk_select import gpu
        return gpu.topk_select_gpu(scores, k, K, span=span, **({} if config is None else {"config": config}))
    scores = mask_span(scores, span)
    if impl == "top_k":
        return reference.topk_select_reference(scores, k, K)
    if impl == "xla":
        return xla.topk_select_xla(scores, k, K, **({} if config is None else {"bits_per_pass": config}))
    from pallas_kernels.topk_select import tpu
    return tpu.topk_select_tpu(scores, k, K, **({} if config is None else {"config": config}))
