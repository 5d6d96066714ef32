"""H100 benchmark of TokenButler's blockwise logit-MSE loss against the materialised jnp loss.

Run on a GPU machine from the repository root:

    GIT_COMMIT=$(git rev-parse HEAD) jsparse bench logit_mse --out /some/dir/

What it does (about 2-3 minutes on an H100; hard budget 4 minutes, cases past it are recorded as skipped):
  1. Correctness, compiled on the GPU, at a small size (2 stacked layers of SmolLM2, L = 1000: not a
     multiple of any tile): loss and both gradients of ``logit_mse(implementation="gpu")`` against
     ``jax.grad`` of the f32 materialised reference on the same bf16 values; causal and full; k' with
     Hq and with Hkv heads. Tolerance 2e-2 relative (bf16 inputs).
  2. Timing, forward + backward (``jax.value_and_grad`` of the mean loss with respect to q' and k'),
     the kernel against the materialised reference (``implementation="xla"``), at L = 1K, 2K, 4K, 8K,
     16K with the shapes of SmolLM2-135M stacked over its layers >= 1: B = 1, Hq = 29 layers x 9 heads
     = 261, Hkv = 29 x 3 = 87 (GQA), d = 64, d' = 32, bf16, causal (the default). Each case runs in
     its own subprocess, so ``peak_bytes_in_use`` (which JAX cannot reset) is that case's peak; children
     get ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` so the materialised loss may use nearly all HBM
     before it is declared "oom". The compiled executable's ``memory_analysis()`` is recorded too
     (and gives the predicted size where a case ran out of memory).
  3. A tile-size sweep of the kernel at L = 4K (informational; the defaults are in api.py).

Writes the JSON named by --out (default ./logit_mse.json; device, jax version, date, GIT_COMMIT, every case) and
prints a table last.
Options: ``--lengths 1024,2048``, ``--heads 261`` (reduce if too slow), ``--full`` (also time causal=False),
``--no-sweep``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from eval.bench.common import add_out_argument, command_line, out_path, positive_int, positive_ints, write_json

BUDGET_S = 235.0  # the whole script, including subprocess start-up
CHILD_TIMEOUT_S = 120.0

LAYERS, HEADS, KV_HEADS, D, DP = 29, 9, 3, 64, 32  # SmolLM2-135M layers >= 1; predictor d' = 32


def _is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


def _inputs(B, Hq, Hkv, Hkp, L, d, dp, seed=0):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 4)
    # Logit-like magnitudes: unit-variance features give s, p ~ N(0, 1).
    q = jax.random.normal(ks[0], (B, Hq, L, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, Hkv, L, d), jnp.bfloat16)
    qp = jax.random.normal(ks[2], (B, Hq, L, dp), jnp.bfloat16)
    kp = jax.random.normal(ks[3], (B, Hkp, L, dp), jnp.bfloat16)
    return q, k, qp, kp


def _value_and_grad(impl, causal, block_q=None, block_k=None):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.logit_mse import logit_mse

    def loss(q, k, qp, kp):
        per_head = logit_mse(q, k, qp, kp, causal=causal, implementation=impl, block_q=block_q, block_k=block_k)
        return jnp.mean(per_head)

    return jax.jit(jax.value_and_grad(loss, argnums=(2, 3)))


def child_device() -> dict:
    import jax

    dev = jax.devices()[0]
    return dict(device=str(dev), device_kind=dev.device_kind, platform=dev.platform, jax_version=jax.__version__)


def child_check() -> dict:
    """Kernel compiled on the GPU vs jax.grad of the f32 reference, small shapes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.logit_mse import logit_mse, logit_mse_reference

    results = []
    L = 1000
    for causal in (True, False):
        for Hkp in (2 * HEADS, 2 * KV_HEADS):
            q, k, qp, kp = _inputs(1, 2 * HEADS, 2 * KV_HEADS, Hkp, L, D, DP, seed=1)
            w = jax.random.uniform(jax.random.key(2), (1, 2 * HEADS), jnp.float32, 0.5, 1.5)

            def kernel_loss(qp, kp):
                return jnp.sum(logit_mse(q, k, qp, kp, causal=causal, implementation="gpu") * w)

            def ref_loss(qp, kp):
                f32 = lambda x: x.astype(jnp.float32)
                return jnp.sum(logit_mse_reference(f32(q), f32(k), qp, kp, causal=causal) * w)

            row = dict(causal=causal, L=L, Hq=2 * HEADS, Hkv=2 * KV_HEADS, Hkp=Hkp)
            try:
                v, (dqp, dkp) = jax.jit(jax.value_and_grad(kernel_loss, argnums=(0, 1)))(qp, kp)
                vr, (rqp, rkp) = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))(
                    qp.astype(jnp.float32), kp.astype(jnp.float32)
                )
                rel = lambda a, b: float(np.abs(np.asarray(a, np.float32) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                row.update(
                    loss_rel_err=abs(float(v) - float(vr)) / abs(float(vr)),
                    dqp_rel_err=rel(dqp, rqp), dkp_rel_err=rel(dkp, rkp),
                )
                row["ok"] = bool(max(row["loss_rel_err"], row["dqp_rel_err"], row["dkp_rel_err"]) < 2e-2)
            except Exception as e:  # noqa: BLE001 - recorded in the report
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
            results.append(row)
    return {"check": results, **child_device()}


def child_time(impl: str, L: int, causal: bool, heads: int, block_q=None, block_k=None) -> dict:
    """One timing case in a fresh process: compile, memory analysis, median of timed runs, peak bytes."""
    import jax
    import numpy as np

    Hq, Hkv = heads * HEADS, heads * KV_HEADS
    row = dict(impl=impl, L=L, causal=causal, B=1, Hq=Hq, Hkv=Hkv, d=D, dp=DP, block_q=block_q, block_k=block_k)
    dev = jax.devices()[0]
    try:
        args = _inputs(1, Hq, Hkv, Hq, L, D, DP)
        jax.block_until_ready(args)
        fn = _value_and_grad(impl, causal, block_q, block_k)
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        row["compile_s"] = time.perf_counter() - t0
        try:
            ma = compiled.memory_analysis()
            row["compiled_temp_bytes"] = int(ma.temp_size_in_bytes)
            row["compiled_total_bytes"] = int(
                ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
            )
        except Exception as e:  # memory_analysis is best-effort on some backends
            row["memory_analysis_error"] = repr(e)[:200]
        limit = (dev.memory_stats() or {}).get("bytes_limit")
        row["bytes_limit"] = limit
        if limit and row.get("compiled_total_bytes", 0) > limit:
            row["status"] = "oom"
            row["oom_reason"] = "memory_analysis exceeds bytes_limit (not run)"
            return row
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))  # warm-up
        first = time.perf_counter() - t0
        reps = int(max(3, min(20, 2.0 / max(first, 1e-4))))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        row["time_ms"] = 1e3 * float(np.median(times))
        row["time_min_ms"] = 1e3 * float(np.min(times))
        row["reps"] = reps
        pairs = L * (L + 1) // 2 if causal else L * L
        row["pairs_per_head"] = pairs
        # Kernel FLOPs: s and p tiles in both passes (2d + 2d' each) + the two gradient matmuls (2d' each).
        row["tflops_kernel_equiv"] = pairs * Hq * (4 * D + 8 * DP) / (row["time_ms"] * 1e-3) / 1e12
        row["peak_bytes"] = int((dev.memory_stats() or {}).get("peak_bytes_in_use", -1))
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        row["status"] = "oom" if _is_oom(e) else "error"
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            row["peak_bytes"] = int((dev.memory_stats() or {}).get("peak_bytes_in_use", -1))
        except Exception:
            pass
    return row


def _run_child(argv: list[str], deadline: float) -> dict:
    remaining = deadline - time.perf_counter()
    if remaining < 10:
        return {"status": "skipped", "error": "time budget"}
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", *argv],
            capture_output=True, text=True, timeout=min(CHILD_TIMEOUT_S, remaining), env=env,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout)[-600:]
    return {"status": "oom" if "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail else "crash",
            "error": tail, "returncode": proc.returncode}


def _fmt_bytes(b) -> str:
    return "-" if not isinstance(b, int) or b < 0 else f"{b / 2**30:.2f} GiB"


def main(argv=None, prog=None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384", type=positive_ints)
    ap.add_argument("--heads", type=positive_int, default=LAYERS, help="stacked layers (x9 query heads, x3 KV heads)")
    ap.add_argument("--full", action="store_true", help="also time causal=False")
    ap.add_argument("--no-sweep", action="store_true")
    add_out_argument(ap, "logit_mse.json")
    a = ap.parse_args(argv)

    if a.child is not None:  # child process: one job, result as one JSON line
        kind, *rest = a.child
        if kind == "check":
            out = child_check()
        else:
            impl, L, causal, heads, bq, bk = rest
            out = child_time(impl, int(L), causal == "1", int(heads),
                             None if bq == "-" else int(bq), None if bk == "-" else int(bk))
        print("RESULT " + json.dumps(out), flush=True)
        return

    # The parent never touches the GPU (a client here would hold memory the children need).
    try:
        path = out_path(a.out, "logit_mse.json")  # before the run: a bad --out ends none
    except ValueError as e:
        ap.error(str(e))
    start = time.perf_counter()
    deadline = start + BUDGET_S
    from jsparse.provenance import source_commit

    commit = source_commit()
    check = _run_child(["check"], deadline)
    report = dict(
        benchmark="logit_mse forward+backward (value_and_grad wrt q', k'), blockwise Pallas Triton vs materialised jnp",
        device=check.get("device", "?"), device_kind=check.get("device_kind", "?"), platform=check.get("platform", "?"),
        jax=check.get("jax_version", "?"), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        commit=commit or "unknown", command=command_line(),
        shapes=dict(B=1, Hq=a.heads * HEADS, Hkv=a.heads * KV_HEADS, d=D, dp=DP, dtype="bfloat16",
                    note=f"{a.heads} layers x {HEADS} heads of SmolLM2-135M stacked into the head axis"),
    )
    if report["platform"] != "gpu":  # (asked of the child: this process leaves the GPU's memory to the children)
        sys.exit(f"{prog or 'logit_mse'}: error: jsparse bench logit_mse times GPU kernels; the JAX backend is "
                 f"{report['platform']!r}: expected 'gpu'")
    report["check"] = check.get("check", check)

    lengths = a.lengths
    cases = []
    for causal in ([True, False] if a.full else [True]):
        for impl in ("gpu", "xla"):
            ooms = False
            for L in lengths:
                if ooms:  # a longer sequence cannot fit where a shorter one did not
                    cases.append(dict(impl=impl, L=L, causal=causal, status="oom",
                                      oom_reason="not run: a shorter length already ran out of memory"))
                    continue
                row = _run_child(["time", impl, str(L), "1" if causal else "0", str(a.heads), "-", "-"], deadline)
                row.update(impl=impl, L=L, causal=causal)
                cases.append(row)
                ooms = row.get("status") == "oom"
                print(f"[{time.perf_counter() - start:6.1f}s] {impl} L={L} causal={causal}: {row.get('status')} "
                      f"{row.get('time_ms', float('nan')):.2f} ms", flush=True)
    report["cases"] = cases

    sweep = []
    if not a.no_sweep:
        for bq, bk in ((64, 64), (128, 64), (64, 128), (128, 128)):
            row = _run_child(["time", "gpu", "4096", "1", str(a.heads), str(bq), str(bk)], deadline)
            row.update(block_q=bq, block_k=bk)
            sweep.append(row)
    report["sweep_L4096_causal"] = sweep
    report["total_s"] = time.perf_counter() - start

    write_json(path, report)

    # Table last.
    print(f"\nwrote {path}  ({report['total_s']:.0f} s)  device={report['device_kind']} jax={report['jax']} commit={commit}")
    print("correctness (kernel on GPU vs f32 reference, L=1000):")
    for r in report["check"] if isinstance(report["check"], list) else []:
        if "error" in r:
            print(f"  causal={r['causal']!s:5} Hkp={r['Hkp']:3}  FAIL {r['error'][:200]}")
            continue
        print(f"  causal={r['causal']!s:5} Hkp={r['Hkp']:3}  loss {r['loss_rel_err']:.1e}  dq' {r['dqp_rel_err']:.1e}"
              f"  dk' {r['dkp_rel_err']:.1e}  {'ok' if r['ok'] else 'FAIL'}")
    if not isinstance(report["check"], list):
        print(f"  check failed: {report['check']}")
    print("\nsweep, L=4096 causal: " + ", ".join(
        f"{r['block_q']}x{r['block_k']}: {r.get('time_ms', float('nan')):.2f} ms" for r in sweep))
    by = {(r["impl"], r["L"], r["causal"]): r for r in cases}
    print(f"\n{'L':>6} {'causal':>6} | {'kernel ms':>10} {'kernel peak':>12} | {'jnp ms':>10} {'jnp peak':>12} | {'speedup':>7}")
    for causal in ([True, False] if a.full else [True]):
        for L in lengths:
            kr, xr = by.get(("gpu", L, causal), {}), by.get(("xla", L, causal), {})
            cell = lambda r: (f"{r['time_ms']:10.2f}" if r.get("status") == "ok" else f"{r.get('status', '-'):>10}")
            speed = (f"{xr['time_ms'] / kr['time_ms']:6.2f}x"
                     if kr.get("status") == "ok" and xr.get("status") == "ok" else "      -")
            print(f"{L:>6} {causal!s:>6} | {cell(kr)} {_fmt_bytes(kr.get('peak_bytes')):>12} | "
                  f"{cell(xr)} {_fmt_bytes(xr.get('peak_bytes')):>12} | {speed:>7}")


if __name__ == "__main__":
    main()
