"""Mask-based Kascade prefill probe with knobs and per-layer stats (diagnosis of issue 16)."""
import functools, json, sys, time, re
import numpy as np, jax, jax.numpy as jnp
from flax import struct
from jsparse import selection as sel
from jsparse.methods.common import attend_dense
from pallas_kernels.dense import dense_prefill
from pallas_kernels.sparse_attention.reference import masked_attention_reference

NEG = sel.NEG_INF

@struct.dataclass
class ProbeState:
    sel: jax.Array          # bool[B,Hkv,nT,T] latest anchor's chosen before-tile keys
    own_cov: jax.Array      # f32[L,nT]
    used_cov: jax.Array     # f32[L,nT]
    needle_used: jax.Array  # f32[L] fraction of needle tokens in the used set of the last tile (mean over heads)
    needle_own: jax.Array   # f32[L] same, own top-k
    needle_rank: jax.Array  # f32[L] median rank of needle tokens in own pooled scores of the last tile
    needle_mass: jax.Array  # f32[L] share of last tile's before-tile mass on the needle

@struct.dataclass
class Probe:
    roles: jax.Array        # i32[L] 0 dense, 1 anchor, 2 reuse
    head_map: jax.Array     # i32[L,Hkv]
    needle: jax.Array       # i32[2]
    tile: int = struct.field(pytree_node=False, default=32)
    budget: float = struct.field(pytree_node=False, default=0.1)
    min_tokens: int = struct.field(pytree_node=False, default=128)
    local: int = struct.field(pytree_node=False, default=0)
    sinks: int = struct.field(pytree_node=False, default=0)
    pool: str = struct.field(pytree_node=False, default="group")
    dense_layers: tuple = struct.field(pytree_node=False, default=(0,))
    reuse_scale: float = struct.field(pytree_node=False, default=1.0)

    def init_state(self, cfg, batch, max_len):
        return None

    def layer_info(self, cfg):
        return (self.roles, self.head_map)

    def start(self, cfg, state, phase, batch, q_len, kv_len):
        if phase != "prefill":
            return state
        nT = -(-q_len // self.tile); L = cfg.num_layers
        z = lambda *s: jnp.zeros(s, jnp.float32)
        return ProbeState(sel=jnp.zeros((batch, cfg.num_kv_heads, nT, q_len), bool), own_cov=z(L, nT),
                          used_cov=z(L, nT), needle_used=z(L), needle_own=z(L), needle_rank=z(L), needle_mass=z(L))

    def finish(self, state, phase):
        return state

    def prefill(self, ctx, q, k, v, state):
        B, T, Hq, D = q.shape
        role, hmap = ctx.info
        tile = self.tile
        probs = sel.prefill_tile_probs(q, k, tile)  # [B,Hkv,nT,T]
        if self.pool == "all":
            probs = jnp.broadcast_to(probs.sum(1, keepdims=True), probs.shape)
        nT = probs.shape[2]
        starts = sel.tile_starts(T, tile)
        before = jnp.arange(T)[None, :] < starts[:, None]  # [nT,T]
        scores = jnp.where(before, probs, NEG)
        kdyn = sel.budget_tokens(self.budget, starts, self.min_tokens)
        K = sel.budget_tokens(self.budget, T, self.min_tokens)
        idx = sel.topk_indices(scores, kdyn[None, None], K)  # [B,Hkv,nT,K]
        scat = jax.vmap(jax.vmap(jax.vmap(lambda m, i: m.at[jnp.where(i >= 0, i, T)].set(True, mode="drop"))))
        own = scat(jnp.zeros(probs.shape, bool), idx)
        if self.reuse_scale != 1.0:
            kd2 = jnp.minimum(jnp.ceil(kdyn * self.reuse_scale).astype(jnp.int32), starts)
            K2 = min(int(np.ceil(K * self.reuse_scale)), T)
            wide = scat(jnp.zeros(probs.shape, bool), sel.topk_indices(scores, kd2[None, None], K2))
        else:
            wide = own
        reused = jnp.take(state.sel, hmap, axis=1)
        used = jnp.where(role == 2, reused, own)
        pb = jnp.where(before, probs, 0.0)
        tot = pb.sum(-1) + 1e-30
        own_cov = ((pb * own).sum(-1) / tot).mean((0, 1))
        used_cov = ((pb * used).sum(-1) / tot).mean((0, 1))
        # needle stats on the last full tile containing the question
        ns, nl = self.needle[0], self.needle[1]
        keys = jnp.arange(T)
        isn = (keys >= ns) & (keys < ns + nl)
        last = (T - 1) // tile
        nu = (used[:, :, last] & isn).sum(-1) / nl
        no = (own[:, :, last] & isn).sum(-1) / nl
        sc = scores[:, :, last]  # [B,Hkv,T]
        rank = (sc[..., None, :] > sc[..., :, None]).sum(-1)  # [B,Hkv,T] rank of each key
        nrank = jnp.where(isn, rank, 10**9).astype(jnp.float32)
        nrank = jnp.sort(nrank, axis=-1)[..., 0]  # best needle token rank
        nmass = (pb[:, :, last] * isn).sum(-1) / tot[:, :, last]
        L = ctx.layer
        st = state.replace(
            sel=jnp.where(role == 2, state.sel, wide),
            own_cov=state.own_cov.at[L].set(own_cov), used_cov=state.used_cov.at[L].set(used_cov),
            needle_used=state.needle_used.at[L].set(nu.mean()), needle_own=state.needle_own.at[L].set(no.mean()),
            needle_rank=state.needle_rank.at[L].set(nrank.mean()), needle_mass=state.needle_mass.at[L].set(nmass.mean()))
        # build row mask
        m = jnp.repeat(used, tile, axis=2)[:, :, :T]  # [B,Hkv,T,T]
        qpos = jnp.arange(T)[:, None]
        diag = (keys[None] >= (qpos // tile) * tile) & (keys[None] <= qpos)
        extra = diag
        if self.local:
            extra = extra | ((keys[None] >= (qpos // tile) * tile - self.local) & (keys[None] <= qpos))
        if self.sinks:
            extra = extra | (keys[None] < self.sinks)
        mask = (m | extra[None, None]) & (keys[None] <= qpos)[None, None]
        sparse_out = masked_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)
        dense = jnp.isin(ctx.layer, jnp.asarray(self.dense_layers))
        out = jnp.where(dense, dense_prefill(q, k, v), sparse_out)
        return out, st

    def decode(self, ctx, q, cache, state):
        return attend_dense(q, cache, ctx.lengths), state
