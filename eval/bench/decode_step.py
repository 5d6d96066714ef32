"""Whole decode step with the KV cache read in place: Llama-3.1-8B shapes, random bf16 weights, on a GPU.

Inside the model's layer scan the KV cache is one stacked array per K and V ([L, B, Hkv, N, D]); a kernel
handed the slice `ck[layer]` (cuDNN, cuBLAS, Pallas) makes XLA copy the layer's whole cache every step. This
benchmark measures what reading it in place buys, end to end.

Run on the GPU machine from the repository root (about 4-5 minutes on an H100; parts past the time budget are
recorded as skipped):

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench decode_step --out /some/dir/

The command is an orchestrator that never touches the GPU itself; it runs, one after another, each in its own
process (so that each sets its own XLA_FLAGS before the backend starts and gets the whole GPU):

  1. "main" (XLA_FLAGS=--xla_gpu_enable_triton_gemm=false: cuBLAS GEMMs decode 1.6x faster here):
     a. kernels, B=8, Hq=32, Hkv=8, D=128, bf16, a stacked cache of L=2 layers, N in {32768, 131072}:
        correctness at N=32768 (odd row lengths) of the in-place split-K dense kernel
        (`pallas_kernels.dense_decode.gpu`, default config and variants) against the f32 reference, and of
        the in-place gathered sparse kernel (`pallas_kernels.sparse_attention.stacked`) against the reference
        on the slice; timing (ms, GB/s of K/V read, fraction of the measured HBM bandwidth) of the dense kernel
        and its variants against XLA's einsum and cuDNN on an already materialised layer, cuDNN on a slice
        taken inside the jitted function (what the model did: the copy included), and the sparse kernel
        (K = 2048 tokens) in place vs on a slice taken inside the function.
     b. the whole decode step (`eval.bench.model.decode_steps`, 16 steps timed after a warm run of 16) at
        context 32K (batch 1, 4, 8) and 100K (batch 1, 4), four attention paths:
          dense_sliced     `pallas_kernels.dense.dense_decode` on `cache.k` (cuDNN on the copied slice; the old path)
          dense_inplace    the registered "dense" method (the in-place split-K kernel on a GPU)
          sparse_sliced    a fixed selection (first 64 + last 1984 tokens, K = 2048) through `sparse_decode` on
                           the slice
          sparse_inplace   the same selection through `attend_selected` (stacked cache + layer, in place)
        with ms/step, tokens/s, GB/s (bytes a step must read / time), and the floors: bytes over the measured
        HBM bandwidth for weights only, and for weights + the K/V the path must read. The compiled HLO is
        searched for copies of a layer's slice (instructions outside fusion bodies whose result has the
        element count of one layer's K/V cache or of a per-layer weight matrix). The new K/V rows each path
        writes are compared with dense_sliced's (a free end-to-end correctness check).
  2. variants of the step at batch 1, context 32K (dense_inplace, sparse_inplace), each in its own process with
     other XLA_FLAGS, to see whether the weight matmuls still copy their layer slices (their step time against
     the weights-only floor, and the copies counted in the HLO): cuBLAS + `--xla_gpu_enable_dynamic_slice_fusion
     =true` (XLA fuses the dynamic slice into the cuBLAS call's address computation), the same with command
     buffers off, and XLA's defaults (Triton GEMM fusions, which can fuse a dynamic slice of an operand).

Writes the JSON named by --out (default ./bench_decode_step.json; the HLO of the 32K batch-1 steps beside it;
device, jax version, date, GIT_COMMIT, flags, every record) and prints
tables last. Options: `--cases 32768:1,100000:4`, `--no-kernels`, `--no-variants`, `--budget-s 290`,
`--steps 16`; `--smoke` runs a tiny model on any backend (plumbing check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

BASE_FLAGS = "--xla_gpu_enable_triton_gemm=false"
VARIANTS = {  # name -> XLA_FLAGS; the first two run by default, all of them with --all-variants
    "cublas+dynamic_slice_fusion": BASE_FLAGS + " --xla_gpu_enable_dynamic_slice_fusion=true",
    "xla_default_triton_gemm": "",
    "cublas+dynamic_slice_fusion+no_command_buffer": (BASE_FLAGS + " --xla_gpu_enable_dynamic_slice_fusion=true"
                                                       " --xla_gpu_enable_command_buffer="),
    "triton_gemm+dynamic_slice_fusion": "--xla_gpu_enable_dynamic_slice_fusion=true",
}
DEFAULT_VARIANTS = 2
DEFAULT_CASES = "32768:1,32768:8,100000:1,32768:4,100000:4"  # in order of priority
PATHS = ("dense_sliced", "dense_inplace", "sparse_sliced", "sparse_inplace")
K_TOKENS, SINKS = 2048, 64
STEPS = 16


# ---------------------------------------------------------------------------------------------------------
# Orchestrator (no jax backend here: every GPU user is a child process).


def _run_child(role: str, flags: str, deadline: float, args, result_path: str, extra: list[str]) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = flags
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # 100K x batch 4: 53 GB of cache + 16 GB weights
    cmd = [sys.executable, "-m", "eval.bench.decode_step", "--role", role, "--deadline", str(deadline),
           "--result", result_path, "--steps", str(args.steps), "--out", args.out, "--shape", args.shape, *extra]
    if args.smoke:
        cmd.append("--smoke")
    timeout = max(10.0, deadline - time.time() + 30.0)
    print(f"# {role}: XLA_FLAGS={flags!r} ({time.time() - T0:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if os.path.exists(result_path):
        with open(result_path) as f:
            out = json.load(f)
    else:
        out = {}
    out["returncode"] = rc
    out["xla_flags"] = flags
    return out


def orchestrate(args) -> int:
    from eval.bench.common import table, write_json  # jax is imported, its backend never started

    deadline = T0 + args.budget_s
    tmp = tempfile.mkdtemp(prefix="bench_decode_step_")
    main_deadline = deadline - (0 if args.no_variants else args.variant_reserve_s)
    extra = ["--cases", args.cases, "--paths", args.paths, "--kernel-budget-s", str(args.kernel_budget_s)]
    extra += ["--no-kernels"] if args.no_kernels else []
    main = _run_child("main", BASE_FLAGS, main_deadline, args, os.path.join(tmp, "main.json"), extra)
    if "refused" in main:  # not a GPU host: no variant runs, no JSON is written
        print(f"jsparse bench decode_step: error: {main['refused']}", file=sys.stderr, flush=True)
        return 2
    variants = []
    if not args.no_variants:
        case = "1024:1" if args.smoke else "32768:1"
        chosen = list(VARIANTS.items())[:None if args.all_variants else DEFAULT_VARIANTS]
        for i, (name, flags) in enumerate(chosen):
            if time.time() > deadline - 20:
                variants.append(dict(variant=name, xla_flags=flags, skipped="time budget"))
                continue
            per = (deadline - time.time()) / (len(chosen) - i)
            res = _run_child("variant", flags, time.time() + per, args, os.path.join(tmp, f"variant{i}.json"),
                             ["--cases", case, "--paths", "dense_inplace,sparse_inplace", "--no-kernels",
                              "--variant-name", name])
            res["variant"] = name
            variants.append(res)

    from eval.bench.common import command_line

    payload = {k: main.get(k) for k in ("device", "platform", "jax", "date", "commit", "measured_hbm_gbs",
                                         "param_bytes", "shape")}
    payload["command"] = command_line()  # the orchestrator's command, not the child's
    payload.update(benchmark="whole decode step, KV cache read in place vs sliced",
                   xla_flags_main=BASE_FLAGS, steps_timed=args.steps, k_tokens=K_TOKENS, sinks=SINKS,
                   kernel_checks=main.get("kernel_checks", []), kernel_records=main.get("kernel_records", []),
                   steps=main.get("steps", []), main_returncode=main.get("returncode"), variants=variants,
                   wall_s=time.time() - T0)
    from eval.bench.common import out_path

    out = out_path(args.out, "bench_decode_step.json")
    write_json(out, payload)

    rows = list(payload["steps"])
    for v in variants:
        for r in v.get("steps", []):
            rows.append(dict(r, variant=v["variant"]))
        if "skipped" in v or not v.get("steps"):
            rows.append(dict(variant=v["variant"], skipped=v.get("skipped", f"rc={v.get('returncode')}")))
    print()
    print(table(payload["kernel_checks"], ["kernel", "N", "config", "rel_err", "ok"]))
    print()
    print(table(payload["kernel_records"], ["kernel", "N", "impl", "ms", "gbs", "hbm_fraction", "skipped",
                                             "error"]))
    print()
    print(f"measured HBM {payload['measured_hbm_gbs']} GB/s; wrote {out} in {time.time() - T0:.0f} s")
    print(table(rows, ["variant", "context", "batch", "path", "ms_per_step", "tokens_per_s", "gbs",
                       "floor_ms", "weights_floor_ms", "of_floor", "kv_slice_copies", "kv_stacked_copies",
                       "weight_slice_copies",
                       "new_kv_rel_err", "skipped", "error"]))
    ok = all(c.get("ok", True) for c in payload["kernel_checks"]) and all(
        r.get("new_kv_ok", True) for r in payload["steps"])
    return 0 if ok and main.get("returncode") == 0 else 1


# ---------------------------------------------------------------------------------------------------------
# Children.


def _left(deadline: float) -> float:
    return deadline - time.time()


def kernel_section(hbm: float, deadline: float, checks: list, records: list, contexts=(32768, 131072),
                   batch: int = 8) -> None:
    """In-place dense and sparse kernels on a stacked cache of 2 layers: correctness (at the first context),
    then timing."""
    import jax
    import jax.numpy as jnp

    from eval.bench.sparse_attention import dense_einsum_decode, poison, rel_err, time_ms
    from pallas_kernels.dense import dense_decode
    from pallas_kernels.dense_decode import gpu as dgpu
    from pallas_kernels.dense_decode.reference import dense_decode_stacked_reference
    from pallas_kernels.sparse_attention import gpu as sgpu
    from pallas_kernels.sparse_attention import reference as sref
    from pallas_kernels.sparse_attention import stacked

    L, B, HQ, HKV, D = 2, batch, 32, 8, 128
    configs = {
        "default": dgpu.DenseDecodeConfig(),
        "bk128": dgpu.DenseDecodeConfig(block_k=128),
        "s2": dgpu.DenseDecodeConfig(num_stages=2),
        "s4": dgpu.DenseDecodeConfig(num_stages=4),
        "w8": dgpu.DenseDecodeConfig(num_warps=8),
        "bk128_w8": dgpu.DenseDecodeConfig(block_k=128, num_warps=8),
        "1024prog": dgpu.DenseDecodeConfig(target_programs=1024),
        "256prog": dgpu.DenseDecodeConfig(target_programs=256),
    }
    layer = jnp.int32(1)

    def attempt(record: dict, fn) -> None:
        """Runs fn() -> dict of results into `record`; an exception (a config that does not compile, out of
        memory) is recorded and the section goes on."""
        if _left(deadline) < 20:
            record["skipped"] = "time budget"
            return
        try:
            record.update(fn())
        except Exception as e:  # noqa: BLE001
            record["error"] = repr(e)[:300]

    for N in contexts:
        if _left(deadline) < 40:
            records.append(dict(kernel="all", N=N, skipped="time budget"))
            continue
        ks = jax.random.split(jax.random.key(N), 4)
        q = jax.random.normal(ks[0], (B, 1, HQ, D), jnp.bfloat16)
        k_all = jax.random.normal(ks[1], (L, B, HKV, N, D), jnp.bfloat16)
        v_all = jax.random.normal(ks[2], (L, B, HKV, N, D), jnp.bfloat16)
        full = jnp.full((B,), N, jnp.int32)
        sel = fixed_indices(full, K_TOKENS, SINKS)
        idx = jnp.broadcast_to(sel[:, None, None, :], (B, HKV, 1, K_TOKENS))
        k1, v1 = k_all[1], v_all[1]  # a materialised layer (the copy is not timed)
        kv_bytes = 2 * B * HKV * N * D * 2
        sel_bytes = 2 * B * HKV * K_TOKENS * D * 2
        dense_fn = {n: jax.jit(lambda q, ka, va, l, lens, c=c: dgpu.dense_decode_stacked_gpu(q, ka, va, l, lens,
                                                                                               config=c))
                    for n, c in configs.items()}
        sparse_inplace = jax.jit(lambda q, ka, va, l, i, lens: stacked.sparse_decode_stacked_gpu(q, ka, va, l, i, lens))
        sparse_slice = jax.jit(lambda q, ka, va, l, i, lens: sgpu.sparse_decode_gpu(q, ka[l], va[l], i, lens))
        cudnn_slice = jax.jit(lambda q, ka, va, l, lens: dense_decode(q, ka[l], va[l], lens))

        if N == contexts[0]:  # correctness on odd, short rows
            lens = (N - 1 - 2 * jax.random.randint(ks[3], (B,), 0, min(3000, N // 4))).astype(jnp.int32)
            want = jax.jit(dense_decode_stacked_reference)(q, k_all, v_all, layer, lens)
            sel_odd = fixed_indices(lens, K_TOKENS, SINKS)
            idx_odd = jnp.broadcast_to(sel_odd[:, None, None, :], (B, HKV, 1, K_TOKENS))
            want_s = jax.jit(sref.sparse_decode_reference)(q, k1, v1, idx_odd, lens)

            def check(fn, args, ref):
                poison()
                e = rel_err(fn(*args), ref)
                return dict(rel_err=e, ok=bool(e <= 2e-2))

            todo = [("dense", f"dense_inplace[{n}]", fn, (q, k_all, v_all, layer, lens), want)
                    for n, fn in dense_fn.items()]
            todo += [("dense", "cudnn[slice] (for context)", cudnn_slice, (q, k_all, v_all, layer, lens), want),
                     ("sparse_gathered", "sparse_inplace", sparse_inplace, (q, k_all, v_all, layer, idx_odd, lens),
                      want_s)]
            for kernel, name, fn, args, ref in todo:
                rec = dict(kernel=kernel, N=N, config=name)
                checks.append(rec)
                attempt(rec, lambda: check(fn, args, ref))
                if "error" in rec or "skipped" in rec:
                    rec["ok"] = False
            del want, want_s

        def timing(fn, args, nbytes):
            ms = time_ms(fn, *args)
            return dict(ms=ms, gbs=nbytes / ms / 1e6, hbm_fraction=nbytes / ms / 1e6 / hbm)

        dense_args = (q, k_all, v_all, layer, full)
        timed = [("dense", "dense_inplace[default]", dense_fn["default"], dense_args, kv_bytes),
                 ("dense", "xla_einsum[materialised]", jax.jit(dense_einsum_decode), (q, k1, v1, full), kv_bytes),
                 ("dense", "cudnn[materialised]", jax.jit(dense_decode), (q, k1, v1, full), kv_bytes),
                 ("dense", "cudnn[slice in jit]", cudnn_slice, dense_args, kv_bytes),
                 ("sparse_gathered", "sparse_inplace", sparse_inplace, (q, k_all, v_all, layer, idx, full), sel_bytes),
                 ("sparse_gathered", "sparse[slice in jit]", sparse_slice, (q, k_all, v_all, layer, idx, full),
                  sel_bytes)]
        timed += [("dense", f"dense_inplace[{n}]", fn, dense_args, kv_bytes) for n, fn in dense_fn.items()
                  if n != "default"]
        for kernel, name, fn, args, nbytes in timed:
            rec = dict(kernel=kernel, N=N, impl=name)
            records.append(rec)
            attempt(rec, lambda: timing(fn, args, nbytes))
        del q, k_all, v_all, k1, v1, dense_args, timed
        print(f"# kernels N={N} done ({time.time() - T0:.0f} s)", flush=True)


def fixed_indices(lengths, k_tokens: int, sinks: int):
    """int32[B, k_tokens]: the first `sinks` tokens and the last k_tokens - sinks visible ones, ascending, -1
    where the two windows overlap (rows shorter than k_tokens)."""
    import jax.numpy as jnp

    first = jnp.broadcast_to(jnp.arange(sinks, dtype=jnp.int32), (lengths.shape[0], sinks))
    last = lengths.astype(jnp.int32)[:, None] - (k_tokens - sinks) + jnp.arange(k_tokens - sinks, dtype=jnp.int32)
    first = jnp.where(first < lengths[:, None], first, -1)
    last = jnp.where(last >= sinks, last, -1)
    return jnp.concatenate([first, last], axis=1)


def make_methods(k_tokens: int, sinks: int) -> dict:
    """The four attention paths as method objects (flax struct dataclasses; see the module docstring)."""
    import jax.numpy as jnp
    from flax import struct

    from jsparse.methods import make_method
    from jsparse.methods.common import attend_selected
    from pallas_kernels.dense import dense_decode
    from pallas_kernels.sparse_attention import sparse_decode

    @struct.dataclass
    class SlicedDense:
        """Dense decode on the layer's slice (`cache.k`): cuDNN on a GPU; XLA copies the slice."""

        def init_state(self, cfg, batch, max_len):
            return None

        def layer_info(self, cfg):
            return None

        def decode(self, ctx, q, cache, state):
            return dense_decode(q, cache.k, cache.v, ctx.lengths), state

    @struct.dataclass
    class FixedSelection:
        """Every layer attends to the first `sinks` and the last `k_tokens - sinks` tokens (decode only)."""

        k_tokens: int = struct.field(pytree_node=False, default=2048)
        sinks: int = struct.field(pytree_node=False, default=64)
        in_place: bool = struct.field(pytree_node=False, default=True)

        def init_state(self, cfg, batch, max_len):
            return None

        def layer_info(self, cfg):
            return None

        def decode(self, ctx, q, cache, state):
            B, T = q.shape[:2]
            if T != 1:
                raise ValueError(f"FixedSelection decodes one token per step; got T={T}")
            hkv = cache.k.shape[1]  # a static shape: reading it uses nothing
            sel = fixed_indices(ctx.lengths, self.k_tokens, self.sinks)
            idx = jnp.broadcast_to(sel[:, None, None, :], (B, hkv, 1, self.k_tokens))
            if self.in_place:
                return attend_selected(q, cache, idx, ctx.lengths), state
            return sparse_decode(q, cache.k, cache.v, idx, ctx.lengths), state

    return {"dense_sliced": SlicedDense(), "dense_inplace": make_method("dense"),
            "sparse_sliced": FixedSelection(k_tokens, sinks, in_place=False),
            "sparse_inplace": FixedSelection(k_tokens, sinks, in_place=True)}


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def slice_copies(hlo: str, targets: dict[str, set[int]]) -> dict[str, int]:
    """Counts instructions that produce a copy of a layer's slice in optimised HLO text.

    An instruction counts when it lies outside every fusion body, is a dynamic-slice / slice / copy or a fusion
    whose name or op_name mentions a slice, and its bf16 result has the element count of one of `targets`
    (name -> element counts).
    """
    fused = set(_CALLS.findall("\n".join(l for l in hlo.splitlines() if " fusion(" in l)))
    counts = {name: 0 for name in targets}
    comp = None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            comp = m.group(1)
            continue
        if comp in fused:
            continue
        m = _INSTR.match(line)
        if not m or m.group(2) != "bf16" or m.group(4) not in ("fusion", "dynamic-slice", "slice", "copy"):
            continue
        if m.group(4) == "fusion" and "slice" not in m.group(1) and not re.search(r'op_name="[^"]*slice', line):
            continue
        numel = 1
        for d in filter(None, m.group(3).split(",")):
            numel *= int(d)
        for name, sizes in targets.items():
            if numel in sizes:
                counts[name] += 1
    return counts


def step_section(args, hbm: float, deadline: float, out: dict) -> None:
    """Whole decode steps for each case and path (module docstring, 1b)."""
    import jax
    import jax.numpy as jnp

    from eval.bench.model import bench_params, decode_bytes, decode_steps, filled_cache, param_bytes
    from models.config import ModelConfig
    from models.generate import round_up
    from models.presets import preset

    if args.smoke:
        cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                          num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
        k_tokens, sinks = 128, 16
    else:
        cfg = preset(args.shape)
        k_tokens, sinks = K_TOKENS, SINKS
    params = bench_params(cfg)
    out["param_bytes"] = param_bytes(params)
    out["shape"] = dataclasses.asdict(cfg) if args.smoke else args.shape
    methods = make_methods(k_tokens, sinks)
    paths = parse_paths(args.paths)
    weight_numels = {x.size // cfg.num_layers for x in jax.tree_util.tree_leaves(params.layers)
                     if x.ndim >= 3 or (x.ndim == 2 and x.shape[1] > 8192)}
    rows = out.setdefault("steps", [])
    for context, batch in parse_cases(args.cases):
        capacity = round_up(context + args.steps + 1, 256)
        kv_layer = batch * cfg.num_kv_heads * capacity * cfg.head_dim
        targets = {"kv": {kv_layer}, "kv_stacked": {cfg.num_layers * kv_layer}, "weights": weight_numels}
        cache = None
        new_kv = {}
        for path in paths:
            row = dict(context=context, batch=batch, path=path, variant=args.variant_name)
            rows.append(row)
            if _left(deadline) < 25:
                row["skipped"] = "time budget"
                continue
            try:
                if cache is None:
                    cache = filled_cache(cfg, batch, context, capacity, jnp.bfloat16)
                method = methods[path]
                tok = jnp.zeros((batch, 1), jnp.int32)
                t0 = time.perf_counter()
                compiled = decode_steps.lower(params, method, tok, cache, cfg=cfg, steps=args.steps).compile()
                row["compile_s"] = time.perf_counter() - t0
                hlo = compiled.as_text()
                copies = slice_copies(hlo, targets)
                row["kv_slice_copies"], row["weight_slice_copies"] = copies["kv"], copies["weights"]
                row["kv_stacked_copies"] = copies["kv_stacked"]
                row["dynamic_slice_fusions"] = len(re.findall(r"dynamic_address_computation|dynamic_slice_fusion",
                                                              hlo))
                if context == 32768 and batch == 1:  # the HLO beside the JSON
                    name = f"hlo_{args.variant_name or 'main'}_{path}.txt".replace("+", "_")
                    folder = os.path.dirname(out_path(args.out, "bench_decode_step.json"))
                    with open(os.path.join(folder, name), "w") as f:
                        f.write(hlo)
                tok, cache = compiled(params, method, tok, cache)  # warm run from the filled state
                jax.block_until_ready(tok)
                new_kv[path] = (cache.k[:, :, :, context:context + args.steps], cache.v[:, :, :, context:context + args.steps])
                cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
                t0 = time.perf_counter()
                tok, cache = compiled(params, method, tok, cache)
                jax.block_until_ready(tok)
                ms = (time.perf_counter() - t0) * 1e3 / args.steps
                cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
                kv_tokens = context + args.steps // 2 if path.startswith("dense") else k_tokens
                nbytes = decode_bytes(cfg, params, batch, kv_tokens)
                wbytes = decode_bytes(cfg, params, batch, 0)
                floor = nbytes / (hbm * 1e9) * 1e3
                row.update(ms_per_step=ms, tokens_per_s=batch / (ms * 1e-3), gbs=nbytes / (ms * 1e-3) / 1e9,
                           bytes_per_step=nbytes, floor_ms=floor, weights_floor_ms=wbytes / (hbm * 1e9) * 1e3,
                           of_floor=floor / ms)
                ref_path = "dense_sliced" if path.startswith("dense") else "sparse_sliced"
                if ref_path in new_kv and ref_path != path:
                    row["new_kv_rel_err"] = _rel(new_kv[path], new_kv[ref_path])
                    row["new_kv_first_step_rel_err"] = _rel(tuple(x[..., :1, :] for x in new_kv[path]),
                                                            tuple(x[..., :1, :] for x in new_kv[ref_path]))
                    row["new_kv_ok"] = bool(row["new_kv_first_step_rel_err"] <= 5e-2)
            except Exception as e:  # noqa: BLE001 - record (out of memory included) and go on
                row["error"] = repr(e)[:300]
                cache = None
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del cache, new_kv


def _rel(a, b) -> float:
    import jax.numpy as jnp
    import numpy as np

    num = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(a, b))
    den = max(float(jnp.max(jnp.abs(y.astype(jnp.float32)))) for y in b)
    return float(num / max(den, 1e-30)) if np.isfinite(num) else float("inf")


def child(args) -> int:
    import jax

    from eval.bench import common as bm

    if not args.smoke:  # the first child says it, and the orchestrator stops (it starts no backend itself)
        try:
            bm.require_gpu("decode_step", "--smoke")
        except ValueError as e:
            with open(args.result, "w") as f:
                json.dump({"refused": str(e)}, f)
            return 2
    out = dict(bm.device_facts())
    out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    hbm = bm.measure_hbm_gbs(64 << 20) if args.smoke else bm.measure_hbm_gbs()
    out["measured_hbm_gbs"] = hbm
    out["kernel_checks"], out["kernel_records"] = [], []

    def save():
        with open(args.result, "w") as f:
            json.dump(out, f, indent=1)

    save()
    if args.role == "main" and not args.no_kernels and jax.default_backend() == "gpu" and not args.smoke:
        try:
            kernel_section(hbm, min(time.time() + args.kernel_budget_s, args.deadline), out["kernel_checks"],
                           out["kernel_records"])
        except Exception as e:  # noqa: BLE001
            out["kernel_records"].append(dict(kernel="section", error=repr(e)[:300]))
        save()
    try:
        step_section(args, hbm, args.deadline, out)
    finally:
        save()
    return 0


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'32768:1,100000:4' -> [(32768, 1), (100000, 4)] (context:batch, each positive); ValueError naming the case."""
    cases = []
    for case in (c.strip() for c in text.split(",") if c.strip()):
        parts = case.split(":")
        if len(parts) != 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
            raise ValueError(f"--cases: {case!r} is not a case: expected context:batch, two positive integers "
                             "(e.g. 32768:1)")
        cases.append((int(parts[0]), int(parts[1])))
    if not cases:
        raise ValueError(f"--cases {text!r}: expected one or more context:batch cases")
    return cases


def parse_paths(text: str) -> list[str]:
    """'dense_inplace,sparse_inplace' -> the attention paths of PATHS; ValueError naming one that is not."""
    paths = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"--paths {text!r}: {f'unknown {unknown}; ' if unknown else ''}expected some of {list(PATHS)}")
    return paths


def main(argv=None, prog=None) -> int:
    from eval.bench.common import add_out_argument, check_contexts, out_path, positive_int, shape_preset

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b", help="model shape preset")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated context:batch cases, by priority")
    p.add_argument("--paths", default=",".join(PATHS), help=f"attention paths, some of {PATHS}")
    p.add_argument("--steps", type=positive_int, default=STEPS, help="decode steps per timing")
    p.add_argument("--budget-s", type=float, default=290.0, help="wall-clock budget of the whole run")
    p.add_argument("--variant-reserve-s", type=float, default=80.0, help="part of the budget kept for variants")
    p.add_argument("--kernel-budget-s", type=float, default=75.0, help="most seconds of the kernel section")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel section")
    p.add_argument("--no-variants", action="store_true", help="skip the XLA-flag variants")
    p.add_argument("--all-variants", action="store_true", help=f"run all of {list(VARIANTS)}")
    p.add_argument("--smoke", action="store_true", help="tiny model, small contexts (plumbing check; any backend)")
    p.add_argument("--role", default="orchestrate", choices=("orchestrate", "main", "variant"), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--variant-name", default="", help=argparse.SUPPRESS)
    add_out_argument(p, "bench_decode_step.json")
    args = p.parse_args(argv)
    if args.smoke and args.cases == DEFAULT_CASES:
        args.cases = "1024:1,2048:2"
    if args.role == "orchestrate":  # the arguments checked here, not in every child
        try:
            cfg = shape_preset(args.shape)
            cases = parse_cases(args.cases)
            parse_paths(args.paths)
            if not args.smoke:
                check_contexts("--cases", [c for c, _ in cases], cfg, args.shape)
            out_path(args.out, "bench_decode_step.json")
        except ValueError as e:
            p.error(str(e))
        return orchestrate(args)
    return child(args)


T0 = time.time()

if __name__ == "__main__":
    sys.exit(main())
