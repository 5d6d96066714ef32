"""Kascade calibration: head-level reuse similarity, layer importance, anchors by dynamic programming.

On development prompts, with dense attention:
  * per layer and KV head, the causal post-softmax weights pooled over the GQA group and over each query tile,
    restricted to the keys before the tile and normalised: P[l, h, i, :];
  * that layer's top-k per tile (Kascade's prefill rule): I[l, h, i, :];
  * sim[l1, l2, h1, h2] = min over tiles i (where top-k is a real choice) of sum_j P[l2, h2, i, I[l1, h1, i, j]],
    the mass of layer l2 recovered with layer l1's indices; averaged over prompts;
  * importance w[l] = mean over tokens of 1 - cos(x_l, x_l + attn_l(x_l));
  * anchors, by fidelity (the default, `target_share`): a layer's *share* is the mass its reuse set recovers over
    the mass its own exact top-k keeps (the oracle's), S[a(l), l] / S[l, l], where a(l) is the last anchor <= l
    and S[a, l] = mean over h2 of max over h1 sim[a, l, h1, h2] (the head map takes the best anchor head).
    The anchors are the fewest (a dynamic program; among equally few, the largest total share) under which every
    reuse layer keeps at least `target_share` of the oracle's mass on the development prompts.
    On SmolLM2-135M adjacent layers share only 52-96% (min over tiles) and the paper's fixed 5 anchors lose
    the passkey (eval/results/kascade_diagnosis/REPORT.md); a fixed anchor count is still available
    (`num_anchors`: layer 0 plus M - 1 more maximising sum_l w[l] * S[a(l), l], by dynamic programming);
  * head_map[l, h2] = argmax_h1 sim[a(l), l, h1, h2] (identity for anchors);
  * reuse_scale r (per-layer budgets): an anchor hands its top-(r * k) keys to the reuse layers (it attends its
    own top-k); sim_wide records what those wider sets recover, and the report gives both shares per layer.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jsparse import selection as sel
from jsparse.artifacts import Artifact
from jsparse.methods.base import register_calibration
from jsparse.methods.common import check_tile, check_tile_flag
from jsparse.methods.oracle import select_prefill
from models import llama
from models.cache import init_cache
from pallas_kernels.dense import dense_prefill


@struct.dataclass
class RecorderState:
    probs: jax.Array  # f32[L, B, Hkv, nT, T]  normalised mass over the keys before each tile
    indices: jax.Array  # i32[L, B, Hkv, nT, K]
    wide: jax.Array  # i32[L, B, Hkv, nT, Kw]: top-(reuse_scale * k), what an anchor hands to its reuse layers


@struct.dataclass
class _Recorder:
    """Dense attention that records every layer's tile-pooled weights and top-k (calibration only)."""

    budget: float = struct.field(pytree_node=False, default=0.1)
    min_tokens: int = struct.field(pytree_node=False, default=128)
    tile: int = struct.field(pytree_node=False, default=32)
    reuse_scale: float = struct.field(pytree_node=False, default=1.0)

    def init_state(self, cfg, batch, max_len):
        n_tiles = -(-max_len // self.tile)
        K = sel.budget_tokens(self.budget, max_len, self.min_tokens)
        Kw = sel.budget_tokens(min(self.budget * self.reuse_scale, 1.0), max_len, self.min_tokens)
        L, H = cfg.num_layers, cfg.num_kv_heads
        return RecorderState(probs=jnp.zeros((L, batch, H, n_tiles, max_len), jnp.float32),
                             indices=jnp.zeros((L, batch, H, n_tiles, K), jnp.int32),
                             wide=jnp.zeros((L, batch, H, n_tiles, Kw), jnp.int32))

    def layer_info(self, cfg):
        return None

    def prefill(self, ctx, q, k, v, state):
        T = q.shape[1]
        probs = sel.before_tile_scores(sel.prefill_tile_probs(q, k, self.tile, ctx.lengths), self.tile)
        probs = jnp.where(jnp.isfinite(probs), probs, 0.0)
        probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
        tile_budget = sel.budget_tokens(self.budget, sel.tile_starts(T, self.tile), self.min_tokens)
        idx = select_prefill(q, k, self.tile, tile_budget, state.indices.shape[-1], ctx.lengths)
        wide_budget = sel.budget_tokens(min(self.budget * self.reuse_scale, 1.0), sel.tile_starts(T, self.tile),
                                        self.min_tokens)
        wide = select_prefill(q, k, self.tile, wide_budget, state.wide.shape[-1], ctx.lengths)
        state = RecorderState(probs=state.probs.at[ctx.layer].set(probs),
                              indices=state.indices.at[ctx.layer].set(idx), wide=state.wide.at[ctx.layer].set(wide))
        return dense_prefill(q, k, v), state


def _record(params, cfg, tokens, recorder):
    B, T = tokens.shape
    lengths = jnp.full((B,), T, jnp.int32)
    cache = init_cache(cfg, B, T, params.embed.dtype)
    _, _, state, (x_in, x_attn) = llama.prefill(params, cfg, recorder, tokens, lengths, cache,
                                                recorder.init_state(cfg, B, T), return_hidden=True)
    xi, xa = x_in.astype(jnp.float32), x_attn.astype(jnp.float32)
    cos = jnp.sum(xi * xa, -1) / (jnp.linalg.norm(xi, axis=-1) * jnp.linalg.norm(xa, axis=-1) + 1e-12)
    importance = jnp.mean(1.0 - cos, axis=(1, 2))  # [L]
    return state, importance


def _similarity(state: RecorderState, tile_budget, tile: int, wide: bool = False) -> jax.Array:
    """f32[L, L, H, H]: sim[l1, l2, h1, h2] for one batch (mean over the batch of the min over tiles); with
    `wide`, the mass recovered by layer l1's top-(reuse_scale * k) sets."""
    L, B, H, n_tiles, T = state.probs.shape
    indices = state.wide if wide else state.indices
    K = indices.shape[-1]
    n_before = jnp.arange(n_tiles) * tile
    eligible = n_before > tile_budget  # tiles where top-k leaves keys out
    P = jnp.moveaxis(state.probs, 1, 0).reshape(B, L * H, n_tiles, T)
    I = jnp.moveaxis(indices, 1, 0).reshape(B, L * H, n_tiles, K)

    def per_source(idx):  # idx: [B, nT, K] of one (l1, h1) -> [B, L*H, nT] recovered mass
        safe = jnp.where(idx >= 0, idx, 0)[:, None]
        got = jnp.take_along_axis(P, jnp.broadcast_to(safe, (B, L * H, n_tiles, K)), axis=-1)
        return jnp.sum(jnp.where(idx[:, None] >= 0, got, 0.0), axis=-1)

    rec = jax.lax.map(per_source, jnp.moveaxis(I, 1, 0))  # [L*H (src), B, L*H (dst), nT]
    rec = jnp.where(eligible, rec, jnp.inf).min(axis=-1)
    rec = jnp.where(jnp.isfinite(rec), rec, 1.0).mean(axis=1)  # [L*H, L*H]
    return rec.reshape(L, H, L, H).transpose(0, 2, 1, 3)


def layer_similarity(sim: np.ndarray) -> np.ndarray:
    """S[a, l] = mean over h2 of max over h1 sim[a, l, h1, h2]."""
    return np.asarray(sim).max(axis=2).mean(axis=2)


def select_anchors(S: np.ndarray, importance: np.ndarray, num_anchors: int) -> tuple[list[int], float]:
    """The dynamic program: layer 0 plus num_anchors - 1 layers maximising sum_l w[l] * S[a(l), l].

    Args:
      S: f64[L, L] layer-level similarity (row: anchor, column: layer); importance: f64[L].
    Returns:
      (sorted anchor layers, objective value).
    """
    S = np.asarray(S, np.float64)
    w = np.asarray(importance, np.float64)
    L = S.shape[0]
    if not 1 <= num_anchors <= L:
        raise ValueError(f"num_anchors={num_anchors}: expected between 1 and the number of layers, {L}")
    # seg[a, b] = sum_{l=a}^{b-1} w[l] * S[a, l]: the score of layers a..b-1 served by anchor a.
    contrib = np.where(np.arange(L)[None, :] >= np.arange(L)[:, None], w[None, :] * S, 0.0)
    prefix = np.concatenate([np.zeros((L, 1)), np.cumsum(contrib, axis=1)], axis=1)
    seg = lambda a, b: prefix[a, b] - prefix[a, a]  # noqa: E731
    # best[m, a]: best score of layers a..L-1 with an anchor at a and m more anchors after it.
    best = np.full((num_anchors, L), -np.inf)
    choice = np.zeros((num_anchors, L), np.int64)
    best[0] = [seg(a, L) for a in range(L)]
    for m in range(1, num_anchors):
        for a in range(L - m):
            cands = [(seg(a, b) + best[m - 1, b], b) for b in range(a + 1, L - m + 1) if best[m - 1, b] > -np.inf]
            best[m, a], choice[m, a] = max(cands)
    anchors, a = [0], 0
    for m in range(num_anchors - 1, 0, -1):
        a = int(choice[m, a])
        anchors.append(a)
    return anchors, float(best[num_anchors - 1, 0])


def share_matrix(S: np.ndarray, S_from: np.ndarray | None = None) -> np.ndarray:
    """share[a, l] = S_from[a, l] / S[l, l]: the part of layer l's own top-k mass (the oracle's) that anchor a's
    sets recover (S_from = S: same budget; S_from = the wide similarity: the reuse_scale-wider sets)."""
    S = np.asarray(S, np.float64)
    S_from = S if S_from is None else np.asarray(S_from, np.float64)
    return S_from / np.maximum(np.diag(S)[None, :], 1e-12)


def anchors_for_share(share: np.ndarray, target: float) -> list[int]:
    """The fewest anchors, layer 0 among them, under which every reuse layer's share (from its last anchor) is at
    least `target`; among equally few, the largest total share. A dynamic program over the layer order: scanning
    in order, making a layer an anchor only when the current one falls short, can take more (a layer the current
    anchor serves badly may be better left to a later anchor's predecessor)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target_share={target}: expected a fraction in (0, 1]")
    share = np.asarray(share, np.float64)
    L = share.shape[0]
    # best[a] = (anchors, -total share) of layers a..L-1 with an anchor at a, the least in that order; best[L]: none.
    best: list[tuple[int, float, list[int]]] = [(0, 0.0, [])] * (L + 1)
    for a in range(L - 1, -1, -1):
        served, choice = 0.0, None
        for b in range(a + 1, L + 1):  # the next anchor at b (L: none), a serving layers a+1 .. b-1
            if b - 1 > a:
                if share[a, b - 1] < target:
                    break
                served += share[a, b - 1]
            n, neg, rest = best[b]
            cand = (n + 1, neg - served - 1.0, [a] + rest)
            if choice is None or cand[:2] < choice[:2]:
                choice = cand
        best[a] = choice
    return best[0][2]


def per_layer_share(share: np.ndarray, anchors: Sequence[int]) -> np.ndarray:
    """f64[L]: the share each layer reaches under `anchors` (1 at anchors)."""
    L = share.shape[0]
    return np.array([1.0 if l in anchors else share[max(a for a in anchors if a <= l), l] for l in range(L)])


def brute_force_anchors(S: np.ndarray, importance: np.ndarray, num_anchors: int) -> tuple[list[int], float]:
    """Exhaustive search over anchor sets (for testing the dynamic program on small L)."""
    L = S.shape[0]
    best, best_set = -np.inf, None
    for rest in itertools.combinations(range(1, L), num_anchors - 1):
        anchors = [0, *rest]
        owner = np.array([max(a for a in anchors if a <= l) for l in range(L)])
        score = float(np.sum(importance * S[owner, np.arange(L)]))
        if score > best:
            best, best_set = score, anchors
    return best_set, best


def head_map_for(sim: np.ndarray, anchors: Sequence[int]) -> np.ndarray:
    """i32[L, H]: for every layer, the anchor head each KV head reuses (identity at anchors)."""
    L, H = sim.shape[0], sim.shape[2]
    hm = np.zeros((L, H), np.int32)
    for l in range(L):
        a = max(x for x in anchors if x <= l)
        hm[l] = np.arange(H) if a == l else np.argmax(sim[a, l], axis=0)
    return hm


def shortest_prompt(budget: float, tile: int, min_tokens: int, longest: int = 1 << 22) -> int | None:
    """The fewest prompt tokens (up to `longest`; None: none) with a query tile whose top-k leaves a key out, its
    start s > k(s) = max(ceil(budget * s), min_tokens); s - k(s) grows with s, so every longer prompt has one too.
    (A budget whose f32 is 1 has none.)"""
    starts = np.arange(tile, longest, tile, dtype=np.int32)
    found = np.flatnonzero(starts > np.asarray(sel.budget_tokens(budget, starts, min_tokens)))
    return int(starts[found[0]]) + 1 if len(found) else None


DEFAULT_TARGET_SHARE = 0.95
DEFAULT_MIN_TOKENS = 128
DEFAULT_REUSE_SCALE = 2.0


def calibrate(params, cfg, prompts: Iterable[np.ndarray], *, num_anchors: int | None = None,
              target_share: float = DEFAULT_TARGET_SHARE, reuse_scale: float = DEFAULT_REUSE_SCALE,
              budget: float = 0.1, tile: int = 32, min_tokens: int = DEFAULT_MIN_TOKENS, fingerprint: str = "",
              model_name: str = "", progress=None) -> Artifact:
    """Calibrates Kascade on prompts (each i32[B, T], all of one length) and returns the artifact.

    Anchors: the fewest that keep every reuse layer's share of its own top-k mass at or above `target_share`
    (`anchors_for_share`), or, with `num_anchors`, that many chosen by the dynamic program. `reuse_scale` (>= 1)
    widens what anchors hand to reuse layers; it is stored in the artifact and Kascade uses it by default.
    """
    sel.check_budget(budget)
    check_tile(tile)
    if num_anchors is not None and not 1 <= num_anchors <= cfg.num_layers:
        raise ValueError(f"anchors={num_anchors}: expected between 1 and the model's {cfg.num_layers} layers")
    if not 0.0 < target_share <= 1.0:
        raise ValueError(f"target_share={target_share}: expected a fraction in (0, 1]")
    if not 1.0 <= reuse_scale < float("inf"):
        raise ValueError(f"reuse_scale={reuse_scale}: expected a finite number >= 1 (1: reuse layers keep the "
                         "anchor's k keys)")
    if budget >= 1.0:
        raise ValueError(f"budget={budget}: a budget of 1 keeps every key, so every layer's share is 1 and there is "
                         "nothing to calibrate; expected a fraction below 1")
    recorder = _Recorder(budget=budget, min_tokens=min_tokens, tile=tile, reuse_scale=reuse_scale)
    record = jax.jit(_record, static_argnames=("cfg",))
    sim_fn = jax.jit(_similarity, static_argnames=("tile", "wide"))
    sims, wides, imps, n_rows = 0.0, 0.0, 0.0, 0
    for tokens in prompts:
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        starts = np.asarray(sel.tile_starts(T, tile))
        tile_budget = sel.budget_tokens(budget, sel.tile_starts(T, tile), min_tokens)
        if not np.any(starts > np.asarray(tile_budget)):  # no tile whose top-k leaves a key out: every share 1
            need = shortest_prompt(budget, tile, min_tokens)
            raise ValueError(f"calibration prompts of {T} tokens: no query tile's top-k leaves a key out (k = "
                             f"max(ceil({budget} * n), min_tokens={min_tokens}), tile={tile}), so every similarity "
                             "would be 1 and the anchors [0]; expected "
                             + (f"prompts of at least {need} tokens (--length)" if need else "a lower budget"))
        if n_rows == 0 and sel.budget_tokens(budget, T, 0) <= min_tokens:  # the floor binds at every position
            warnings.warn(f"calibration prompts of {T} tokens at budget {budget}: k = max(ceil({budget} * n), "
                          f"min_tokens={min_tokens}) is {min_tokens} at every position (the budget sets k only past "
                          f"{int(min_tokens / budget)} tokens), so the anchors are those of any budget up to "
                          f"{min_tokens / T:.3g}; calibrate on longer prompts (--length) for this budget's",
                          stacklevel=2)
        state, importance = record(params, cfg, tokens, recorder)
        # Each batch's means weighted by its rows: the prompts count alike however they are batched.
        sims = sims + B * np.asarray(sim_fn(state, tile_budget, tile), np.float64)
        wides = wides + B * np.asarray(sim_fn(state, tile_budget, tile, wide=True), np.float64)
        imps = imps + B * np.asarray(importance, np.float64)
        n_rows += B
        if progress is not None:
            progress(1)
    if n_rows == 0:
        raise ValueError("no calibration prompts given")
    sim, sim_wide, importance = sims / n_rows, wides / n_rows, imps / n_rows
    S = layer_similarity(sim)
    share = share_matrix(S)
    if num_anchors is None:
        anchors = anchors_for_share(share, target_share)
        objective = float(np.sum(importance * S[[max(a for a in anchors if a <= l) for l in range(len(S))],
                                                np.arange(len(S))]))
    else:
        anchors, objective = select_anchors(S, importance, num_anchors)
    head_map = head_map_for(sim, anchors)
    wide_share = share_matrix(S, layer_similarity(sim_wide))
    reached = per_layer_share(share, anchors)
    reached_wide = per_layer_share(wide_share, anchors)
    return Artifact(kind="kascade", fingerprint=fingerprint,
                    arrays={"anchors": np.asarray(anchors, np.int32), "head_map": head_map,
                            "similarity": sim.astype(np.float32), "similarity_wide": sim_wide.astype(np.float32),
                            "importance": importance.astype(np.float32)},
                    meta={"model": model_name, "num_anchors": len(anchors), "budget": budget, "tile": tile,
                          "min_tokens": min_tokens, "objective": objective, "anchors": anchors,
                          "target_share": None if num_anchors is not None else target_share,
                          "reuse_scale": reuse_scale,
                          "share": [round(float(x), 4) for x in reached],
                          "share_wide": [round(float(x), 4) for x in reached_wide],
                          "prompts": n_rows})


def report(art: Artifact) -> str:
    """The calibration report: anchors and, per layer, the share of the oracle's mass its reuse set keeps."""
    m = art.meta
    how = (f"target share {m['target_share']}" if m.get("target_share") is not None
           else f"{m['num_anchors']} anchors (dynamic program)")
    lines = [f"Kascade calibration ({how}, budget {m['budget']}, tile {m['tile']}, reuse_scale "
             f"{m.get('reuse_scale', 1.0)}): {len(m['anchors'])} anchors {m['anchors']}",
             "layer  role    share(k)  share(reuse_scale*k)   [own top-k mass kept by the reuse set, min over tiles]"]
    for l, (s1, s2) in enumerate(zip(m.get("share", []), m.get("share_wide", []))):
        role = "anchor" if l in m["anchors"] else "reuse"
        lines.append(f"{l:5d}  {role:6s}  {s1:8.3f}  {s2:8.3f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--target-share", type=float, default=None,
                   help="choose anchors so that every reuse layer keeps at least this share of its own exact "
                        f"top-k mass on the development prompts (default {DEFAULT_TARGET_SHARE}; not with --anchors)")
    p.add_argument("--anchors", type=int, default=None,
                   help="a fixed number of anchor layers, layer 0 included, chosen by the paper's dynamic "
                        "program instead of --target-share (the paper uses 5; on SmolLM2 that loses the passkey)")
    p.add_argument("--reuse-scale", type=float, default=DEFAULT_REUSE_SCALE,
                   help="anchors hand their top-(reuse_scale * k) keys to the reuse layers, which attend to "
                        f"that many (default {DEFAULT_REUSE_SCALE}; 1 is the paper's rule)")
    p.add_argument("--budget", type=float, default=0.1,
                   help="kept fraction of the keys in (0, 1) (default 0.1); a query keeps max(ceil(budget * n), 128) "
                        "of its n keys, so prompts (--length) of at most 128 / budget tokens calibrate every budget "
                        "alike (a warning says so)")
    p.add_argument("--tile", type=int, default=32, help="query rows pooled per tile (default 32)")


def check_cli(args) -> None:
    """The flags' checks that need no model (before it loads)."""
    if args.anchors is not None and args.anchors < 1:
        raise ValueError(f"--anchors {args.anchors}: expected at least 1 (layer 0 is always an anchor)")
    if args.anchors is not None and args.target_share is not None:
        raise ValueError(f"--anchors {args.anchors} and --target-share {args.target_share}: the anchors come from "
                         "one of the two rules; pass one")
    if args.target_share is not None and not 0.0 < args.target_share <= 1.0:
        raise ValueError(f"--target-share {args.target_share}: expected a fraction in (0, 1]")
    if not 1.0 <= args.reuse_scale < float("inf"):
        raise ValueError(f"--reuse-scale {args.reuse_scale}: expected a finite number >= 1")
    if not 0.0 < args.budget < 1.0:
        raise ValueError(f"--budget {args.budget}: expected a fraction in (0, 1) (a budget of 1 keeps every key: "
                         "nothing to calibrate)")
    check_tile_flag(args.tile)
    need = shortest_prompt(args.budget, args.tile, DEFAULT_MIN_TOKENS, longest=args.length + args.tile)
    if need is None or args.length < need:  # (the windows are --length tokens)
        need = shortest_prompt(args.budget, args.tile, DEFAULT_MIN_TOKENS)
        raise ValueError(f"--length {args.length}: no query tile's top-k leaves a key out at --budget {args.budget:g} "
                         f"(k = max(ceil(budget * n), {DEFAULT_MIN_TOKENS}) of a tile's n keys, --tile {args.tile}), "
                         "so every similarity would be 1 and the anchors [0]; expected "
                         + (f"--length >= {need}" if need else "a lower --budget"))


def run_cli(model, windows, args, progress=None) -> Artifact:
    """`jsparse calibrate kascade` once the model has loaded (`check_cli`, its registered check, ran before)."""
    from jsparse.artifacts import fingerprint

    if args.anchors is not None and not 1 <= args.anchors <= model.cfg.num_layers:
        raise ValueError(f"--anchors {args.anchors}: expected between 1 and the model's {model.cfg.num_layers} "
                         "layers")
    share = DEFAULT_TARGET_SHARE if args.target_share is None else args.target_share
    art = calibrate(model.params, model.cfg, (w[None] for w in windows), num_anchors=args.anchors,
                    target_share=share, reuse_scale=args.reuse_scale, budget=args.budget,
                    tile=args.tile, fingerprint=fingerprint(model), model_name=model.name, progress=progress)
    print(report(art), file=sys.stderr)
    return art


register_calibration("kascade", add_arguments, run_cli, check=check_cli,
                     help="Kascade: anchor layers by dynamic programming and head maps")
