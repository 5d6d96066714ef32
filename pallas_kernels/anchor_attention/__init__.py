"""Fused anchor layers for Kascade: scores of every key, top-k selection, attention over the selected keys.

  anchor_decode(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], lengths: i32[B], *, budget, min_tokens, K,
                dense_output) -> (out: [B, T, Hq, D], indices: int32[B, Hkv, T, K])
  anchor_prefill(q: [B, T, Hq, D], k, v: [B, T, Hkv, D], lengths: i32[B], *, tile, budget, min_tokens, K,
                 dense_output) -> (out: [B, T, Hq, D], indices: int32[B, Hkv, ceil(T / tile), K])

An anchor reads every key once (one pass writes the logits and each query head's logsumexp; pooling over the
GQA group gives exact post-softmax scores), selects with `topk_select`, and reads values only for the selected
keys through `sparse_decode` (a dense anchor, Kascade's layer 0, reads them all in the same pass instead).
In prefill the tile-pooled scores come from two passes over the keys (the rows' logsumexp, then the pooled
column sums), so [T, T] is never stored (gpu_prefill.py, tpu_prefill.py; on Hopper the two passes are
warp-specialised Mosaic GPU kernels, mgpu_prefill.py).
Implementations: Pallas GPU (gpu.py, gpu_prefill.py with mgpu_prefill.py), Pallas TPU (tpu.py, tpu_prefill.py),
XLA (xla.py, decode); reference.py is the specification.
"""

from pallas_kernels.anchor_attention.api import IMPLEMENTATIONS, anchor_decode, anchor_prefill
from pallas_kernels.anchor_attention.reference import (anchor_decode_reference, anchor_prefill_reference,
                                                       tile_scores_reference)

__all__ = ["IMPLEMENTATIONS", "anchor_decode", "anchor_prefill", "anchor_decode_reference",
           "anchor_prefill_reference", "tile_scores_reference"]
