"""The decode queries' post-softmax weights over one layer of the stacked KV cache, read in place.

  head_probs_stacked(q: [B, T, Hq, D], k_all: [L, B, Hkv, N, D], layer: i32[], lengths: i32[B],
                     lse: f32[B, T, Hq]) -> f32[B, Hq, N]

the softmax rows of the T newest queries (query head h over KV head h // G, causal among the T new tokens, keys
at or past lengths never), summed over T, from each row's log-sum-exp `lse`, which the dense decode returns
next to its output (`pallas_kernels.dense_decode.dense_decode_stacked(..., return_lse=True)`): on a GPU the
kernel reads the layer's K in place from the stacked cache (no copy of the layer, no [B, Hq, T, N] logits in HBM).
It reads K a second time after the decode; STS's draft record (`jsparse.methods.sts.attend_and_probs`) now takes
the same weights from the logits the dense decode kernel writes (`dense_decode_stacked(..., return_probs=True)`,
K read once, measured faster in `eval/results/h100/sts_bench/bench_head_probs_fused.json`), so this kernel is the
choice only where the decode has already run without them. gpu.py is the Pallas Triton kernel; reference.py the
plain-jnp specification (`dense_decode.reference.decode_probs_reference`); api.py dispatches (elsewhere than on a
GPU: the reference).
"""

from pallas_kernels.head_probs.api import IMPLEMENTATIONS, head_probs_stacked, supported
from pallas_kernels.head_probs.reference import head_probs_stacked_reference

__all__ = ["IMPLEMENTATIONS", "head_probs_stacked", "head_probs_stacked_reference", "supported"]
