"""GPU check and timing of the fused anchor variants (Kascade's anchor layers), against the in-place dense decode.

  jsparse bench anchor_variants [--out PATH] [--quick]

1. Compiled checks (small shapes) of every variant against the jnp reference: anchor_decode_gpu with
   AnchorConfig.pool "xla" / "triton", diagonal_tile 0 / 32, sparse and dense anchors, one layer of a stacked
   cache read in place (with_output=False too); anchor_prefill_gpu (default and TUNED_H100 scoring configs,
   the dense anchor with cuDNN's lse). A selection is valid when it keeps the right count and no unchosen key
   outscores a chosen one by more than 1e-3 (bf16 inputs, f32 scores); the output is compared with the
   reference attention over the implementation's own selection.
2. Decode timing at B 8, N 131072, Hq 32, Hkv 8, D 128, bf16, budget 0.1 (cache stacked [1, B, Hkv, N, D] and
   read in place, as inside the model): the in-place Pallas dense decode (pallas_kernels.dense_decode), each
   anchor variant, its scoring part (logits pass + pooling) and the pooling alone.
3. Prefill timing at T 32768, B 1, tile 128: cuDNN causal attention, the lse and pooling passes per config,
   the sparse anchor and the dense anchor (cuDNN lse vs the lse pass).

Writes the JSON named by --out (default ./anchor_variants.json) (device facts, checks, records) and prints a table last. About 1.5 minutes
on an H100 (compiles dominate).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from eval.bench import common as bm  # noqa: E402
from pallas_kernels.anchor_attention import gpu, gpu_prefill  # noqa: E402
from pallas_kernels.anchor_attention import reference as ref  # noqa: E402
from pallas_kernels.anchor_attention.common import budget_count, positions, tile_counts  # noqa: E402
from pallas_kernels.sparse_attention.reference import sparse_decode_reference, sparse_prefill_reference  # noqa: E402

HQ, HKV, D = 32, 8, 128
BUDGET = 0.1

DECODE_VARIANTS = {  # name -> (AnchorConfig, diagonal_tile)
    "pool_xla": (gpu.AnchorConfig(pool="xla"), 0),
    "pool_triton": (gpu.AnchorConfig(pool="triton"), 0),
    "pool_triton_b4096_w8": (gpu.AnchorConfig(pool="triton", pool_block=4096, pool_warps=8), 0),
    "pool_xla_diag32": (gpu.AnchorConfig(pool="xla"), 32),
    "pool_triton_diag32": (gpu.AnchorConfig(pool="triton"), 32),
}
PREFILL_CONFIGS = {"default": gpu_prefill.PrefillScoresConfig(), "tuned_h100": gpu_prefill.TUNED_H100}


def _rand(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _selection_stats(idx, scores, kk):
    """(max count mismatch, max gap: best unchosen score - worst chosen score, 0 when valid)."""
    idx, scores = np.asarray(idx), np.asarray(scores, np.float64)
    kk = np.broadcast_to(np.asarray(kk), idx.shape[:-1])
    mism, gap = 0, 0.0
    for row in np.ndindex(idx.shape[:-1]):
        chosen = idx[row][idx[row] >= 0]
        s = scores[row]
        mism = max(mism, abs(len(chosen) - min(int(kk[row]), int(np.sum(s > -np.inf)))))
        if len(chosen) and len(chosen) < s.shape[0]:
            rest = np.ones(s.shape[0], bool)
            rest[chosen] = False
            worst = np.min(s[chosen])
            best_rest = np.max(s[rest])
            if np.isfinite(best_rest) and np.isfinite(worst):
                gap = max(gap, float(best_rest - worst))
            elif best_rest == np.inf and worst < np.inf:
                gap = np.inf
    return mism, gap


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(1e-6, float(np.max(np.abs(want)))))


def check_decode(checks):
    B, N, L = 2, 8192, 2
    ks = jax.random.split(jax.random.key(0), 3)
    q = _rand(ks[0], (B, 1, HQ, D))
    k_all, v_all = _rand(ks[1], (L, B, HKV, N, D)), _rand(ks[2], (L, B, HKV, N, D))
    lengths = jnp.array([N, 5001], jnp.int32)
    layer = jnp.int32(1)
    k, v = k_all[1], v_all[1]
    pos = positions(lengths, 1)
    kk = budget_count(BUDGET, pos + 1, 128)[:, None, :]
    for name, (cfg, dt) in DECODE_VARIANTS.items():
        scores = ref.decode_scores_reference(q, k, lengths, diagonal_tile=dt)
        for dense in ((False, True) if name in ("pool_xla", "pool_triton") else (False,)):
            try:
                f = jax.jit(lambda q, ka, va, l, cfg=cfg, dt=dt, dense=dense: gpu.anchor_decode_gpu(
                    q, ka, va, l, layer=layer, budget=BUDGET, diagonal_tile=dt, dense_output=dense, config=cfg))
                out, idx = f(q, k_all, v_all, lengths)
                want = (ref.anchor_decode_reference(q, k, v, lengths, budget=BUDGET, dense_output=True)[0] if dense
                        else sparse_decode_reference(q, k, v, idx, lengths))
                mism, gap = _selection_stats(idx, scores, kk)
                err = _rel_err(out, want)
                _, want_idx = ref.anchor_decode_reference(q, k, v, lengths, budget=BUDGET, diagonal_tile=dt)
                same = float(np.mean(np.all(np.asarray(idx) == np.asarray(want_idx), axis=-1)))
                ok = mism == 0 and gap <= 1e-3 and err <= 2e-2
                checks.append(dict(what="anchor_decode", variant=name, dense_output=dense, B=B, N=N,
                                   count_mismatch=mism, selection_gap=gap, out_rel_err=err,
                                   rows_equal_to_reference=same, ok=bool(ok)))
            except Exception as e:  # noqa: BLE001  (recorded, counted as a failure)
                checks.append(dict(what="anchor_decode", variant=name, dense_output=dense, error=repr(e)[:400],
                                   ok=False))
    try:  # indices only (Kascade's T > 1 rows), T = 3
        q3 = _rand(ks[0], (B, 3, HQ, D))
        out, idx = jax.jit(lambda *a: gpu.anchor_decode_gpu(*a, layer=layer, budget=BUDGET, diagonal_tile=32,
                                                            with_output=False,
                                                            config=gpu.AnchorConfig(pool="triton")))(
            q3, k_all, v_all, lengths)
        kk3 = budget_count(BUDGET, positions(lengths, 3) + 1, 128)[:, None, :]
        mism, gap = _selection_stats(idx, ref.decode_scores_reference(q3, k, lengths, diagonal_tile=32), kk3)
        checks.append(dict(what="anchor_decode_indices_T3", variant="pool_triton_diag32", count_mismatch=mism,
                           selection_gap=gap, ok=bool(out is None and mism == 0 and gap <= 1e-3)))
    except Exception as e:  # noqa: BLE001
        checks.append(dict(what="anchor_decode_indices_T3", error=repr(e)[:400], ok=False))


def check_prefill(checks):
    B, T, tile = 1, 2048, 128
    ks = jax.random.split(jax.random.key(1), 3)
    q = _rand(ks[0], (B, T, HQ, D))
    k, v = _rand(ks[1], (B, T, HKV, D)), _rand(ks[2], (B, T, HKV, D))
    lengths = jnp.array([T], jnp.int32)
    scores = ref.tile_scores_reference(q, k, tile=tile)
    kk = tile_counts(BUDGET, T, tile, 128)[None, None, :]
    for name, cfg in PREFILL_CONFIGS.items():
        for dense, dense_lse in ((False, False), (True, False), (True, True)):
            if dense and name != "default":
                continue
            try:
                out, idx = jax.jit(lambda *a, cfg=cfg, dense=dense, dl=dense_lse: gpu_prefill.anchor_prefill_gpu(
                    *a, tile=tile, budget=BUDGET, dense_output=dense, dense_lse=dl, config=cfg))(q, k, v, lengths)
                want = (jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla") if dense
                        else sparse_prefill_reference(q, k, v, idx, lengths, tile=tile))
                mism, gap = _selection_stats(idx, scores, kk)
                err = _rel_err(out, want)
                checks.append(dict(what="anchor_prefill", config=name, dense_output=dense, dense_lse=dense_lse,
                                   T=T, tile=tile, count_mismatch=mism, selection_gap=gap, out_rel_err=err,
                                   ok=bool(mism == 0 and gap <= 1e-3 and err <= 2e-2)))
            except Exception as e:  # noqa: BLE001
                checks.append(dict(what="anchor_prefill", config=name, dense_output=dense, dense_lse=dense_lse,
                                   error=repr(e)[:400], ok=False))


def time_decode(records, N):
    from pallas_kernels.dense_decode import gpu as dense_gpu

    B = 8
    ks = jax.random.split(jax.random.key(2), 3)
    q = _rand(ks[0], (B, 1, HQ, D))
    k_all, v_all = _rand(ks[1], (1, B, HKV, N, D)), _rand(ks[2], (1, B, HKV, N, D))
    lengths = jnp.full((B,), N, jnp.int32)
    layer = jnp.int32(0)
    kv_bytes = 2 * k_all.size * k_all.dtype.itemsize
    K = budget_count(BUDGET, N, 128)

    def add(name, fn, *args, nbytes=None, **meta):
        try:
            ms = bm.time_ms(jax.jit(fn), *args)
            rec = dict(phase="decode", B=B, N=N, impl=name, ms=ms, **meta)
            if nbytes:
                rec["gbs"] = nbytes / (ms * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001
            rec = dict(phase="decode", B=B, N=N, impl=name, error=repr(e)[:400], **meta)
        records.append(rec)
        print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in rec.items()}, flush=True)
        return rec

    dense = add("dense_decode_inplace", lambda q, ka, va, l: dense_gpu.dense_decode_stacked_gpu(q, ka, va, layer, l),
                q, k_all, v_all, lengths, nbytes=kv_bytes)
    pos = positions(lengths, 1)
    for name, (cfg, dt) in DECODE_VARIANTS.items():
        add(f"anchor[{name}]", lambda q, ka, va, l, cfg=cfg, dt=dt: gpu.anchor_decode_gpu(
            q, ka, va, l, layer=layer, budget=BUDGET, diagonal_tile=dt, config=cfg), q, k_all, v_all, lengths,
            part="anchor", K=K)
        if dt:
            continue
        add(f"scores[{name}]", lambda q, ka, va, l, cfg=cfg: gpu.decode_scores_gpu(
            q, ka, va, l, layer=layer, config=cfg)[0], q, k_all, v_all, lengths, part="scores",
            nbytes=kv_bytes // 2)
        add(f"anchor_dense[{name}]", lambda q, ka, va, l, cfg=cfg: gpu.anchor_decode_gpu(
            q, ka, va, l, layer=layer, budget=BUDGET, dense_output=True, config=cfg), q, k_all, v_all, lengths,
            part="dense_anchor", nbytes=kv_bytes)
    # The pooling alone, from fixed logits and lse.
    G = HQ // HKV
    logits = jax.random.normal(jax.random.key(3), (B, HKV, 1, G, N), jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    from pallas_kernels.anchor_attention.common import pool_scores
    pool_bytes = logits.size * 4 + B * HKV * N * 4
    add("pool_only[xla]", lambda lg, ls, p: pool_scores(lg, ls, p), logits, lse, pos, part="pool",
        nbytes=pool_bytes)
    for pb, w in ((2048, 4), (4096, 8)):
        cfg = gpu.AnchorConfig(pool="triton", pool_block=pb, pool_warps=w)
        add(f"pool_only[triton_b{pb}_w{w}]", lambda lg, ls, p, cfg=cfg: gpu.pool_gpu(  # lse as one split's partials
            lg, ls[None], jnp.ones_like(ls)[None], p, config=cfg), logits, lse, pos, part="pool", nbytes=pool_bytes)
    for r in records:
        if r.get("phase") == "decode" and r.get("N") == N and "ms" in r and "ms" in dense:
            r["ratio_to_dense"] = r["ms"] / dense["ms"]


def time_prefill(records, T):
    B, tile = 1, 128
    ks = jax.random.split(jax.random.key(4), 3)
    q = _rand(ks[0], (B, T, HQ, D))
    k, v = _rand(ks[1], (B, T, HKV, D)), _rand(ks[2], (B, T, HKV, D))
    lengths = jnp.array([T], jnp.int32)
    qk_flops = 2 * D * HQ * B * T * (T + 1) / 2
    nt = T // tile
    pool_flops = 2 * D * HQ * B * tile * tile * nt * (nt - 1) / 2

    def add(name, fn, *args, flops=None, **meta):
        try:
            ms = bm.time_ms(jax.jit(fn), *args, warmup=2, iters=5)
            rec = dict(phase="prefill", B=B, T=T, tile=tile, impl=name, ms=ms, **meta)
            if flops:
                rec["tflops"] = flops / (ms * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001
            rec = dict(phase="prefill", B=B, T=T, tile=tile, impl=name, error=repr(e)[:400], **meta)
        records.append(rec)
        print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in rec.items()}, flush=True)
        return rec

    dense = add("dense_cudnn_causal", lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"), q, k, v, flops=2 * qk_flops)
    lse = jax.jit(gpu_prefill.prefill_lse_gpu)(q, k)
    for name, cfg in PREFILL_CONFIGS.items():
        add(f"lse_pass[{name}]", lambda q, k, cfg=cfg: gpu_prefill.prefill_lse_gpu(q, k, config=cfg), q, k,
            flops=qk_flops, part="scores")
        add(f"pool_pass[{name}]", lambda q, k, l, cfg=cfg: gpu_prefill.tile_scores_gpu(
            q, k, tile=tile, lse=l, config=cfg), q, k, lse, flops=pool_flops, part="scores")
        add(f"anchor_prefill[{name}]", lambda q, k, v, l, cfg=cfg: gpu_prefill.anchor_prefill_gpu(
            q, k, v, l, tile=tile, budget=BUDGET, config=cfg), q, k, v, lengths, part="anchor")
        add(f"anchor_prefill_dense_cudnn_lse[{name}]", lambda q, k, v, l, cfg=cfg: gpu_prefill.anchor_prefill_gpu(
            q, k, v, l, tile=tile, budget=BUDGET, dense_output=True, dense_lse=True, config=cfg), q, k, v, lengths,
            part="dense_anchor")
    add("anchor_prefill_dense_lse_pass[default]", lambda q, k, v, l: gpu_prefill.anchor_prefill_gpu(
        q, k, v, l, tile=tile, budget=BUDGET, dense_output=True), q, k, v, lengths, part="dense_anchor")
    for r in records:
        if r.get("phase") == "prefill" and "ms" in r and "ms" in dense:
            r["ratio_to_dense"] = r["ms"] / dense["ms"]


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    bm.add_out_argument(p, "anchor_variants.json")
    p.add_argument("--quick", action="store_true", help="N 32768 and T 8192 instead of 131072 and 32768")
    args = p.parse_args(argv)
    try:
        bm.require_gpu("anchor_variants")
        path = bm.out_path(args.out, "anchor_variants.json")  # before the run: a bad --out ends none
    except ValueError as e:
        p.error(str(e))
    t0 = time.time()
    checks, records = [], []
    check_decode(checks)
    check_prefill(checks)
    for c in checks:
        print(c, flush=True)
    time_decode(records, 32768 if args.quick else 131072)
    time_prefill(records, 8192 if args.quick else 32768)
    payload = dict(bm.device_facts(), benchmark="anchor_variants",
                   xla_flags=os.environ.get("XLA_FLAGS", ""), shape=dict(Hq=HQ, Hkv=HKV, D=D, dtype="bfloat16",
                                                                         budget=BUDGET),
                   checks=checks, records=records, wall_s=time.time() - t0)
    bm.write_json(path, payload)
    failed = [c for c in checks if not c.get("ok")]
    print(f"\nwrote {path}; checks: {len(checks) - len(failed)}/{len(checks)} ok; {time.time() - t0:.0f} s")
    print(bm.table(records, ["phase", "N", "T", "impl", "ms", "ratio_to_dense", "gbs", "tflops"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
