"""GPU check and timing of the Mosaic GPU tile-gathered sparse prefill kernel (`sparse_attention.mgpu_prefill`)
against the Triton kernels (`sparse_attention.gpu`) and cuDNN's dense causal attention, on the H100.

    python -m eval.bench.sparse_prefill_mgpu --out DIR      (or: jsparse bench sparse_prefill_mgpu --out DIR)

1. Checks, compiled: the Mosaic kernel against `sparse_prefill_reference` at a small shape (B 2, T 1000, Hq 8,
   Hkv 2, D 128, bf16, a shorter second row) for every timed tile, block size and Mosaic config.
2. Times, at each --context (B 1, Llama-3.1-8B heads: 32 query, 8 KV, d 128, bf16) and each --tiles (all contexts
   of the first tile first, so a time budget that runs out drops the later tiles), with a --budget selection per
   query tile (Kascade's rolling count, `tile_counts`, with random unique entries):
     * dense_cudnn_causal: `jax.nn.dot_product_attention(..., implementation="cudnn")`;
     * triton[bs1]: the Triton kernel over a token-level selection (what Kascade runs today);
     * triton[bsN]: the Triton kernel over the same block selection the Mosaic kernel gets;
     * mosaic[bsN]: the Mosaic GPU kernel over a selection of blocks of N tokens (`--block-sizes`; block sizes
       that do not divide the tile are skipped), one row per --mosaic-configs entry (block_kv x stages).
   Each row reports ms and the effective TFLOP/s of its selected work, 4 * D * Hq * B * (pairs), pairs = sum over
   tiles of (selected tokens before the tile) * tile + the causal diagonal tile (as `eval/bench/attention.py`), and
   the speedup over the dense run of the same context.

A failing variant (compile error, out of memory) is recorded with its error and the rest go on. Writes the JSON
(device, jax, date, commit, command, checks, records) to --out and prints a table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jax
import jax.numpy as jnp

from eval.bench.common import (add_out_argument, device_facts, nonnegative_int, out_path, positive_int, positive_ints,
                               require_gpu, table, time_ms, write_json)

NAME = "sparse_prefill_mgpu.json"


def _parser(prog=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p, NAME)
    p.add_argument("--context", type=positive_ints, default=[32768, 131072],
                   help="T of the timed shapes (default 32768,131072)")
    p.add_argument("--tiles", type=positive_ints, default=[128, 64, 32], help="query tiles (default 128,64,32)")
    p.add_argument("--block-sizes", type=positive_ints, default=[64, 16],
                   help="tokens per index entry of the Mosaic kernel's selection (default 64,16)")
    p.add_argument("--budget", type=float, default=0.1, help="selected fraction of the keys before each tile")
    p.add_argument("--min-tokens", type=nonnegative_int, default=128, help="Kascade's minimum selection per tile (default 128)")
    p.add_argument("--mosaic-configs", default="128x2",
                   help="Mosaic kernel configs to time, block_kv x stages, comma separated (default 128x2; "
                        "e.g. 128x2,64x3,64x4)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed calls per variant (default 5)")
    p.add_argument("--time-budget", type=float, default=210.0,
                   help="seconds after which the remaining variants are skipped (recorded; default 210)")
    p.add_argument("--interpret", action="store_true",
                   help="run the kernels in their interpreters (CPU smoke test: tiny shapes only)")
    return p


def selection(key, T: int, Hkv: int, tile: int, block_size: int, budget: float, min_tokens: int):
    """Random selection with Kascade's rolling count: (indices int32[1, Hkv, nt, K] in blocks of block_size tokens,
    unique ascending -1 padded; selected tokens per tile int64[nt] (whole blocks, so up to block_size - 1 more
    than the count))."""
    from pallas_kernels.anchor_attention.common import tile_counts
    from pallas_kernels.sparse_attention.testing import strided_indices

    nt = -(-T // tile)
    counts = np.asarray(tile_counts(budget, T, tile, min_tokens), np.int64)  # tokens per tile
    blocks = -(-counts // block_size)
    limit = np.arange(nt, dtype=np.int64) * tile // block_size  # blocks before each tile start
    blocks = np.minimum(blocks, limit)
    K = max(1, int(blocks.max()))
    lim = jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (1, Hkv, nt))
    cnt = jnp.broadcast_to(jnp.asarray(blocks, jnp.int32), (1, Hkv, nt))
    idx = strided_indices(key, jnp.maximum(lim, 1), cnt, K)
    idx = jnp.where(lim[..., None] > 0, idx, -1)
    return idx, blocks * block_size


def _configs(spec: str):
    from pallas_kernels.sparse_attention.mgpu_prefill import MosaicPrefillConfig

    out = []
    for item in spec.split(","):
        bkv, stages = (int(x) for x in item.lower().split("x"))
        out.append((f"bkv{bkv}_s{stages}", MosaicPrefillConfig(block_kv=bkv, stages=stages)))
    return out


def flops(tokens_per_tile: np.ndarray, tile: int, Hq: int, D: int, B: int = 1) -> float:
    nt = tokens_per_tile.shape[0]
    pairs = int(np.sum(tokens_per_tile * tile) + nt * tile * (tile + 1) // 2)
    return 4.0 * D * Hq * B * pairs


def rel_err(got, want) -> float:
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def main(argv=None, prog=None) -> int:
    p = _parser(prog)
    args = p.parse_args(argv)
    try:
        if not args.interpret:
            require_gpu("sparse_prefill_mgpu", "--interpret")
        path = out_path(args.out, NAME)  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))
    from pallas_kernels.dense import dense_prefill
    from pallas_kernels.sparse_attention import gpu, mgpu_prefill as mg
    from pallas_kernels.sparse_attention.reference import sparse_prefill_reference

    t0 = time.perf_counter()
    ik = dict(interpret=True) if args.interpret else {}
    out = dict(device_facts(), budget=args.budget, min_tokens=args.min_tokens, checks=[], records=[])

    def over() -> bool:
        return time.perf_counter() - t0 > args.time_budget

    configs = _configs(args.mosaic_configs)
    default_name = configs[0][0]

    # 1. Checks against the reference (a small shape).
    small = ((2, 1000, 8, 2, 128),) if not args.interpret else ((1, 256, 4, 1, 64),)
    for (B, T, Hq, Hkv, D) in small:
        ks = jax.random.split(jax.random.key(T), 4)
        q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, T, Hkv, D), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, T, Hkv, D), jnp.bfloat16)
        lengths = jnp.asarray([T] + [T - 77] * (B - 1), jnp.int32)
        for tile in args.tiles:
            for bs in [b for b in args.block_sizes if tile % b == 0]:
                idx, _ = selection(ks[3], T, Hkv, tile, bs, 0.3, 64)
                idx = jnp.concatenate([idx] * B, axis=0)
                want = sparse_prefill_reference(q, k, v, idx, lengths, tile=tile, block_size=bs)
                for cname, cfg in configs:
                    rec = dict(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, tile=tile, block_size=bs, config=cname)
                    t1 = time.perf_counter()
                    try:
                        got = mg.sparse_prefill_mgpu(q, k, v, idx, lengths, tile=tile, block_size=bs, config=cfg, **ik)
                        rec["rel_err"] = rel_err(got, want)
                        rec["ok"] = bool(rec["rel_err"] < 2e-2)
                    except Exception as e:  # noqa: BLE001 - recorded, the other variants go on
                        rec.update(error=(type(e).__name__ + ": " + str(e))[:400], ok=False)
                    rec["seconds"] = time.perf_counter() - t1
                    out["checks"].append(rec)
                    print("check", rec, flush=True)

    # 2. Timings at Llama-3.1-8B heads.
    Hq, Hkv, D = (32, 8, 128) if not args.interpret else (4, 1, 64)

    def record(sec: dict, impl: str, fn, *a, work: float | None = None, dense_ms: float | None = None) -> dict:
        r = dict(sec, impl=impl)
        t1 = time.perf_counter()
        if over():
            r["skipped"] = "time budget"
        else:
            try:
                ms = time_ms(fn, *a, warmup=2, iters=args.iters)
                r["ms"] = ms
                if work:
                    r["tflops"] = work / (ms * 1e-3) / 1e12
                if dense_ms:
                    r["speedup_vs_dense"] = dense_ms / ms
            except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                r["error"] = (type(e).__name__ + ": " + str(e).strip().splitlines()[0] if str(e).strip()
                              else type(e).__name__)[:400]
            r["seconds"] = time.perf_counter() - t1  # compile and timing
        out["records"].append(r)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        return r

    data, dense_ms = {}, {}
    for T in args.context:
        ks = jax.random.split(jax.random.key(T), 4)
        data[T] = [jax.random.normal(ks[0], (1, T, Hq, D), jnp.bfloat16),
                   jax.random.normal(ks[1], (1, T, Hkv, D), jnp.bfloat16),
                   jax.random.normal(ks[2], (1, T, Hkv, D), jnp.bfloat16), jnp.full((1,), T, jnp.int32), ks[3]]
        if not args.interpret:
            r = record(dict(T=T), "dense_cudnn_causal", jax.jit(
                lambda q, k, v: dense_prefill(q, k, v, implementation="cudnn")), *data[T][:3],
                work=4.0 * D * Hq * T * (T + 1) / 2)
            dense_ms[T] = r.get("ms")
    for tile in args.tiles:
        for T in args.context:
            q, k, v, lengths, key = data[T]
            for bs in [1] + [b for b in args.block_sizes if tile % b == 0]:
                sec = dict(T=T, tile=tile, block_size=bs)
                try:
                    idx, tokens = selection(key, T, Hkv, tile, bs, args.budget, args.min_tokens)
                except Exception as e:  # noqa: BLE001
                    out["records"].append(dict(sec, impl="selection", error=repr(e)[:400]))
                    continue
                work = flops(tokens, tile, Hq, D)
                sec["selected_fraction"] = float(np.sum(tokens * tile)) / (T * (T + 1) / 2)
                kw = dict(work=work, dense_ms=dense_ms.get(T))
                record(dict(sec), f"triton[bs{bs}]", jax.jit(lambda q, k, v, i, l, t=tile, b=bs: gpu.sparse_prefill_gpu(
                    q, k, v, i, l, tile=t, block_size=b, **ik)), q, k, v, idx, lengths, **kw)
                if bs == 1:
                    continue
                for cname, cfg in configs:
                    fn = jax.jit(lambda q, k, v, i, l, t=tile, b=bs, c=cfg: mg.sparse_prefill_mgpu(
                        q, k, v, i, l, tile=t, block_size=b, config=c, **ik))
                    name = f"mosaic[bs{bs}]" if cname == default_name else f"mosaic[bs{bs},{cname}]"
                    record(dict(sec, config=cname), name, fn, q, k, v, idx, lengths, **kw)
                del idx
    del data

    out["seconds"] = time.perf_counter() - t0
    write_json(path, out)
    print(table(out["checks"], ["B", "T", "tile", "block_size", "config", "rel_err", "ok", "seconds", "error"]))
    print(table(out["records"], ["T", "tile", "block_size", "impl", "ms", "tflops", "speedup_vs_dense", "error",
                                 "skipped"]))
    print(f"wrote {path} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
