"""Exact top-k selection per row, without a sort: the op every top-k method's selection calls.

  topk_select(scores: f32[..., N], k: i32[...] or int, K) -> int32[..., min(K, N)]

The chosen positions come out ascending, -1 padded (the index contract), exactly as
`jsparse.selection.topk_indices` (lax.top_k) would choose them, ties resolved by the lower position.
Implementations: a radix threshold search over the scores' order-preserving int32 keys (a few counting
passes) followed by an ascending compaction, as Pallas GPU (Triton) kernels (gpu.py: a single-launch kernel
per row up to 16K scores in gpu_row.py, a sampled threshold bracket for longer rows in gpu_sample.py, a
glue-free multi-launch path in gpu_fused.py, the original path), a
Pallas TPU kernel (tpu.py) and plain XLA (xla.py); reference.py is the `lax.top_k` specification.
"""

from pallas_kernels.topk_select.api import IMPLEMENTATIONS, topk_select
from pallas_kernels.topk_select.reference import topk_select_reference

__all__ = ["IMPLEMENTATIONS", "topk_select", "topk_select_reference"]
