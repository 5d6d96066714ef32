"""Where the time of one decode step goes on the GPU: a `jax.profiler` trace of a few steps of the model's own
decode loop (random weights of a model shape, default Llama-3.1-8B in bf16, 100K context, batch 4), written as a
Perfetto JSON trace and summarised per kernel name (launches and device time per step), with the compiled HLO
(gzipped, to look fusions up) beside the JSON.

    jsparse bench profile_decode_step --method kascade --out /some/dir/profile_kascade.json
    jsparse bench profile_decode_step --method kascade --time dense,kascade --out /some/dir/

Any method of `jsparse bench model` (eval/bench/model.py) is profiled with exactly the state and the step that
benchmark builds and times: `bench_method` (Kascade 5 anchors 0, 6, 13, 19, 26 with the identity head map at
Llama-3.1-8B's 32 layers; EvoSparse its 2048-token budget with 15 random retrieval heads; `--budget` the kept
fraction of the others), `filled_cache` and `method_decode_steps` (`models.llama.decode` in a jitted `fori_loop`,
the cache and the method's state donated). `--time` first times the listed methods' steps in the same process as
`jsparse bench model` does (`method_rows`: dense first, speedup and bytes floor; no correctness check), so the
profile sits beside the timings of the same build. Beside the methods, `VARIANTS` can be profiled or timed:
`kascade:switch` decodes as Kascade did before its runs of layers of one role were scanned apart (one layer scan,
a `lax.switch` on the role in every layer); `evosparse:per_layer` as EvoSparse did before it selected each group of
layers that inherit one retrieval set at once (`group_select=False`: one selection launch per sparse layer).

The JSON's kernel table counts the device ops of the trace (events on GPU streams): per step, the kernels and
their device time (`device_us_per_step`), the time some kernel runs (`gpu_busy_us_per_step`, overlaps counted
once) against the span from the first kernel to the last (`gpu_span_us_per_step`): the difference,
`gpu_idle_us_per_step`, is the GPU waiting on the host (launch gaps, a conditional's predicate read back; the
tracer slows the host's launches, so this is an upper bound: `wall_ms_per_step_traced` beside the untraced
`timed` rows shows by how much); the longest of those gaps, each with the op after it and its time from the
first op (`largest_gaps`); and the XLA fusions and copies that take under 5 us a launch (`small_xla_*`), the
per-layer bookkeeping. A CPU run (tests) writes the same JSON with an empty table: its trace has no GPU streams.

Two things to know when reading the idle time (measured on the H200, eval/results/h200/graph_profile/):
- The traced call opens with a lead-in that the call pays once, not every step: at 100K, batch 4, 0.26-0.45 ms
  of gaps around the call's first copies before the first layer starts (`largest_gaps`). `--steps 2` spreads it
  over two steps; more steps dilute it, as `jsparse bench model`'s 16 do.
- Under a profiler XLA runs its command buffers (CUDA graphs) op by op, unless XLA_FLAGS holds
  `--xla_enable_command_buffers_during_profiling=true`. Both ways gave the same kernels, the same per-layer gaps,
  busy time within 0.01 ms a step and idle time within 0.04 ms, so the default traces stand for the timed step.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import re
import time

import jax
import jax.numpy as jnp

from eval.bench.common import (add_out_argument, check_budget, check_contexts, device_facts, out_path, positive_int,
                               write_json)

SMALL_US = 5.0  # an XLA kernel under this per launch counts as per-layer bookkeeping (`small_xla_*`)
LARGEST_GAPS = 8  # the idle gaps listed (`largest_gaps`)
_GEMM = ("gemm", "xmma", "cutlass", "cublas", "nvjet", "sm90_", "sm80_")
_XLA_PREFIX = ("copy", "wrapped_", "memcpy", "memset", "dynamic-update-slice", "dynamic_update_slice")
_XLA_INSTRUCTION = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)+$")  # an HLO instruction's name, e.g. transpose.12


def kernel_kind(name: str) -> str:
    """'gemm' (cuBLAS/CUTLASS), 'xla' (XLA fusions, copies, memsets, single HLO instructions) or 'custom'
    (Pallas/Triton kernels, named by their pallas_call, and the rest)."""
    low = name.lower()
    if any(g in low for g in _GEMM):
        return "gemm"
    if "fusion" in low or low.startswith(_XLA_PREFIX) or _XLA_INSTRUCTION.match(low):
        return "xla"
    return "custom"


def _busy_us(intervals) -> tuple[float, float]:
    """(union length, span) of [start, end) intervals in us."""
    busy, end, first, last = 0.0, None, None, None
    for s, e in sorted(intervals):
        first = s if first is None else first
        last = e if last is None else max(last, e)
        if end is None or s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, (last - first) if first is not None else 0.0


def trace_calls(trace_dir: str, fn, args, calls: int, top: int) -> dict:
    """`kernel_table` of `calls` calls of fn(*args), traced under trace_dir after one untraced call."""
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    return kernel_table(trace_dir, calls, top)


def device_ops(trace_dir: str) -> tuple[str, list[str], list[tuple[float, float, str]]]:
    """(path, GPU process names, [(start us, duration us, name)] of every device op, by start) of the newest
    Perfetto trace under trace_dir: the events on GPU streams."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pid_names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pid_names.items() if "/device:GPU" in n or "GPU" in n and "host" not in n.lower()}
    ops = sorted((float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), e.get("name", "?")) for e in events
                 if e.get("ph") == "X" and e.get("pid") in gpu_pids)
    return path, [pid_names[p] for p in gpu_pids], ops


def idle_before(ops) -> list[float]:
    """For each op of `device_ops` (by start), the us the GPU ran nothing just before it: from the end of every op
    before it to its start (0 for the first, or when an earlier op still runs)."""
    idle, end = [], None
    for ts, dur, _ in ops:
        idle.append(0.0 if end is None else max(ts - end, 0.0))
        end = ts + dur if end is None else max(end, ts + dur)
    return idle


def kernel_table(trace_dir: str, steps: int, top: int) -> dict:
    """Aggregates the device ops (events on GPU streams) of the newest Perfetto trace under trace_dir, per step."""
    path, gpu_processes, ops = device_ops(trace_dir)
    agg = collections.defaultdict(lambda: [0, 0.0])
    total, count, intervals = 0.0, 0, []
    for ts, dur, name in ops:
        agg[name][0] += 1
        agg[name][1] += dur
        total += dur
        count += 1
        intervals.append((ts, ts + dur))
    rows = sorted(({"kernel": k[:90], "kind": kernel_kind(k), "launches_per_step": v[0] / steps,
                    "us_per_step": v[1] / steps} for k, v in agg.items()), key=lambda r: -r["us_per_step"])
    kinds = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        kinds[r["kind"]][0] += r["launches_per_step"]
        kinds[r["kind"]][1] += r["us_per_step"]
    small = [r for r in rows if r["kind"] == "xla" and r["us_per_step"] < SMALL_US * r["launches_per_step"]]
    busy, span = _busy_us(intervals)
    gaps = [{"idle_us": idle, "before": name[:90], "at_us": ts - ops[0][0]}
            for (ts, _, name), idle in zip(ops, idle_before(ops)) if idle > 0]
    return {"trace": path, "gpu_processes": gpu_processes, "kernels_per_step": count / steps,
            "device_us_per_step": total / steps, "gpu_busy_us_per_step": busy / steps,
            "gpu_span_us_per_step": span / steps, "gpu_idle_us_per_step": (span - busy) / steps,
            "by_kind": {k: {"launches_per_step": v[0], "us_per_step": v[1]} for k, v in sorted(kinds.items())},
            "small_xla_launches_per_step": sum(r["launches_per_step"] for r in small),
            "small_xla_us_per_step": sum(r["us_per_step"] for r in small), "top": rows[:top],
            "largest_gaps": sorted(gaps, key=lambda g: -g["idle_us"])[:LARGEST_GAPS]}


# Variants of `jsparse bench model`'s methods, profiled (--method) or timed (--time) beside them: name -> what differs.
VARIANTS = {"kascade:switch": "decode as one layer scan with a lax.switch on the role in every layer "
                              "(anchor_layers=None), not as runs of layers of one role",
            "evosparse:per_layer": "every sparse layer makes its own selection (group_select=False), not each group "
                                   "of layers that inherit one retrieval set at once"}


def build_method(name: str, cfg, budget: float):
    """(method, how its state was made) as `jsparse bench model` builds `name` (`bench_method`), or a variant."""
    from eval.bench import model as bench_model

    method, how = bench_model.bench_method(name.split(":")[0], cfg, budget)
    if name == "kascade:switch":
        method = method.replace(anchor_layers=None)
    elif name == "evosparse:per_layer":
        method = method.replace(group_select=False)
    elif name not in bench_model.METHODS:
        raise ValueError(f"unknown method {name!r}: expected one of {list(bench_model.METHODS) + list(VARIANTS)}")
    return method, how + (f"; {VARIANTS[name]}" if name in VARIANTS else "")


def main(argv=None, prog=None):
    from eval.bench import model as bench_model

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="evosparse", choices=list(bench_model.METHODS) + list(VARIANTS),
                   help="the method whose step is profiled, built as `jsparse bench model` builds it")
    p.add_argument("--shape", default="llama3-8b", help="model shape preset (random weights)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=positive_int, default=100_000, help="tokens in the cache before the steps")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--budget", type=float, default=None,
                   help="kept fraction of the budgeted methods, in (0, 1] (default 0.1; dense has none and EvoSparse "
                        "keeps its 2048-token budget: refused when only they are profiled and timed)")
    p.add_argument("--steps", type=positive_int, default=4, help="decode steps traced (and timed per case with --time)")
    p.add_argument("--top", type=positive_int, default=40, help="kernels listed (by device time)")
    p.add_argument("--time", default="", metavar="METHODS",
                   help="comma-separated methods (or variants) to time first in the same process (`jsparse "
                        "bench model`'s method_rows, dense first); e.g. dense,kascade,kascade:switch")
    p.add_argument("--trace-dir", default=None,
                   help="folder of the Perfetto trace (default /tmp/jsparse_profile_METHOD_PID)")
    add_out_argument(p, "profile_decode_step.json")
    a = p.parse_args(argv)
    timed_methods = tuple(m.strip() for m in a.time.split(",") if m.strip())
    unknown = sorted(set(timed_methods) - set(bench_model.METHODS) - set(VARIANTS))
    if unknown:
        p.error(f"--time: unknown {unknown}; expected some of {list(bench_model.METHODS) + list(VARIANTS)}")
    if error := bench_model.unread_budget(a.budget, (a.method, *timed_methods)):
        p.error(error)
    a.budget = 0.1 if a.budget is None else a.budget
    try:
        cfg = bench_model.preset(a.shape)  # (an unknown shape: ValueError naming it and the presets)
        check_contexts("--context", [a.context], cfg, a.shape)
        check_budget(a.budget)
        a.out = out_path(a.out, "profile_decode_step.json")
    except ValueError as e:
        p.error(str(e))
    from jsparse.xla_flags import set_xla_flags
    set_xla_flags()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # 100K x batch 4: 53 GB of cache + 16 GB weights
    from eval.bench import common as bm
    from models.cache import KVCache
    dtype = jnp.dtype(a.dtype)
    params = bench_model.bench_params(cfg, dtype=dtype)
    B, ctx, steps = a.batch, a.context, a.steps
    timed = []
    if timed_methods:  # before the profile's cache exists: each case builds (and frees) its own
        if timed_methods[0] != "dense":
            timed_methods = ("dense",) + tuple(m for m in timed_methods if m != "dense")
        hbm = bm.measure_hbm_gbs()
        built = {name: build_method(name, cfg, a.budget) for name in timed_methods}
        timed = bench_model.method_rows(cfg, params, timed_methods, [ctx], [B], steps, hbm, a.budget, built=built)

    m, how = build_method(a.method, cfg, a.budget)
    cap = bench_model.decode_capacity(ctx, steps)
    cache = bench_model.filled_cache(cfg, B, ctx, cap, dtype)
    state = m.init_state(cfg, B, cap)
    # The layer scan as `jsparse bench model` and generate run it on this backend (unrolled on a GPU).
    unroll = bench_model.layer_unroll(None)
    step = functools.partial(bench_model.method_decode_steps, unroll=unroll)
    tok = jnp.zeros((B, 1), jnp.int32)
    tok, cache, state = step(params, m, tok, cache, state, cfg=cfg, steps=steps)  # compiled (or cached) and warm
    jax.block_until_ready(tok)
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.full((B,), ctx, jnp.int32))
    hlo = bench_model.method_decode_steps.lower(params, m, tok, cache, state, cfg=cfg, steps=steps,
                                                unroll=unroll).compile().as_text()
    with gzip.open(os.path.splitext(a.out)[0] + ".hlo.txt.gz", "wt") as f:  # to look up what a fusion computes
        f.write(hlo)
    d = a.trace_dir or f"/tmp/jsparse_profile_{a.method}_{os.getpid()}"
    t = time.perf_counter()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        tok, cache, state = step(params, m, tok, cache, state, cfg=cfg, steps=steps)
        jax.block_until_ready(tok)
    wall = (time.perf_counter() - t) * 1e3 / steps
    tab = kernel_table(d, steps, a.top)
    res = {**device_facts(), "benchmark": "profile_decode_step", "method": a.method, "state": how, "shape": a.shape,
           "dtype": a.dtype, "batch": B, "context": ctx, "budget": a.budget, "steps": steps,
           "decode_layer_unroll": unroll,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "wall_ms_per_step_traced": wall,
           **tab, "timed": timed}
    write_json(a.out, res)
    for r in tab["top"]:
        print(f"{r['us_per_step']:9.1f} us {r['launches_per_step']:7.1f}x  {r['kind']:6s} {r['kernel']}")
    print(bm.table([{"kind": k, **v} for k, v in tab["by_kind"].items()], ["kind", "launches_per_step",
                                                                           "us_per_step"]))
    print(f"{a.method}: {tab['kernels_per_step']:.0f} kernels/step, device {tab['device_us_per_step'] / 1e3:.2f} "
          f"ms/step (busy {tab['gpu_busy_us_per_step'] / 1e3:.2f}, idle {tab['gpu_idle_us_per_step'] / 1e3:.2f}; "
          f"{tab['small_xla_launches_per_step']:.0f} XLA kernels under {SMALL_US:g} us: "
          f"{tab['small_xla_us_per_step'] / 1e3:.2f} ms), wall (traced) {wall:.2f} ms/step; "
          f"processes {tab['gpu_processes']}")
    if timed:
        print(bm.table(timed, ["method", "context", "batch", "step_ms", "tokens_per_s", "speedup", "floor_speedup",
                            "floor_fraction", "error"]))
    return 0


if __name__ == "__main__":
    main()
