"""Gathered sparse attention: the op every sparse method calls.

  sparse_decode(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], indices: i32[B, Hkv, T, K], lengths: i32[B])
  sparse_decode_query_heads(q, k, v, indices: i32[B, Hq, T, K], lengths): one index row per query head
  sparse_prefill(q: [B, T, Hq, D], k, v: [B, T, Hkv, D], indices: i32[B, Hkv, ceil(T/tile), K], lengths: i32[B])

Each dispatches (by backend, or `implementation=`) to the Pallas GPU kernel (gpu.py; for prefill over block
selections also the Mosaic GPU one, mgpu_prefill.py, by `implementation="mosaic_gpu"`), the Pallas TPU kernel
(tpu.py) or XLA (xla.py); reference.py is the plain-jnp specification, with `masked_attention_reference` and
`indices_to_mask` for brute-force checks of every method.
"""

from pallas_kernels.sparse_attention.api import (IMPLEMENTATIONS, head_map_row, sparse_decode,
                                                 sparse_decode_query_heads, sparse_prefill, supported)
from pallas_kernels.sparse_attention.reference import (decode_indices_to_mask, indices_to_mask,
                                                       masked_attention_reference, prefill_indices_to_mask,
                                                       sparse_decode_reference, sparse_prefill_reference)

__all__ = [
    "IMPLEMENTATIONS",
    "head_map_row",
    "sparse_decode",
    "sparse_decode_query_heads",
    "sparse_prefill",
    "supported",
    "sparse_decode_reference",
    "sparse_prefill_reference",
    "masked_attention_reference",
    "indices_to_mask",
    "decode_indices_to_mask",
    "prefill_indices_to_mask",
]
