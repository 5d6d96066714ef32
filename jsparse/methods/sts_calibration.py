"""STS head-map calibration: for every target (layer, query head), the draft (layer, query head) whose top-k keys
overlap most with the target head's exact top-k, summed over prefill traces of a development corpus.

Per trace and per query tile (Kascade's prefill rule: weights pooled over the tile, keys before the tile), both
models' exact top-k are computed tile by tile (`sts.tile_head_topk`, never a [T, T] array); the overlap of
target head a with draft head b is |I_a ∩ I_b| summed over the tiles where top-k is a real choice (more than k
keys before the tile), as a product of [heads, T] membership matrices one tile at a time. One map per k:

  head_map[k][l, h] = argmax over (draft layer, draft head) of overlap[k][l, h, :, :]   (i32[L_t, Hq_t, 2])

The artifact (kind "sts") is keyed to the target's fingerprint and records the draft's; loading it with other
models is an error.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse.artifacts import Artifact
from jsparse.methods.base import register_calibration
from jsparse.methods.common import check_tile, check_tile_flag
from jsparse.methods.sts import load_head_map, tile_head_topk  # noqa: F401  (load_head_map re-exported)
from models import llama
from models.cache import init_cache
from pallas_kernels.dense import dense_prefill


@struct.dataclass
class _TopkRecorder:
    """Dense prefill that records every layer's per-query-head tile top-k: i32[L, B, Hq, nT, k] (rank order)."""

    k: int = struct.field(pytree_node=False, default=64)
    tile: int = struct.field(pytree_node=False, default=32)

    def init_state(self, cfg, batch, max_len):
        return jnp.full((cfg.num_layers, batch, cfg.num_heads, -(-max_len // self.tile), self.k), -1, jnp.int32)

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        _, idx = tile_head_topk(q, k, self.tile, self.k)
        return dense_prefill(q, k, v), state.at[ctx.layer].set(idx)


def _trace(params, cfg, tokens, recorder):
    B, T = tokens.shape
    _, _, idx = llama.prefill(params, cfg, recorder, tokens, jnp.full((B,), T, jnp.int32),
                              init_cache(cfg, B, T, params.embed.dtype), recorder.init_state(cfg, B, T))
    return idx


def _overlap(t_idx, d_idx, ks: tuple[int, ...], tile: int, T: int):
    """f32[nK, L_t * Hq_t, L_d * Hq_d]: top-k overlaps summed over the eligible tiles of a batch of traces.

    t_idx: i32[L_t, B, Hq_t, nT, kmax]; d_idx: i32[L_d, B, Hq_d, nT, kmax] (rank order, -1 padded).
    """
    Lt, B, Ht, nT, _ = t_idx.shape
    Ld, Hd = d_idx.shape[0], d_idx.shape[2]
    # [B * nT, heads, kmax], one tile of one trace per step.
    ti = jnp.moveaxis(t_idx, (1, 3), (0, 1)).reshape(B * nT, Lt * Ht, -1)
    di = jnp.moveaxis(d_idx, (1, 3), (0, 1)).reshape(B * nT, Ld * Hd, -1)
    starts = jnp.tile(jnp.arange(nT) * tile, B)

    def membership(idx, k):  # [H, kmax] -> f32[H, T] (1 where key is among the first k)
        H = idx.shape[0]
        safe = jnp.where(idx[:, :k] >= 0, idx[:, :k], T)
        return jnp.zeros((H, T), jnp.float32).at[jnp.arange(H)[:, None], safe].set(1.0, mode="drop")

    def step(total, args):
        a, b, start = args
        per_k = []
        for k in ks:
            ov = jnp.dot(membership(a, k), membership(b, k).T, precision=jax.lax.Precision.HIGHEST)
            per_k.append(jnp.where(start > k, ov, 0.0))  # top-k is a real choice only past k keys
        return total + jnp.stack(per_k), None

    total, _ = jax.lax.scan(step, jnp.zeros((len(ks), Lt * Ht, Ld * Hd), jnp.float32), (ti, di, starts))
    return total


def head_maps_from_overlap(overlap: np.ndarray, draft_heads: int) -> np.ndarray:
    """overlap f[nK, L_t, Hq_t, L_d, Hq_d] -> i32[nK, L_t, Hq_t, 2] (draft layer, draft head) of the maximum."""
    nK, Lt, Ht = overlap.shape[:3]
    best = np.argmax(overlap.reshape(nK, Lt, Ht, -1), axis=-1)
    return np.stack([best // draft_heads, best % draft_heads], axis=-1).astype(np.int32)


def calibrate(t_params, t_cfg, d_params, d_cfg, prompts: Iterable[np.ndarray], *, ks: Sequence[int] = (64, 256),
              tile: int = 32, fingerprint: str = "", draft_fingerprint: str = "", model_name: str = "",
              draft_name: str = "", progress=None) -> Artifact:
    """Calibrates the STS head maps on prompts (each i32[B, T], all of one length T) -> the artifact; its meta
    records T as "length", which a fractional budget is read against (`sts.load_head_map`: without it the largest
    k stood in for T, so budget 0.25 of 256-token prompts picked the k=8 map instead of k=64)."""
    check_tile(tile)
    if t_cfg.vocab_size != d_cfg.vocab_size:
        raise ValueError(f"draft vocabulary of {d_cfg.vocab_size} tokens differs from the target's "
                         f"{t_cfg.vocab_size}: a draft must share the target's tokenizer")
    ks = tuple(sorted({int(k) for k in ks}))
    if not ks or ks[0] < 1:
        raise ValueError(f"k={list(ks)}: expected one or more token counts >= 1")
    trace = jax.jit(_trace, static_argnames=("cfg", "recorder"))
    overlap_fn = jax.jit(_overlap, static_argnames=("ks", "tile", "T"))
    total, n, length = 0.0, 0, None
    for tokens in prompts:
        tokens = jnp.asarray(tokens, jnp.int32)
        T = tokens.shape[1]
        if length is not None and T != length:
            raise ValueError(f"calibration prompts of {length} and {T} tokens: expected one length (the artifact "
                             "reads fractional budgets against it)")
        length = T
        if T <= ks[-1] + tile:
            raise ValueError(f"calibration prompts of {T} tokens are too short for k={ks[-1]} with tile={tile}: "
                             f"expected more than k + tile = {ks[-1] + tile} tokens (--length)")
        rec = _TopkRecorder(k=ks[-1], tile=tile)
        t_idx = trace(t_params, t_cfg, tokens, rec)
        d_idx = trace(d_params, d_cfg, tokens, rec)
        total = total + np.asarray(overlap_fn(t_idx, d_idx, ks, tile, T), np.float64)
        n += int(tokens.shape[0])  # prompts, not batches (meta "prompts", as Kascade's and TSA's)
        if progress is not None:
            progress(1)
    if n == 0:
        raise ValueError("no calibration prompts given")
    overlap = np.asarray(total).reshape(len(ks), t_cfg.num_layers, t_cfg.num_heads, d_cfg.num_layers, d_cfg.num_heads)
    maps = head_maps_from_overlap(overlap, d_cfg.num_heads)
    return Artifact(kind="sts", fingerprint=fingerprint,
                    arrays={"head_maps": maps, "ks": np.asarray(ks, np.int32), "overlap": overlap.astype(np.float32)},
                    meta={"model": model_name, "draft": draft_name, "draft_fingerprint": draft_fingerprint,
                          "ks": list(ks), "tile": tile, "prompts": n, "length": length})


def add_arguments(p) -> None:
    p.add_argument("--draft", required=True, help="the draft model (any --model spec with the target's vocabulary, "
                   "e.g. smollm2:layers=0-14)")
    p.add_argument("--k", default="64,256", help="comma-separated top-k sizes in tokens; one head map per k; "
                   "--length must exceed the largest k + --tile (default 64,256)")
    p.add_argument("--tile", type=int, default=32, help="query rows pooled per tile (default 32)")


def _cli_ks(args, length: int) -> list[int]:
    """--k's token counts, checked with --tile and the prompts' length (--length; no model needed)."""
    try:
        ks = [int(x) for x in str(args.k).split(",")]
    except ValueError:
        raise ValueError(f"--k {args.k!r}: expected comma-separated token counts like 64,256") from None
    if min(ks) < 1:
        raise ValueError(f"--k {args.k!r}: expected token counts >= 1")
    check_tile_flag(args.tile)
    if length <= max(ks) + args.tile:
        raise ValueError(f"--length {length}: too short for --k {max(ks)} with --tile {args.tile} (top-k is a "
                         f"choice only in tiles past k keys): expected --length > k + tile = {max(ks) + args.tile}")
    return ks


def check_cli(args) -> None:
    """The flags' checks that need no model (before it loads)."""
    _cli_ks(args, args.length)


def run_cli(model, windows, args, progress=None) -> Artifact:
    from jsparse.artifacts import fingerprint
    from models.bundled import load_model

    T = int(np.asarray(windows).shape[1])  # --length
    ks = _cli_ks(args, T)
    draft = load_model(args.draft, dtype=model.params.embed.dtype)  # the target's dtype
    if T > draft.cfg.max_position_embeddings:  # (the target's context is checked by the CLI)
        raise ValueError(f"--length {T}: expected at most the draft's context of {draft.cfg.max_position_embeddings} "
                         f"tokens (--draft {args.draft})")
    return calibrate(model.params, model.cfg, draft.params, draft.cfg, (w[None] for w in windows), ks=ks,
                     tile=args.tile, fingerprint=fingerprint(model), draft_fingerprint=fingerprint(draft),
                     model_name=model.name, draft_name=draft.name, progress=progress)


register_calibration("sts", add_arguments, run_cli, check=check_cli,
                     help="STS: the draft->target head map (max top-k overlap on prefill traces)")

