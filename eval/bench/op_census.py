"""The ops of a method's decode step, layer scan by layer scan, traced without a device: where each layer's small
kernels come from, before a GPU profile.

A decode step runs its layers in scans (`models.llama._scan_layers`; a method may split them into runs of one kind,
`segments`), and every op a layer's body holds runs once per layer. This traces the step of `jsparse bench model`
(`eval.bench.model.method_decode_steps`, the method built as there, weights and cache as shapes only, so a
Llama-3.1-8B shape at 100K traces in seconds on a laptop) and lists each scan: its trip count (layers), its ops by
primitive, and the Pallas kernels it calls. With `--gpu-paths` (the default) the step is traced as a GPU would trace it
(`jax.default_backend()` answers "gpu" while tracing), so the methods take their GPU code paths: the Pallas kernels
and the XLA ops around them. Nothing is compiled or run.

    jsparse bench op_census --method evosparse --context 100000 --batch 4
    jsparse bench op_census --method kascade --shape qwen3-8b --verbose --out census.json

After the scans it lists the XLA ops that read or write at least `--large-mb` MiB outside the Pallas kernels and GEMMs
(`large_ops`): each is a pass over a whole array, such as the masked copy of H2O's every-layer scores that its top-k
made at batch 1 until its kernels read the span in place (63 us a step on an H100).

Read it as a count of jaxpr equations, not of GPU kernels: XLA fuses several elementwise ops into one kernel, and
reshapes cost nothing. An op on a few scalars per row in a layer body is still one small kernel per layer on a GPU
(about 1-2 us each on an H100; `eval/results/h100/profile_b1/`); the census finds them, a profile
(`jsparse bench profile_decode_step`) times them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math

import jax
import jax.numpy as jnp

from eval.bench.common import (add_out_argument, check_budget, check_contexts, device_facts, out_path, shape_preset,
                               write_json)

# Primitives whose bodies belong to the caller's body (followed); a scan's body is a census row of its own.
INLINE = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          "remat", "checkpoint")


@contextlib.contextmanager
def gpu_paths(on: bool = True):
    """While tracing: `jax.default_backend()` answers "gpu" (the methods' and kernels' dispatch reads it at trace
    time), so the GPU code paths are traced on any host. Restored on exit."""
    real = jax.default_backend
    if on:
        jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            inner = getattr(item, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner
            elif inner is not None and hasattr(inner, "jaxpr"):
                yield inner.jaxpr
            elif hasattr(item, "eqns"):
                yield item


def _flat(jaxpr) -> list:
    """The equations of `jaxpr`, the bodies of INLINE calls spliced in (a scan, while or cond stays one)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in INLINE:
            for inner in _sub_jaxprs(eqn):
                out += _flat(inner)
        else:
            out.append(eqn)
    return out


def _kernel_name(eqn) -> str:
    info = eqn.params.get("name_and_src_info")
    return getattr(info, "name", None) or str(eqn.params.get("name", "pallas_call"))


def _walk(jaxpr, path: str = "", times: int = 1):
    """(eqn, path, times) of every equation of `jaxpr`, INLINE calls spliced in, each scan, while or cond followed by
    its body (path: the scans, while loops and conditionals on the way; times: the trip counts of the enclosing
    scans multiplied, how often a step runs the equation)."""
    for eqn in _flat(jaxpr):
        yield eqn, path, times
        name = eqn.primitive.name
        if name == "scan":
            yield from _walk(eqn.params["jaxpr"].jaxpr, path + "scan/", times * int(eqn.params["length"]))
        elif name in ("while", "cond"):
            for inner in _sub_jaxprs(eqn):
                yield from _walk(inner, path + name + "/", times)


def census(jaxpr, path: str = "", verbose: bool = False) -> list[dict]:
    """One dict per scan found in `jaxpr` (nested scans after their parent, the path naming the while loops and
    conditionals on the way): length, ops (primitive -> count), eqns (their total), kernels (the Pallas calls by
    name, in order) and, with verbose, every op with its output shapes."""
    rows = []
    for eqn, where, _ in _walk(jaxpr, path):
        if eqn.primitive.name != "scan":
            continue
        eqns = _flat(eqn.params["jaxpr"].jaxpr)
        row = {"path": where, "length": int(eqn.params["length"]), "eqns": len(eqns),
               "ops": dict(collections.Counter(e.primitive.name for e in eqns).most_common()),
               "kernels": [_kernel_name(e) for e in eqns if e.primitive.name == "pallas_call"]}
        if verbose:
            row["body"] = [f"{e.primitive.name}{[tuple(v.aval.shape) for v in e.outvars]}" for e in eqns]
        rows.append(row)
    return rows


# Ops that move no data of their own (views, index math, fused into their consumer) or update a buffer in place, and
# the kernels and GEMMs, which `large_ops` leaves out: what remains over large arrays is an XLA pass of its own.
NOT_PASSES = INLINE + ("scan", "while", "cond", "pallas_call", "dot_general", "reshape", "squeeze", "broadcast_in_dim",
                       "iota", "dynamic_slice", "dynamic_update_slice", "scatter", "scatter-add", "scatter_add",
                       "copy_p", "empty")  # empty: an allocation (`lax.empty`; no fill on a GPU)
PICKS = ("gather", "slice")


def _nbytes(aval) -> int:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    return 0 if shape is None or dtype is None else math.prod(shape) * jnp.dtype(dtype).itemsize


def large_ops(jaxpr, min_bytes: int, path: str = "", times: int = 1) -> list[dict]:
    """The XLA ops of a step that read or write at least `min_bytes` (the largest of their operands and results; of a
    gather or slice, its result), outside the Pallas kernels and GEMMs and leaving out `NOT_PASSES`: each a pass over
    a large array that runs as an XLA kernel of its own (or inside a fusion that still reads it), such as a masked
    copy of a score array before a kernel that could read it in place. One dict per op: path, op, shape (its largest
    result), bytes, and per_step (the trip counts of its enclosing scans multiplied: how often a step runs it)."""
    rows = []
    for eqn, where, per_step in _walk(jaxpr, path, times):
        name = eqn.primitive.name
        if name in NOT_PASSES:  # the scans, while loops and conditionals too: their bodies are walked
            continue
        # A gather or slice reads what it writes (the rows it picks), whatever the size of the array it picks from.
        read = [] if name in PICKS else [_nbytes(v.aval) for v in eqn.invars]
        big = max(read + [_nbytes(v.aval) for v in eqn.outvars], default=0)
        if big >= min_bytes:
            out = max(eqn.outvars, key=lambda v: _nbytes(v.aval))
            rows.append({"path": where or "-", "op": name, "shape": list(out.aval.shape), "bytes": big,
                         "per_step": per_step})
    return rows


def trace_step(method_name: str, shape: str, batch: int, context: int, budget: float, *, gpu: bool = True,
               options: dict | None = None):
    """(closed jaxpr, cfg) of one decode step of `jsparse bench model` (`method_decode_steps`, steps=1) for the
    method as that benchmark builds it (options: its method options, as `--method-option`), weights, cache and
    state as shapes only (the cache sized as the benchmark sizes it for `context`); with gpu, traced on the GPU
    paths."""
    from eval.bench import model as bm
    from models.cache import KVCache

    cfg = bm.preset(shape)
    with gpu_paths(gpu):
        params = jax.eval_shape(lambda: bm.bench_params(cfg, dtype=jnp.bfloat16))
        method, _ = bm.bench_method(method_name, cfg, budget, options=options)
        cap = bm.decode_capacity(context)  # as `jsparse bench model` sizes its cache for its 16 steps
        kv = jax.ShapeDtypeStruct((cfg.num_layers, batch, cfg.num_kv_heads, cap, cfg.head_dim), jnp.bfloat16)
        cache = KVCache(k=kv, v=kv, lengths=jax.ShapeDtypeStruct((batch,), jnp.int32))
        state = jax.eval_shape(lambda: method.init_state(cfg, batch, cap))
        tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
        traced = bm.method_decode_steps.trace(params, method, tok, cache, state, cfg=cfg, steps=1)
    return traced.jaxpr, cfg


def main(argv=None, prog: str = "jsparse bench op_census") -> int:
    from eval.bench.model import METHODS, unread_budget

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", required=True, choices=METHODS,
                   help="the method whose decode step is traced, built as `jsparse bench model` builds it")
    p.add_argument("--shape", default="llama3-8b", help="model shape preset (shapes only: nothing is allocated)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=100000, help="cache capacity in tokens")
    p.add_argument("--budget", type=float, default=None,
                   help="kept fraction of the budgeted methods, in (0, 1] (default 0.1; dense has none and EvoSparse "
                        "keeps its 2048-token budget, as in `jsparse bench model`: refused for them)")
    p.add_argument("--no-gpu-paths", dest="gpu", action="store_false",
                   help="trace this host's own code paths (default: the GPU's, whatever the host)")
    p.add_argument("--verbose", action="store_true", help="also list every op of each scan's body")
    p.add_argument("--large-mb", type=float, default=4.0,
                   help="list the XLA ops (outside the Pallas kernels and GEMMs) that read or write at least this "
                        "many MiB (`large_ops`): passes over whole arrays, such as masked copies (default 4)")
    add_out_argument(p, "op_census.json", optional=True)
    args = p.parse_args(argv)
    if args.batch < 1 or args.context < 2:
        p.error(f"--batch {args.batch} --context {args.context}: expected a batch >= 1 and a context >= 2")
    if error := unread_budget(args.budget, [args.method], f"method {args.method!r} is"):
        p.error(error)
    args.budget = 0.1 if args.budget is None else args.budget
    try:
        check_budget(args.budget)
    except ValueError as e:
        p.error(str(e))
    if not args.large_mb > 0:
        p.error(f"--large-mb {args.large_mb}: expected a size in MiB > 0")
    try:
        check_contexts("--context", [args.context], shape_preset(args.shape), args.shape)
        path = out_path(args.out, "op_census.json")
    except ValueError as e:
        p.error(str(e))
    jaxpr, cfg = trace_step(args.method, args.shape, args.batch, args.context, args.budget, gpu=args.gpu)
    rows = census(jaxpr.jaxpr, verbose=args.verbose)
    print(f"{args.method} on {args.shape} shapes, batch {args.batch}, context {args.context}, "
          f"{'GPU' if args.gpu else 'host'} paths: {len(rows)} scans")
    print("| path | layers | eqns | Pallas kernels | top ops |")
    print("|---|---|---|---|---|")
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["ops"].items())[:6])
        print(f"| {r['path'] or '-'} | {r['length']} | {r['eqns']} | {', '.join(r['kernels']) or '-'} | {top} |")
        for line in r.get("body", []):
            print(f"|   | | | | {line} |")
    large = large_ops(jaxpr.jaxpr, int(args.large_mb * 2**20))
    print(f"\nXLA ops over at least {args.large_mb:g} MiB outside the kernels and GEMMs: {len(large) or 'none'}")
    if large:
        print("| path | op | largest result | MiB | per step |")
        print("|---|---|---|---|---|")
        for r in large:
            print(f"| {r['path']} | {r['op']} | {tuple(r['shape'])} | {r['bytes'] / 2**20:.1f} | {r['per_step']} |")
    if path:
        write_json(path, {**device_facts(), "benchmark": "op_census", "method": args.method, "shape": args.shape,
                          "batch": args.batch, "context": args.context, "budget": args.budget,
                          "gpu_paths": args.gpu, "num_layers": cfg.num_layers, "scans": rows,
                          "large_mb": args.large_mb, "large_ops": large})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
