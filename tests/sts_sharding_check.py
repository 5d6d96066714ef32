"""STS under sharding: the draft and the target on the same 2x4 and 1x8 meshes equal one device (run by
tests/test_sharding_sts.py).

Run as a script in a fresh process, as tests/sharding_check.py (whose import sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts, and whose tiny target it uses):

  python tests/sts_sharding_check.py      # prints one JSON line per (check, mesh) and exits 1 on a mismatch

Checks, against one device:
  forward    STS-P, then one STS-D verification round, as one jitted computation: the draft's prefill records its
             tile-pooled attention rows, the target's prefill attends the keys they choose (target prefill logits
             f32[B, V]); the draft decodes [prev, tok] and gamma - 1 more tokens recording its rows, the target
             verifies gamma + 1 positions with the keys they choose (logits f32[B, gamma + 1, V]). The draft's
             records (i32 indices) must be equal, the logits within ATOL.
  generated  `jsparse.api.generate_ids(target, prompts, method=sts, draft=draft)` with both models on the mesh:
             the whole speculative generation (prefills, greedy rounds, rollbacks by length): tokens, rounds and
             accepted draft tokens exactly equal. On the 2x4 mesh only (it splits both the data and the model
             axis; the 1x8 run added ~10 s of suite time and no path the forward check does not cover).
  session    a three-turn `jsparse.Session` with STS (the first message prefilled, two more appended on top of
             both caches, greedy rounds after each): the replies, rounds and accepted tokens exactly equal. A
             session is batch 1, so on the 2x4 mesh (data axis 2) it must raise ShardingError naming the data axis.

The draft has other head counts than the target (8 query and KV heads vs 16 and 8) and the head map sends every
target head to a random (draft layer, draft head), so a target head's draft row is held by another device.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import sharding_check as base  # noqa: F401  (first: sets XLA_FLAGS for 8 CPU devices before jax is imported)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jsparse.api import generate_ids  # noqa: E402
from jsparse.methods import make_method  # noqa: E402
from models import llama, sharding  # noqa: E402
from models.bundled import LoadedModel  # noqa: E402
from models.cache import cache_axes, init_cache  # noqa: E402
from models.params import random_params  # noqa: E402

CFG = base.CFG  # the target: 3 layers, 16 query / 8 KV heads
DRAFT_CFG = dataclasses.replace(CFG, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=8)
B, T, CAPACITY, GAMMA = base.B, base.T, base.CAPACITY, 2
ATOL = base.ATOL


def head_map(seed: int = 0) -> np.ndarray:
    """i32[L_t, Hq_t, 2]: a random (draft layer, draft head) per target layer and query head."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.integers(0, DRAFT_CFG.num_layers, (CFG.num_layers, CFG.num_heads)),
                     rng.integers(0, DRAFT_CFG.num_heads, (CFG.num_layers, CFG.num_heads))], -1).astype(np.int32)


def forward(t_method, d_method, t_params, d_params, tokens, lengths, mesh):
    """(prefill logits f32[B, V], verification logits f32[B, GAMMA + 1, V], prefill record idx, decode record idx)
    of STS-P + one STS-D round (the steps of `models.speculative.spec_prefill` / `spec_round`, logits kept)."""
    def fn(t_params, d_params, tokens, lengths):
        t_cache = sharding.constrain(init_cache(CFG, B, CAPACITY, jnp.float32), cache_axes())
        d_cache = sharding.constrain(init_cache(DRAFT_CFG, B, CAPACITY, jnp.float32), cache_axes())
        d_state = d_method.init_state(DRAFT_CFG, B, CAPACITY)
        _, d_cache, d_state = llama.prefill(d_params, DRAFT_CFG, d_method, tokens, lengths, d_cache, d_state)
        p_record = d_state.idx
        t_state = t_method.adopt_draft(t_method.init_state(CFG, B, CAPACITY), d_state)
        logits, t_cache, _ = llama.prefill(t_params, CFG, t_method, tokens, lengths, t_cache, t_state)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        prev = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
        d_state = d_method.end_prefill(DRAFT_CFG, d_state, B, CAPACITY)
        d_logits, d_cache, d_state = llama.decode(d_params, DRAFT_CFG, d_method, jnp.stack([prev, tok], 1),
                                                  d_cache.replace(lengths=lengths - 1), d_state)
        drafts = [jnp.argmax(d_logits[:, -1], -1).astype(jnp.int32)]
        for _ in range(GAMMA - 1):
            d_logits, d_cache, d_state = llama.decode(d_params, DRAFT_CFG, d_method, drafts[-1][:, None], d_cache,
                                                      d_state)
            drafts.append(jnp.argmax(d_logits[:, -1], -1).astype(jnp.int32))
        t_state = t_method.adopt_draft(t_method.end_prefill(CFG, t_state, B, CAPACITY), d_state)
        verify = jnp.stack([tok] + drafts, 1)  # [B, GAMMA + 1]
        v_logits, _, _ = llama.decode(t_params, CFG, t_method, verify, t_cache, t_state)
        return logits, v_logits, p_record, d_state.idx
    if mesh is None:
        return jax.jit(fn)(t_params, d_params, tokens, lengths)
    rows = [sharding.batch_sharding(mesh, n) for n in (1, 2, 3)]
    jitted = jax.jit(fn, in_shardings=(sharding.param_shardings(CFG, mesh), sharding.param_shardings(DRAFT_CFG, mesh),
                                       rows[1], rows[0]),
                     out_shardings=(rows[1], rows[2], None, None))
    with sharding.use_mesh(mesh):
        compiled = jitted.lower(t_params, d_params, tokens, lengths).compile()
        return (*compiled(t_params, d_params, tokens, lengths), compiled.as_text())


def record_rows_collectives(hlo_text: str) -> dict:
    """STS's cross-head step in a compiled forward on the 1x8 mesh: {(op, shape): count} of the collectives whose
    result has the shape of the draft-record rows the target reads: one layer's [Hq_t, B, R, W] in prefill (R = 3
    tiles of W = 15 keys), every layer's [L_t, Hq_t, B, 1, W] in decode (W = 22; `STS.start_rows` takes them all
    before the layer scan), or grouped by KV head [L_t * B, Hkv_t, G * W], or the shape of the whole record
    [L_d, B, Hq_d, R, W]."""
    rows = {f"{t}[{CFG.num_heads},{B},{r},{w}]" for t in ("s32", "f32") for r, w in ((3, 15), (1, 22))}
    G = CFG.num_heads // CFG.num_kv_heads
    rows |= {f"{t}[{CFG.num_layers},{CFG.num_heads},{B},1,22]" for t in ("s32", "f32")}
    rows |= {f"{t}[{CFG.num_layers * B},{CFG.num_kv_heads},{G * 22}]" for t in ("s32", "f32")}  # grouped by KV head
    whole = {f"{t}[{DRAFT_CFG.num_layers},{B},{DRAFT_CFG.num_heads},{r},{w}]" for t in ("s32", "f32")
             for r, w in ((3, 15), (1, 22))}
    return {k: n for k, n in base.collectives(hlo_text).items() if k[1] in rows | whole}


# The rows the target reads are gathered across `model` as an all-reduce of a masked local gather (each device
# fills the rows of the draft heads it holds): in prefill one layer's inside the layer scan; in decode every layer's
# at once before it (the weights also after XLA groups them by KV head: an all-gather); the whole record never
# moves. Since the draft selects its decode record after its layer scan (`record_after_scan`), XLA all-reduces the
# decode rows' weights as well as their keys (with the per-layer selection only the keys: the f32 all-reduce below
# was absent); one more collective of the rows' size, measured here so that a change is seen.
RECORD_ROWS_COLLECTIVES = {("all-reduce", "s32[16,2,3,15]"): 1, ("all-reduce", "f32[16,2,3,15]"): 1,
                           ("all-reduce", f"s32[{CFG.num_layers},16,2,1,22]"): 1,
                           ("all-reduce", f"f32[{CFG.num_layers},16,2,1,22]"): 1,
                           ("all-gather", f"f32[{CFG.num_layers * B},8,44]"): 1}


def generated(target, draft, sts, tokens, mesh):
    """Tokens i32[3, 6] (-1 padded), counts i32[3], and (rounds, accepted) of greedy speculative generation of
    3 prompts through `generate_ids` (on a mesh: 3 rows padded to a multiple of the data axis, then cut)."""
    if mesh is not None:
        target = dataclasses.replace(target, params=sharding.shard_params(CFG, target.params, mesh), mesh=mesh)
        draft = dataclasses.replace(draft, params=sharding.shard_params(DRAFT_CFG, draft.params, mesh), mesh=mesh)
    ids = [list(np.asarray(tokens[0, :40])), list(np.asarray(tokens[1, :29])), list(np.asarray(tokens[0, :33]))]
    stats = {}
    rows = generate_ids(target, ids, method=sts, max_new_tokens=6, capacity=CAPACITY, draft=draft, gamma=GAMMA,
                        stats=stats)
    return (np.asarray([r + [-1] * (6 - len(r)) for r in rows]), np.asarray([len(r) for r in rows]),
            np.asarray([stats["rounds"], stats["accepted"]]))


def session(target, draft, sts, tokens, mesh):
    """Replies i32[3, 5] (-1 padded), reply lengths i32[3] and (rounds, accepted) of a three-turn greedy STS
    `Session` (messages of 30, 7 and 9 tokens); on a mesh both models are sharded on it first."""
    from jsparse.session import Session

    if mesh is not None:
        target = dataclasses.replace(target, params=sharding.shard_params(CFG, target.params, mesh), mesh=mesh)
        draft = dataclasses.replace(draft, params=sharding.shard_params(DRAFT_CFG, draft.params, mesh), mesh=mesh)
    s = Session(target, draft, method=sts, gamma=GAMMA, capacity=CAPACITY)
    t = np.asarray(tokens[0])
    replies = [s.send_ids(list(m), max_new_tokens=5) for m in (t[:30], t[30:37], t[40:49])]
    return (np.asarray([r + [-1] * (5 - len(r)) for r in replies]), np.asarray([len(r) for r in replies]),
            np.asarray([s.rounds, s.accepted]))


def main() -> int:
    assert len(jax.devices()) == 8, jax.devices()
    t_params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.08)
    # The draft shares the target's embedding, head and final norm (as a distilled draft would), so that some of
    # its tokens are accepted: rounds of different lengths per row.
    # (Key 5: with these weights the rounds accept 4 of 13 rounds' drafts; whether any is accepted is chance.)
    d_params = random_params(DRAFT_CFG, jax.random.key(5), jnp.float32, scale=0.03).replace(
        embed=t_params.embed, lm_head=t_params.lm_head, final_norm=t_params.final_norm)
    target = LoadedModel(cfg=CFG, params=t_params, tokenizer=None, name="target")
    draft = LoadedModel(cfg=DRAFT_CFG, params=d_params, tokenizer=None, name="draft")
    # The default `row_merge="auto"` takes the N-wide scatter at these tiny shapes (generation and session below);
    # the forward check forces the index merge, whose grouped all-gather RECORD_ROWS_COLLECTIVES describes.
    sts = make_method("sts", cfg=CFG, draft=draft, head_map=head_map(), budget=0.3, min_tokens=8, tile=16)
    assert sts.merge_kind(16, T) == "scatter", "the generation rows should cover the scatter path"
    t_method, d_method = sts.replace(row_merge="index").for_round(DRAFT_CFG, GAMMA)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    lengths = jnp.asarray(base.LENGTHS, jnp.int32)
    cases = {
        "forward": lambda mesh: forward(t_method, d_method, t_params, d_params, tokens, lengths, mesh),
        "generated": lambda mesh: generated(target, draft, sts, tokens, mesh),
        "session": lambda mesh: session(target, draft, sts, tokens, mesh),
    }
    failed = False
    for name, fn in cases.items():
        t0 = time.perf_counter()
        want = [np.asarray(x) for x in fn(None)]
        if name == "generated":  # some draft tokens accepted, not all: the rounds emit different counts
            rounds, accepted = want[2]
            assert 0 < accepted < rounds * GAMMA, want[2]
        print(json.dumps({"check": name, "mesh": None, "seconds": round(time.perf_counter() - t0, 2),
                          **({"rounds_accepted": want[2].tolist()} if name == "generated" else {})}), flush=True)
        for spec in base.MESHES:
            if name == "generated" and spec != base.MESHES[0]:  # the 2x4 mesh splits both axes (suite time)
                continue
            mesh = sharding.make_mesh(spec)
            t0 = time.perf_counter()
            if name == "session" and sharding.mesh_size(mesh, "data") > 1:  # a session is one row
                try:
                    fn(mesh)
                    error = None
                except sharding.ShardingError as e:
                    error = str(e)
                ok = error is not None and "data axis of 2" in error
                failed |= not ok
                print(json.dumps({"check": name, "mesh": spec, "error": error, "ok": ok}), flush=True)
                continue
            result = fn(mesh)
            got = [np.asarray(x) for x in result[:4]]
            row = {}
            if name == "forward" and spec == "model=8":
                found = record_rows_collectives(result[4])
                row = {"record_collectives": {f"{op} {shape}": n for (op, shape), n in found.items()},
                       "collectives_ok": found == RECORD_ROWS_COLLECTIVES}
            exact = [g.dtype.kind in "iu" for g in got]
            mismatched = [i for i, (g, w, e) in enumerate(zip(got, want, exact)) if e and not np.array_equal(g, w)]
            err = max([float(np.max(np.abs(g - w))) for g, w, e in zip(got, want, exact) if not e] or [0.0])
            ok = not mismatched and err <= ATOL and all(np.isfinite(g).all() for g in got)
            ok &= row.get("collectives_ok", True)
            failed |= not ok
            print(json.dumps({"check": name, "mesh": spec, "max_abs_err": err, "int_mismatch": mismatched, **row,
                              "ok": ok, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
