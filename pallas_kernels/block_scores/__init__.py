"""EvoSparse's decode kernels: retrieval block scores and gathered decode with per-entry softmax mass.

  block_max_scores(q: [B, T, Hq, D], k_all: [L, B, Hkv, N, D], layer: i32[], kv_heads: i32[R],
                   head_mask: bool[R, G], positions, lo, hi: i32[B, T], *, block_size) -> f32[B, T, N / block_size]
      the block max of q . K^T * scale over the masked query heads of the KV heads `kv_heads` (the layer's
      retrieval heads) and the block's visible tokens, -inf outside [lo, hi); K is read in place from the
      stacked cache and no per-token logits reach HBM.
  sparse_decode_mass(q: [B, T, Hq, D], k_all, v_all: [L, B, Hkv, N, D], layer: i32[], indices: i32[B, Hkv, T, K],
                     lengths: i32[B], *, block_size) -> (out [B, T, Hq, D], mass f32[B, Hkv, T, K])
      gathered sparse decode (as `pallas_kernels.sparse_attention.sparse_decode(layer=...)`) that also returns
      the post-softmax mass each index entry received (mean over the GQA group), from per-entry partial sums
      the kernel writes while it attends (no second gather of K).
  sparse_decode_heat(q: [B, 1, Hq, D], k_all, v_all, layer, indices: i32[B, Hkv, 1, K] (or every layer's
                     [L, B, Hkv, 1, K]), lengths, heat: f32[L, B, Hkv, N / block_size], *, block_size)
                     -> (out [B, 1, Hq, D], heat)
      one decode token's sparse_decode_mass with each entry's mass added into heat[layer] (EvoSparse's heat
      step, and H2O's with blocks of one token); on the GPU the split merge, the mass and the in-place heat
      update are one launch after the decode.
  select_blocks(heat: f32[B, Hkv, nb] | None, ret: i32[B, Wr] | None, n_s, hi, nbv, count: i32[B], full: bool[B],
                *, num_kv_heads, nb, width, heat_width) -> i32[B, Hkv, width]
      EvoSparse's attended blocks of a decode row: sink [0, n_s), local [hi, nbv), the retrieval set and the
      `count` hottest middle blocks outside it, ascending then -1 (every visible block where full); on the GPU
      one Triton launch (the heat row's exact top-k in registers, then the union).

  heat_candidates(heat, n_s, hi, k, width) / select_from_candidates(heat, cand, ret, ..., width, heat_width)
      the same selection in two parts: the k hottest middle blocks of every layer's heat at once (one top-k
      launch per decode step), then per layer pairwise ranks over those few candidates (no search over nb);
      select_from_plan(heat, cand, ret, plan, ...) takes the row arrays as one plan made once per step;
      select_span(heat, cand, ret, plan, out, first, count, *, span, ...) makes several layers' selections at once
      (one launch on the GPU), into their rows of a stacked out i32[L, B, Hkv, width].

  sparse_decode_pending(q, k_all, v_all, layer, indices: i32[L, B, Hkv, 1, K], lengths, pending, tickets)
                     -> (out, pending, tickets) / add_pending_mass(indices, pending, heat, *, group, first) -> heat
      sparse_decode_heat with blocks of one token in two parts, GPU only (`pending_available`): each layer's one
      launch keeps its entry sums in its slot of every layer's buffers (`pending_shapes`) and merges its output
      (the row's last program); after every layer, one launch adds all their mass into the heat (H2O's decode).

gpu.py: Pallas Triton kernels; xla.py: the XLA fallback (any backend; slices and gathers); reference.py: the
plain-jnp specification; api.py dispatches (gpu -> "pallas_gpu" when the kernel takes the arguments, else "xla").
"""

from pallas_kernels.block_scores.api import (IMPLEMENTATIONS, add_pending_mass, block_max_scores, pending_available,
                                             pending_shapes, select_blocks, select_from_candidates, select_from_plan,
                                             select_span, sparse_decode_heat, sparse_decode_mass,
                                             sparse_decode_pending, supported)
from pallas_kernels.block_scores.reference import (block_max_scores_reference, sparse_decode_heat_reference,
                                                   sparse_decode_mass_reference)
from pallas_kernels.block_scores.xla import heat_add, heat_candidates

__all__ = ["IMPLEMENTATIONS", "block_max_scores", "select_blocks", "select_from_candidates", "select_from_plan",
           "select_span", "sparse_decode_heat", "sparse_decode_pending", "add_pending_mass", "pending_available",
           "pending_shapes", "sparse_decode_mass", "supported", "block_max_scores_reference",
           "sparse_decode_heat_reference", "sparse_decode_mass_reference", "heat_add", "heat_candidates"]
