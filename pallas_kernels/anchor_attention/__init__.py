"""Fused anchor layer for Kascade decode: scores of every key, top-k selection, attention over the selected.

  anchor_decode(q: [B, T, Hq, D], k, v: [B, Hkv, N, D], lengths: i32[B], *, budget, min_tokens, K,
                dense_output) -> (out: [B, T, Hq, D], indices: int32[B, Hkv, T, K])

An anchor reads every key once (one pass writes the logits and each query head's logsumexp; pooling over the
GQA group gives exact post-softmax scores), selects with `topk_select`, and reads values only for the selected
keys through `sparse_decode` (a dense anchor, Kascade's layer 0, reads them all in the same pass instead).
Implementations: Pallas GPU (gpu.py), Pallas TPU (tpu.py), XLA (xla.py); reference.py is the specification.
"""

from pallas_kernels.anchor_attention.api import IMPLEMENTATIONS, anchor_decode
from pallas_kernels.anchor_attention.reference import anchor_decode_reference

__all__ = ["IMPLEMENTATIONS", "anchor_decode", "anchor_decode_reference"]
