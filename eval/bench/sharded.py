"""Sharded decode on 1/2/4/8 devices: dense vs Kascade vs EvoSparse, tokens/s and the bytes floor per device.

Random weights of a real model shape, bf16, a KV cache filled to `--context` tokens. For each device count n
(the first n devices, a mesh `data=1,model=n` by default: tensor parallel by heads, or `--layout data` for
data parallel by batch rows) and each method, the jitted decode step (`models.generate.sharded_fns`'s decode,
params / cache / state placed by `models.sharding`) is timed over `--steps` steps, beside the floor a device must
read per step: its shard of the weights plus its shard of the KV cache (dense), or of the KV the method reads at
its budget (a lower bound for the sparse methods: their selection reads more, e.g. Kascade's anchor layers
score every key).

    jsparse bench sharded --shape llama3-8b --context 131072 --batch 8 --devices 1,2,4,8 --out sharded_8b.json
    jsparse bench sharded --shape llama3-70b --layers 8 --context 32768 --batch 8 --devices 1,2,4,8
    jsparse bench sharded --compare-unsharded --out sharded_vs_unsharded.json   # one device: mesh of one vs none
    jsparse bench sharded --tiny                                                  # CPU smoke run, tiny shapes

`--compare-unsharded` times the same decode step on one device twice, through the unsharded `decode_step` path
and through the sharded path on a 1-device mesh, interleaved (the acceptance: within 3% of each other).
On a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=8 to see 8 devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import common as bm
from jsparse.methods import make_method
from jsparse.methods.evosparse import EvoSparse, default_num_heads
from jsparse.methods.kascade import Kascade
from models import llama, sharding
from models.cache import KVCache
from models.config import ModelConfig, RopeConfig
from models.generate import sharded_fns
from models.params import random_params
from models.presets import PRESETS

# Llama-3.1-70B: 80 layers, 64 query / 8 KV heads, d=128, F=28672 (use --layers to keep a few of its layers).
LLAMA3_70B = dataclasses.replace(PRESETS["llama3-8b"], hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, num_kv_heads=8)
TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4,
                   num_heads=16, num_kv_heads=8, head_dim=16, max_position_embeddings=4096,
                   rope=RopeConfig(theta=10000.0))
SHAPES = {"llama3-8b": PRESETS["llama3-8b"], "llama3-70b": LLAMA3_70B, "tiny": TINY}
METHODS = ("dense", "kascade", "evosparse")


def shape_config(shape: str, layers: int | None) -> ModelConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {sorted(SHAPES)}")
    cfg = SHAPES[shape]
    if layers is not None:
        if not 3 <= layers <= cfg.num_layers:
            raise ValueError(f"--layers {layers}: expected 3..{cfg.num_layers} (layer 0 dense, an anchor, a reuse "
                             "layer)")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    return cfg


def build_method(name: str, cfg: ModelConfig, budget: float, block: int):
    """The method at `budget` with calibration stand-ins (random weights have no real anchors or retrieval heads):
    Kascade with anchors every 4 layers from 1 and an identity head map, EvoSparse with its default share of
    retrieval heads drawn at random in layers >= 2."""
    if name == "dense":
        return make_method("dense")
    if name == "kascade":
        return Kascade.from_anchors(cfg, [0, *range(1, cfg.num_layers, 4)], budget=budget, min_tokens=16)
    if name == "evosparse":
        rng = np.random.default_rng(0)
        n = max(1, min(default_num_heads(cfg), (cfg.num_layers - 2) * cfg.num_heads))
        flat = rng.choice((cfg.num_layers - 2) * cfg.num_heads, size=n, replace=False)
        heads = sorted((2 + int(i) // cfg.num_heads, int(i) % cfg.num_heads) for i in flat)
        return EvoSparse.from_heads(cfg, heads, budget=budget, min_tokens=16, block_size=block)
    raise ValueError(f"unknown method {name!r}; expected one of {METHODS}")


def mesh_for(n: int, layout: str):
    devices = jax.devices()[:n]
    if len(devices) < n:
        raise ValueError(f"{n} devices asked, {len(jax.devices())} available: expected at most that many")
    return sharding.make_mesh({"data": n, "model": 1} if layout == "data" else {"data": 1, "model": n}, devices)


def sharded_bytes(tree) -> int:
    """Bytes of the largest per-device shard set of a placed pytree (what one device holds)."""
    per_device: dict = {}
    for x in jax.tree_util.tree_leaves(tree):
        for s in x.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.size * s.data.dtype.itemsize
    return max(per_device.values())


def _random_cache(key, *, cfg, batch, capacity, context, dtype):
    """Keys: a random tile of 256 positions repeated along the cache (no full-size f32 random draw, which would
    need twice the cache's memory); values: half the keys."""
    tile = jax.random.normal(key, (cfg.num_layers, batch, cfg.num_kv_heads, 256, cfg.head_dim), jnp.float32)
    k = jnp.tile(tile.astype(dtype), (1, 1, 1, capacity // 256, 1))
    return KVCache(k=k, v=k * jnp.asarray(0.5, dtype), lengths=jnp.full((batch,), context, jnp.int32))


def placed_inputs(cfg, mesh, batch, context, capacity, dtype):
    """Random params on the mesh and `make_cache()`, which fills a fresh cache on the mesh (no device holds more
    than its shards; one cache lives at a time: the 100K batch-4 cache of Llama-3.1-8B is 49 GB)."""
    if capacity % 256:
        raise ValueError(f"capacity={capacity}: expected a multiple of 256")
    params = jax.jit(lambda k: random_params(cfg, k, dtype), out_shardings=sharding.param_shardings(cfg, mesh))(
        jax.random.key(0))
    cache_sh = sharding.cache_sharding_for(cfg, batch, capacity, mesh)
    fill = jax.jit(functools.partial(_random_cache, cfg=cfg, batch=batch, capacity=capacity, context=context,
                                     dtype=dtype), out_shardings=cache_sh)
    return params, lambda: fill(jax.random.key(1))


def time_decode(step, params, method, cache, state, batch, steps: int):
    """Median ms of one decode step (each step's cache feeds the next; lengths reset so the context stays)."""
    tok = jnp.zeros((batch, 1), jnp.int32)
    lengths = np.asarray(cache.lengths)  # the step donates the cache: keep the lengths on the host
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        logits, cache, state = step(params, method, tok, cache, state)
        jax.block_until_ready(logits)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        cache = cache.replace(lengths=jax.device_put(lengths, cache.lengths.sharding))
    return float(np.median(times)), cache, state


def floor_bytes(cfg, params, batch, context, n_model, n_data, kv_fraction: float, dtype_bytes: int) -> int:
    """Bytes one device reads per decode step at least: its weight shards + its share of the KV read."""
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * dtype_bytes * kv_fraction
    return int(sharded_bytes(params) + kv / (n_model * n_data))


def run_sharded(cfg, shape, methods, devices, layout, batch, context, budget, block, steps, dtype, out):
    facts = bm.device_facts()
    capacity = -(-(context + steps + 4) // 256) * 256
    rows = []
    for n in devices:
        mesh = mesh_for(n, layout)
        sharding.check_heads(cfg, mesh)
        n_data, n_model = sharding.mesh_size(mesh, "data"), sharding.mesh_size(mesh, "model")
        params, make_cache = placed_inputs(cfg, mesh, batch, context, capacity, dtype)
        _, decode = sharded_fns(mesh, cfg, batch, capacity, False)[:2]
        for name in methods:
            row = {"devices": n, "mesh": f"data={n_data},model={n_model}", "method": name, "batch": batch,
                   "context": context}
            try:
                method = build_method(name, cfg, budget, block)
                state = sharding.shard_state(method.init_state(cfg, batch, capacity), cfg, batch, mesh)
                cache = None
                cache = make_cache()
                with sharding.use_mesh(mesh):
                    ms, cache, _ = time_decode(decode, params, method, cache, state, batch, steps)
                frac = 1.0 if name == "dense" else min(1.0, budget)
                nbytes = floor_bytes(cfg, params, batch, context, n_model, n_data, frac, jnp.dtype(dtype).itemsize)
                row.update(step_ms=ms, tokens_per_s=batch / (ms * 1e-3), floor_bytes_per_device=nbytes,
                           kv_fraction_in_floor=frac, achieved_gbs_per_device=nbytes / (ms * 1e-3) / 1e9)
            except Exception as e:  # noqa: BLE001 - record (out of memory, a kernel failing) and go on
                row["error"] = str(e).splitlines()[0][:300]
            cache = None  # free it before the next method's
            rows.append(row)
            print(row, flush=True)
        del params
    payload = {**facts, "benchmark": "sharded_decode", "shape": shape, "model": cfg.to_dict(),
               "dtype": jnp.dtype(dtype).name, "weights": "random", "layout": layout, "budget": budget,
               "decode_steps_timed": steps, "rows": rows}
    if out:
        bm.write_json(out, payload)
    print(bm.table(rows, ["devices", "mesh", "method", "step_ms", "tokens_per_s", "floor_bytes_per_device",
                          "achieved_gbs_per_device", "error"]))
    return payload


def run_compare(cfg, shape, methods, batch, context, budget, block, steps, rounds, dtype, out):
    """One device: the unsharded decode_step vs the sharded decode on a mesh of one, interleaved `rounds` times."""
    facts = bm.device_facts()
    capacity = -(-(context + steps + 4) // 256) * 256
    mesh = sharding.make_mesh({"data": 1, "model": 1}, jax.devices()[:1])
    params, make_cache = placed_inputs(cfg, mesh, batch, context, capacity, dtype)
    cache_sh = sharding.cache_sharding_for(cfg, batch, capacity, mesh)
    plain_params = jax.device_put(params, jax.devices()[0])
    _, sharded_decode = sharded_fns(mesh, cfg, batch, capacity, False)[:2]

    # The unsharded path: models.generate's decode jit (as decode_step, without its host-side request check).
    plain = jax.jit(lambda params, method, tok, cache, state: llama.decode(params, cfg, method, tok, cache, state),
                    donate_argnums=(3,))

    rows = []
    for name in methods:
        method = build_method(name, cfg, budget, block)
        times = {"unsharded": [], "mesh1": []}
        cache = make_cache()  # one cache, passed through both paths in turn (each step donates it)
        state = {k: method.init_state(cfg, batch, capacity) for k in times}
        for _ in range(rounds):
            ms, cache, state["unsharded"] = time_decode(plain, plain_params, method, cache, state["unsharded"],
                                                        batch, steps)
            times["unsharded"].append(ms)
            cache = jax.device_put(cache, cache_sh)  # the same device: relabels the sharding, copies nothing
            with sharding.use_mesh(mesh):
                ms, cache, state["mesh1"] = time_decode(sharded_decode, params, method, cache, state["mesh1"],
                                                        batch, steps)
            times["mesh1"].append(ms)
        cache = None
        u, m = float(np.median(times["unsharded"])), float(np.median(times["mesh1"]))
        row = {"method": name, "batch": batch, "context": context, "unsharded_step_ms": u, "mesh1_step_ms": m,
               "mesh1_over_unsharded": m / u, "within_3pct": abs(m / u - 1) <= 0.03,
               "rounds_ms": times}
        rows.append(row)
        print({k: v for k, v in row.items() if k != "rounds_ms"}, flush=True)
    payload = {**facts, "benchmark": "sharded_vs_unsharded", "shape": shape, "model": cfg.to_dict(),
               "dtype": jnp.dtype(dtype).name, "weights": "random", "budget": budget, "decode_steps_timed": steps,
               "rounds": rounds, "rows": rows}
    if out:
        bm.write_json(out, payload)
    print(bm.table(rows, ["method", "unsharded_step_ms", "mesh1_step_ms", "mesh1_over_unsharded", "within_3pct"]))
    return payload


# What --tiny sets, and the options' defaults without it.
TINY_RUN = dict(shape="tiny", context=96, batch=2, steps=2, dtype="float32", rounds=1, block=8)
FULL_RUN = dict(shape="llama3-8b", context=131072, batch=8, steps=16, dtype="bfloat16", rounds=5, block=16)


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help=f"model shape: {', '.join(sorted(SHAPES))} (default llama3-8b)")
    p.add_argument("--layers", type=bm.positive_int, default=None,
                   help="keep the first N layers of the shape (70B: to fit)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated among {','.join(METHODS)}")
    p.add_argument("--devices", default=None, type=bm.positive_ints,
                   help="comma-separated device counts, the first n devices each (default 1,2,4,8; with --tiny "
                        "those available)")
    p.add_argument("--layout", choices=["model", "data"], default=None,
                   help="model (the default): tensor parallel over heads (data=1,model=n); data: batch rows "
                        "(data=n,model=1)")
    p.add_argument("--context", type=bm.positive_int, default=None, help="tokens in the cache (default 131072)")
    p.add_argument("--batch", type=bm.positive_int, default=None, help="rows (default 8)")
    p.add_argument("--budget", type=float, default=0.1, help="kept fraction of the sparse methods (default 0.1)")
    p.add_argument("--block", type=bm.positive_int, default=None, help="EvoSparse block size (default 16)")
    p.add_argument("--steps", type=bm.positive_int, default=None, help="decode steps timed per case (default 16)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default bfloat16")
    p.add_argument("--compare-unsharded", action="store_true",
                   help="one device: time the unsharded decode step against the sharded one on a mesh of one")
    p.add_argument("--rounds", type=bm.positive_int, default=None,
                   help="interleaved rounds of --compare-unsharded (default 5)")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run on tiny shapes (CPU): shape tiny, context 96, batch 2, 2 steps, f32 (those "
                        "options refused beside it)")
    bm.add_out_argument(p, "sharded.json")  # --compare-unsharded: sharded_vs_unsharded.json in a folder --out
    a = p.parse_args(argv)
    if a.compare_unsharded and (given := [f"--{k}" for k in ("devices", "layout") if getattr(a, k) is not None]):
        p.error(f"{', '.join(given)} with --compare-unsharded: it times one device, unsharded and on a mesh of one")
    if a.tiny and (given := [f"--{k}" for k in TINY_RUN if getattr(a, k) is not None]):
        p.error(f"{', '.join(given)} with --tiny, which sets them (a smoke run on tiny shapes): expected one or the "
                "other")
    for k, v in (TINY_RUN if a.tiny else FULL_RUN).items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    a.layout = a.layout or "model"
    if a.tiny and a.devices is None:
        a.devices = [n for n in (1, 2, 4, 8) if n <= len(jax.devices())]
    devices = a.devices or [1, 2, 4, 8]
    methods = [m for m in a.methods.split(",") if m]
    try:
        for m in methods:
            if m not in METHODS:
                raise ValueError(f"--methods: unknown method {m!r}; expected among {METHODS}")
        cfg = shape_config(a.shape, a.layers)
        bm.check_contexts("--context", [a.context], cfg, a.shape)
        bm.check_budget(a.budget)
        for n in [] if a.compare_unsharded else devices:  # before any timing: a count past the host's ends no run
            try:
                sharding.check_heads(cfg, mesh_for(n, a.layout))
            except ValueError as e:
                raise ValueError(f"--devices {','.join(map(str, devices))}: {e}") from None
        name = "sharded_vs_unsharded.json" if a.compare_unsharded else "sharded.json"  # --out's default: sharded.json
        out = bm.out_path(name if a.out == "sharded.json" else a.out, name)
    except ValueError as e:  # sharding.ShardingError too
        p.error(str(e))
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    if a.compare_unsharded:
        return run_compare(cfg, a.shape, methods, a.batch, a.context, a.budget, a.block, a.steps, a.rounds, dtype,
                           out)
    return run_sharded(cfg, a.shape, methods, devices, a.layout, a.batch, a.context, a.budget, a.block, a.steps,
                       dtype, out)


if __name__ == "__main__":
    main()
