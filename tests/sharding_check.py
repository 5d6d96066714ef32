"""Every method's prefill and decode on 2x4 and 1x8 meshes equal the one-device output (run by test_sharding.py;
STS, which needs a draft on the same mesh: tests/sts_sharding_check.py).

Run as a script in a fresh process: it sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing
jax, so the CPU shows 8 devices (the rest of the suite runs with one).

  python tests/sharding_check.py [METHOD ...]     # prints one JSON line per (method, mesh) and exits 1 on a mismatch
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import time

# 8 CPU devices; the cheapest CPU code generation (compiles dominate this check: 3 per method).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jsparse.api import generate_ids  # noqa: E402
from jsparse.methods import make_method  # noqa: E402
from jsparse.methods.butler import Butler  # noqa: E402
from jsparse.methods.butler_predictor import init_params  # noqa: E402
from jsparse.methods.evosparse import EvoSparse  # noqa: E402
from jsparse.methods.kascade import Kascade  # noqa: E402
from jsparse.methods.tsa import TSA  # noqa: E402
from models import sharding  # noqa: E402
from models import llama  # noqa: E402
from models.cache import cache_axes, init_cache  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.bundled import LoadedModel  # noqa: E402
from models.generate import decode_step, prefill_step, sharded_decode_step, sharded_prefill_step  # noqa: E402
from models.convert import params_from_numpy, params_to_numpy  # noqa: E402
from models.params import random_params  # noqa: E402
from train.predictor import preset_config  # noqa: E402

# Tiny Llama with 8 KV heads (16 query heads, groups of 2), so 8 divides the model axis.
CFG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=512)
B, T, CAPACITY = 2, 48, 64
LENGTHS = (48, 37)
MESHES = ("data=2,model=4", "model=8")
ATOL = 2e-5  # f32: the model-axis psums reorder sums, nothing else differs
# bf16 (params, activations and cache): the reordered sums round differently; |error| <= BF16_RTOL * max |logit|
# (measured: 0.7-1.4%). Run for the methods whose selection runs per shard in plain jnp, on the 1x8 mesh.
BF16_RTOL = 3e-2
BF16_METHODS = ("oracle", "h2o")
ODD_BATCH_METHODS = ("quest", "kascade", "tsa+kascade", "evosparse", "butler")  # per_shard kernels, collectives


def _head_map(seed):
    """i32[L, Hkv]: a permutation per layer, so a reuse head reads an anchor head held by another device."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(CFG.num_kv_heads) for _ in range(CFG.num_layers)]).astype(np.int32)


def build(name):
    small = dict(budget=0.3, min_tokens=8)
    if name in ("dense",):
        return make_method(name)
    if name in ("quest", "h2o"):  # the gathered decode (a GPU's default), not the mask the CPU would run
        return make_method(name, gathered=True, **small)
    if name in ("oracle", "streaming"):
        return make_method(name, **small)
    if name == "kascade":
        return Kascade.from_anchors(CFG, [0, 1], _head_map(0), tile=16, **small)
    if name == "tsa":
        return TSA(tau=0.05, window=8, min_tokens=4, capacity_buckets=2)
    if name == "tsa+kascade":
        inner = Kascade.from_anchors(CFG, [0, 1], _head_map(1), tile=16, **small)
        return TSA(tau=0.05, window=8, min_tokens=4, inner=inner, selection="kv_head", capacity_buckets=1)
    if name == "evosparse":
        return EvoSparse.from_heads(CFG, [(1, 3), (2, 12)], budget_tokens=24, block_size=4, heat_window=8,
                                    dense_layers=1, min_tokens=4)
    if name == "butler":
        pcfg = preset_config(CFG, "auto")
        return Butler.from_params(CFG, pcfg, init_params(pcfg, jax.random.key(3)), budget=0.3, min_tokens=4)
    raise ValueError(f"unknown method {name!r}")


METHODS = ("dense", "oracle", "streaming", "quest", "h2o", "kascade", "tsa", "tsa+kascade", "evosparse", "butler")


def forward(method, params, tokens, lengths, mesh):
    """(prefill logits f32[B, V], decode logits f32[B, 1, V]) of one jitted prefill + decode step on `mesh`
    (None: one device, no mesh): the whole forward one computation, params / rows / cache placed on the mesh. A
    batch the data axis does not divide runs with only the params placed: its rows stay whole (`constrain` leaves
    them, and each kernel's `per_shard` runs it unsplit)."""
    b = tokens.shape[0]

    def fn(params, tokens, lengths):
        cache = sharding.constrain(init_cache(CFG, b, CAPACITY, params.embed.dtype), cache_axes())
        state = method.init_state(CFG, b, CAPACITY)
        logits, cache, state = llama.prefill(params, CFG, method, tokens, lengths, cache, state)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        logits2, cache, _ = llama.decode(params, CFG, method, tok, cache, state)
        return logits, logits2, cache.k
    if mesh is None:
        return jax.jit(fn)(params, tokens, lengths)
    if b % sharding.mesh_size(mesh, "data"):
        with sharding.use_mesh(mesh):
            return jax.jit(fn)(params, tokens, lengths)
    rows = [sharding.batch_sharding(mesh, n) for n in (1, 2, 3)]
    kspec = sharding.cache_sharding_for(CFG, B, CAPACITY, mesh).k
    jitted = jax.jit(fn, in_shardings=(sharding.param_shardings(CFG, mesh), rows[1], rows[0]),
                     out_shardings=(rows[1], rows[2], kspec))
    with sharding.use_mesh(mesh):
        compiled = jitted.lower(params, tokens, lengths).compile()
        out = compiled(params, tokens, lengths)
    assert out[2].sharding == kspec, (out[2].sharding, kspec)
    return (*out, compiled.as_text())


def collectives(hlo_text: str) -> collections.Counter:
    """{(op, result shape): count} of the cross-device collectives in a compiled module's HLO text (a loop body
    counts once, whatever its trip count)."""
    ops = re.findall(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
                     hlo_text)
    return collections.Counter((op, re.sub(r"\{.*\}", "", shape)) for shape, op in ops)


# The collectives of the compiled prefill + decode forward on the 1x8 mesh (model axis only), B=2, T=48, N=64,
# E=64, Hq=16, Hkv=8, D=16, V=128: dense's (the model's own), then what each method adds to them. The README's
# "More than one device" lists them; a change in the partitioning shows up here.
DENSE_COLLECTIVES = {
    ("all-reduce", "f32[2,48,64]"): 3,  # prefill: the vocab-sharded embedding lookup, wo and w_down per layer
    ("all-reduce", "f32[2,1,64]"): 3,  # decode: the same
    ("all-gather", "f32[2,128]"): 1,  # the vocab-sharded prefill logits f32[B, V]
    ("all-gather", "f32[2,1,128]"): 1,  # the decode logits f32[B, 1, V]
    ("all-gather", "f32[2,8]"): 1,  # the argmax over vocab shards: each shard's max and position [B, model]
    ("all-gather", "s32[2,8]"): 1,
}
EXTRA_COLLECTIVES = {
    "streaming": {}, "h2o": {},
    # the model's own wo / w_down psums once more: the decode runs the dense first layers and the sparse ones as
    # two loops (`TokenBudget.segments`; streaming and h2o have no dense layer, one loop)
    "oracle": {("all-reduce", "f32[2,1,64]"): 2}, "quest": {("all-reduce", "f32[2,1,64]"): 2},
    # twice more: the decode runs layer 0 (the predictor), its dense layers and its sparse ones as three loops
    # (`Butler.segments`)
    "butler": {("all-reduce", "f32[2,1,64]"): 4},
    # the head map: a reuse layer's heads read the anchor's indices i32[B, Hkv, T, K] of any head; and the
    # model's own wo / w_down psums twice more (the decode runs its layers 0 | 1 | 2, one role each, as 3 loops)
    "kascade": {("all-gather", "s32[2,8,1,20]"): 1, ("all-gather", "s32[2,8,3,15]"): 1,
                ("all-reduce", "f32[2,1,64]"): 4},
    # the shared count per row: the head-summed scores f32[B, T] (the compression gathers run per shard)
    "tsa": {("all-reduce", "f32[2,48]"): 1},
    # both (the decode in Kascade's 3 loops); and the anchors' coordinate maps i32[B, Hkv, T] in the compressed
    # space, read through the head map
    "tsa+kascade": {("all-reduce", "f32[2,48]"): 1, ("all-gather", "s32[2,8,48]"): 3,
                    ("all-gather", "s32[2,8,1,20]"): 1, ("all-gather", "s32[2,8,3,15]"): 6,
                    ("all-reduce", "f32[2,1,64]"): 4},
    # the retrieval set: the pmax of the block max f32[B, T, nb], once: layers 1 and 2 both score
    # (`EvoSparse.segments` runs them as their own loops), so layer 1's set, which no layer reads, is dropped;
    # and the model's own wo / w_down psums once more. The heat f32[L, B, Hkv, nb] stays per shard (its
    # candidates' top-k too).
    "evosparse": {("all-reduce", "f32[2,1,16]"): 1, ("all-reduce", "f32[2,1,64]"): 2},
}
COLLECTIVES_MESH = "model=8"


def steps(method, params, tokens, lengths, mesh):
    """The public step functions: prefill_step / decode_step, or their sharded_* versions on `mesh`."""
    cache = init_cache(CFG, B, CAPACITY, jnp.float32)
    state = method.init_state(CFG, B, CAPACITY)
    if mesh is None:
        logits, cache, state = prefill_step(params, method, tokens, lengths, cache, state, cfg=CFG)
    else:
        logits, cache, state = sharded_prefill_step(mesh, params, method, tokens, lengths, cache, state, cfg=CFG)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
    if mesh is None:
        logits2, cache, state = decode_step(params, method, tok, cache, state, cfg=CFG)
    else:
        logits2, cache, state = sharded_decode_step(mesh, params, method, tok, cache, state, cfg=CFG)
        assert tuple(cache.k.sharding.spec)[:3] == tuple(
            sharding.logical_spec(("layers", "batch", "kv_heads"), cache.k.shape[:3], mesh)), cache.k.sharding
    return logits, logits2


def generated(method, params, tokens, lengths, mesh):
    """`jsparse.api.generate_ids` of 3 prompts (on a mesh: padded to a multiple of the data axis, then cut),
    through `sharded_generate_tokens`: (tokens i32[3, 4], counts i32[3])."""
    model = LoadedModel(cfg=CFG, params=params, tokenizer=None, name="tiny", mesh=mesh)
    ids = [list(np.asarray(tokens[0, :40])), list(np.asarray(tokens[1, :29])), list(np.asarray(tokens[0, :33]))]
    rows = generate_ids(model, ids, method=method, max_new_tokens=4, capacity=CAPACITY)
    return np.asarray([r + [-1] * (4 - len(r)) for r in rows]), np.asarray([len(r) for r in rows])


def known_layer_under_a_mesh(mesh) -> bool:
    """sparse_decode with `layer` a Python int under a mesh equals the call without one; an out-of-range one is
    refused there too (the shards see the layer traced, so the entry point checks it first)."""
    from pallas_kernels.sparse_attention.api import sparse_decode
    rng = np.random.default_rng(1)
    L, Hkv, N, K = 2, CFG.num_kv_heads, 32, 6
    q = jnp.asarray(rng.standard_normal((B, 1, CFG.num_heads, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((L, B, Hkv, N, 16)), jnp.float32) for _ in range(2))
    idx = jnp.asarray(np.sort(np.stack([[rng.choice(20, (1, K), replace=False) for _ in range(Hkv)]
                                        for _ in range(B)]), -1), jnp.int32)
    lengths = jnp.asarray([20, 20], jnp.int32)
    want = np.asarray(sparse_decode(q, k, v, idx, lengths, layer=1))
    with sharding.use_mesh(mesh):
        got = np.asarray(jax.jit(lambda *a: sparse_decode(*a, layer=1))(q, k, v, idx, lengths))
        try:
            sparse_decode(q, k, v, idx, lengths, layer=2)
            refused = ""
        except ValueError as e:
            refused = str(e)
    err = float(np.max(np.abs(got - want)))
    ok = err <= ATOL and "layer=2: expected a layer in [-L, L)" in refused
    print(json.dumps({"method": "sparse_decode", "path": "int_layer", "mesh": MESHES[0], "max_abs_err": err,
                      "refused": refused, "ok": ok}), flush=True)
    return ok


def main(argv):
    names = argv or METHODS
    assert len(jax.devices()) == 8, jax.devices()
    params = random_params(CFG, jax.random.key(0), jnp.float32, scale=0.08)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    meshes = {spec: sharding.make_mesh(spec) for spec in MESHES}
    # 2x4: placed as a checkpoint loader places them (host array -> its shards); 1x8: device_put of the tree.
    placed = {MESHES[0]: params_from_numpy(CFG, params_to_numpy(params), jnp.float32, mesh=meshes[MESHES[0]]),
              MESHES[1]: sharding.shard_params(CFG, params, meshes[MESHES[1]])}
    for spec, m in meshes.items():
        want_sh = sharding.param_shardings(CFG, m)
        for got, sh in zip(jax.tree_util.tree_leaves(placed[spec]), jax.tree_util.tree_leaves(want_sh)):
            assert got.sharding == sh, (spec, got.sharding, sh)
        assert placed[spec].layers.wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
        assert len(placed[spec].layers.wq.addressable_shards[0].data.shape) == 4
        assert placed[spec].layers.wq.addressable_shards[0].data.shape[2] == CFG.num_heads // sharding.mesh_size(
            m, "model")
    failed = False
    cases = [(name, forward) for name in names]
    if not argv:  # the public step functions and the generation loop, once
        cases += [("dense", steps), ("dense", generated)]
    baseline = {}
    dense_found = None  # dense's collectives on COLLECTIVES_MESH: what the others are compared with
    for name, fn in cases:
        method = build(name)
        key = (name, "forward" if fn is steps else fn.__name__)  # steps compute what forward does
        if key not in baseline:
            baseline[key] = [np.asarray(x) for x in fn(method, params, tokens, lengths, None)[:2]]
        want = baseline[key]
        specs = {forward: MESHES, steps: MESHES[:1],
                 generated: MESHES[:1]}[fn]
        for spec, mesh in ((s, meshes[s]) for s in specs):
            t0 = time.perf_counter()
            result = fn(method, placed[spec], tokens, lengths, mesh)
            got = [np.asarray(x) for x in result[:2]]
            if fn is generated:
                err = float(max(np.sum(g != w) for g, w in zip(got, want)))  # tokens: exact
            else:
                err = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
            ok = err <= ATOL and all(np.isfinite(g).all() for g in got)
            row = {"method": name, "path": fn.__name__, "mesh": spec, "max_abs_err": err}
            if fn is forward and spec == COLLECTIVES_MESH:
                found = collectives(result[3])
                if name == "dense":
                    dense_found = found
                    row["collectives_ok"] = found == collections.Counter(DENSE_COLLECTIVES)
                elif dense_found is not None:
                    extra = found - dense_found
                    row["collectives_ok"] = extra == collections.Counter(EXTRA_COLLECTIVES[name]) and \
                        not dense_found - found
                row["collectives"] = {f"{op} {shape}": n for (op, shape), n in sorted(found.items())}
                ok &= row.get("collectives_ok", True)
            if fn is forward and spec == "data=2,model=4":
                # No selection gathers a per-key tensor [..., N] over the mesh (butler's decode scores all-gathered
                # over `data` f32[B, Hq, 1, N] each layer until 2026-12-04; oracle's and h2o's run per shard too).
                row["key_gathers"] = sorted({shape for (op, shape), _ in collectives(result[3]).items()
                                             if op == "all-gather" and shape.count(",") >= 2
                                             and shape.rstrip("]").endswith(f",{CAPACITY}")})
                ok &= not row["key_gathers"]
            failed |= not ok
            print(json.dumps({**row, "ok": ok, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    # A batch of 3 rows on data=2: nothing splits the rows, every kernel runs whole (EvoSparse's block scores
    # once called their shard-only body there).
    odd = [n for n in ODD_BATCH_METHODS if n in names]
    if odd:
        odd_tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, T)), jnp.int32)
        odd_lengths = jnp.asarray(LENGTHS + (41,), jnp.int32)
    for name in odd:
        t0 = time.perf_counter()
        method = build(name)
        want = [np.asarray(x) for x in forward(method, params, odd_tokens, odd_lengths, None)[:2]]
        got = [np.asarray(x) for x in forward(method, placed[MESHES[0]], odd_tokens, odd_lengths, meshes[MESHES[0]])[:2]]
        err = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
        ok = err <= ATOL
        failed |= not ok
        print(json.dumps({"method": name, "path": "forward", "mesh": MESHES[0], "batch": 3, "max_abs_err": err,
                          "ok": ok, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    if not argv:
        failed |= not known_layer_under_a_mesh(meshes[MESHES[0]])
    bf16 = random_params(CFG, jax.random.key(0), jnp.bfloat16, scale=0.08)
    bf16_placed = sharding.shard_params(CFG, bf16, meshes[MESHES[1]])
    for name in (n for n in BF16_METHODS if n in names):
        t0 = time.perf_counter()
        method = build(name)
        want = [np.asarray(x, np.float32) for x in forward(method, bf16, tokens, lengths, None)[:2]]
        got = [np.asarray(x, np.float32) for x in forward(method, bf16_placed, tokens, lengths, meshes[MESHES[1]])[:2]]
        err = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
        scale = max(float(np.max(np.abs(w))) for w in want)
        ok = err <= BF16_RTOL * scale and all(np.isfinite(g).all() for g in got)
        failed |= not ok
        print(json.dumps({"method": name, "path": "forward", "mesh": MESHES[1], "dtype": "bfloat16",
                          "max_abs_err": err, "max_abs_logit": scale, "ok": ok,
                          "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
