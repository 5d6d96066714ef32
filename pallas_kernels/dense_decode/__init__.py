"""Dense decode attention over one layer of the stacked KV cache, read in place.

  dense_decode_stacked(q: [B, T, Hq, D], k_all, v_all: [L, B, Hkv, N, D], layer: i32[], lengths: i32[B])
      -> [B, T, Hq, D]   (return_lse=True: and lse f32[B, T, Hq], the query rows' log-sum-exp)

equals `pallas_kernels.dense.dense_decode(q, k_all[layer], v_all[layer], lengths)` without the copy of the
layer's cache that XLA makes when a custom call (cuDNN, a Pallas kernel) consumes the slice inside the
model's layer scan. gpu.py is the Pallas Triton split-K kernel; reference.py the plain-jnp specification;
api.py dispatches (elsewhere than on a GPU it slices and calls `pallas_kernels.dense.dense_decode`).

  dense_decode_record(q: [B, 1, Hq, D], k_all, v_all, layer, lengths, record: f32[B, Hq, Lw, N],
                      bmax: f32[B, Hq, Lw, ceil(N / block)], record_layer) -> (out, lse f32[B, Hq], record, bmax)

also writes the query heads' logits and their block maxima into stacked record buffers in place.
"""

from pallas_kernels.dense_decode.api import IMPLEMENTATIONS, dense_decode_record, dense_decode_stacked, supported
from pallas_kernels.dense_decode.reference import dense_decode_record_reference, dense_decode_stacked_reference

__all__ = ["IMPLEMENTATIONS", "dense_decode_record", "dense_decode_record_reference", "dense_decode_stacked",
           "dense_decode_stacked_reference", "supported"]
