"""Retrieval heads: the few (layer, query head) pairs that copy from far back in the context.

A calibration scores every head (`jsparse calibrate evosparse`: how often its argmax lands on the token a
retrieval prompt copies); a method keeps the top ones and reads, per layer, which KV heads hold them and which
members of each GQA group they are (`RetrievalLayout`, the layer scan's xs).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.artifacts import load_artifact
from pallas_kernels.block_scores import block_max_scores
from pallas_kernels.topk_select import topk_select

Array = jax.Array
DEFAULT_HEAD_FRACTION = 0.015  # retrieval heads by default: 1.5% of the model's L * Hq heads


@struct.dataclass
class RetrievalLayout:
    """Per-layer retrieval heads (the scan's xs): has_retrieval: bool[L]; kv_heads: i32[L, R] KV heads that
    hold retrieval heads (padded with 0); head_mask: bool[L, R, G] which query heads of each such KV head's
    GQA group are retrieval heads (all False on padding)."""

    has_retrieval: Array
    kv_heads: Array
    head_mask: Array


def retrieval_layout(cfg, heads: Sequence[tuple[int, int]]) -> RetrievalLayout:
    """Layer info from a list of (layer, query head) retrieval heads."""
    L, Hq, Hkv = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
    G = Hq // Hkv
    per_layer: list[dict[int, list[int]]] = [dict() for _ in range(L)]
    for layer, head in heads:
        if not (sel.is_int(layer) and sel.is_int(head)):
            raise ValueError(f"retrieval head (layer={layer!r}, head={head!r}): expected integer indices (1.7 or "
                             "True would be read as another layer or head)")
        layer, head = int(layer), int(head)
        if not (0 <= layer < L and 0 <= head < Hq):
            raise ValueError(f"retrieval head (layer={layer}, head={head}): expected layer in [0, {L}) and head in "
                             f"[0, {Hq})")
        per_layer[layer].setdefault(head // G, []).append(head % G)
    R = max(1, max(len(d) for d in per_layer))
    kv = np.zeros((L, R), np.int32)
    mask = np.zeros((L, R, G), bool)
    for layer, d in enumerate(per_layer):
        for r, (h, gs) in enumerate(sorted(d.items())):
            kv[layer, r] = h
            mask[layer, r, gs] = True
    has = mask.any(axis=(1, 2))
    return RetrievalLayout(has_retrieval=jnp.asarray(has), kv_heads=jnp.asarray(kv), head_mask=jnp.asarray(mask))


def top_heads(scores: np.ndarray, num: int) -> list[tuple[int, int]]:
    """The `num` (layer, head) pairs with the highest scores f32[L, Hq] (ties: lower layer, then head)."""
    scores = np.asarray(scores, np.float64)
    if not sel.is_int(num) or num < 1 or num > scores.size:
        raise ValueError(f"num_retrieval_heads={num!r}: expected between 1 and the model's {scores.size} heads")
    order = np.argsort(-scores.ravel(), kind="stable")[:num]
    return [(int(i // scores.shape[1]), int(i % scores.shape[1])) for i in order]


def default_num_heads(cfg, fraction: float = DEFAULT_HEAD_FRACTION) -> int:
    """max(1, round(fraction * L * Hq)) retrieval heads."""
    return max(1, int(round(fraction * cfg.num_layers * cfg.num_heads)))


def load_retrieval_heads(path: str, kind: str, fingerprint: str | None, cfg, num: int | None = None):
    """The top `num` (default `default_num_heads`) heads [(layer, query head), ...] by the scores f32[L, Hq] of a
    calibration artifact of `kind` (checked against the model's fingerprint and shape)."""
    art = load_artifact(path, kind, fingerprint)
    scores = np.asarray(art.arrays["scores"])
    if scores.shape != (cfg.num_layers, cfg.num_heads):
        raise ValueError(f"artifact at {path!r} scores {scores.shape} heads: expected (L, Hq) = "
                         f"{(cfg.num_layers, cfg.num_heads)}")
    return top_heads(scores, default_num_heads(cfg) if num is None else num)  # 0 is refused there, not defaulted


def retrieval_blocks(info: RetrievalLayout, q: Array, k_all: Array, layer: Array, pos: Array, first, last, count,
                     width: int, block_size: int, implementation: str | None = None) -> Array:
    """The retrieval set of every new token: i32[B, T, width] blocks ascending, -1 padded.

    The block max of q . K^T / sqrt(d) over the layer's retrieval heads (`block_max_scores`: on a GPU one kernel
    that reads K of the R KV heads in place from the stacked cache and writes f32[B, T, nb]), over the blocks in
    [first, last), then the top `count`.

    Args:
      info: this layer's RetrievalLayout slice (kv_heads: i32[R], head_mask: bool[R, G]).
      q: [B, T, Hq, D]; k_all: [L, B, Hkv, N, D] the stacked cache, read at `layer` (i32[]).
      pos: i32[B, T] query positions; first, last: i32[B, T] the candidate blocks; count: i32[B, T] blocks to
        choose (0: none, so the top-k kernel stops at once); width: the static set width.
    """
    scores = block_max_scores(q, k_all, layer, info.kv_heads, info.head_mask, pos, first, last,
                              block_size=block_size, implementation=implementation)
    return topk_select(scores, count, width)
