"""Timing, device facts and JSON records shared by every benchmark of `jsparse bench` (one results schema).

Every benchmark JSON starts with `device_facts()`: device, platform, jax, date (UTC), commit and command (the
command line that reproduces it); its rows hold the dense baseline measured in the same run beside each method.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.provenance import source_commit


def time_ms(fn: Callable, *args, warmup: int = 3, iters: int = 20) -> float:
    """Median wall time in ms of `fn(*args)` (results blocked on), after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def pipelined_ms(fn: Callable, args: tuple, n: int = 20, warmup: int = 2) -> float:
    """Mean wall time in ms of `n` calls of `fn(*args)` issued back to back and blocked on once at the end (the
    device's throughput, launch gaps included, host sync excluded), after `warmup` blocked calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) * 1e3 / n


# The command line of this run, set by `jsparse bench NAME` before it calls the benchmark (None: run as a script).
COMMAND: str | None = None


def command_line() -> str:
    """The command that reproduces this run: `jsparse bench ...` when called through the CLI, else python + argv."""
    if COMMAND is not None:
        return COMMAND
    return shlex.join(["python", *sys.argv])


def add_out_argument(parser, name: str, optional: bool = False) -> None:
    """`--out PATH`, the one way every benchmark takes its output: the JSON file to write, or a folder (an existing
    one, or a path ending in '/') to write `name` in; default `name` in the current folder, or with optional=True
    nothing written (`out_path` resolves it)."""
    parser.add_argument("--out", default=None if optional else name, metavar="PATH",
                        help=f"JSON file to write, or a folder to write {name} in "
                             + ("(default: none written)" if optional else f"(default ./{name})"))


def positive_int(text: str, minimum: int = 1) -> int:
    """argparse `type` of a count flag (--steps, --batch, --iters, ...): a positive integer (at least `minimum`), else
    an error naming the flag and the value (argparse prefixes 'argument --FLAG: ')."""
    value = text.strip() if isinstance(text, str) else text
    if not (isinstance(value, int) or value.isdigit()) or int(value) < minimum:
        raise argparse.ArgumentTypeError(f"{text!r}: expected " + ("a positive integer" if minimum == 1 else
                                                                   f"an integer >= {minimum}"))
    return int(value)


def nonnegative_int(text: str) -> int:
    """argparse `type` of a count flag where 0 means none (--min-tokens): an integer >= 0, else an error naming it."""
    return positive_int(text, 0)


def positive_ints(text: str) -> list[int]:
    """argparse `type` of a list flag (--context, --lengths, --batches, ...): '8192,32768' -> [8192, 32768], each a
    positive integer (empty items skipped, '' -> []), else an error naming the item (and, from argparse, the flag)."""
    return [positive_int(x) for x in str(text).split(",") if x.strip()]


def shape_preset(shape: str):
    """The model shape preset `--shape` names (models.presets); ValueError naming --shape and the presets."""
    from models.presets import preset
    try:
        return preset(shape)
    except ValueError as e:
        raise ValueError(f"--shape: {e}") from None


def check_contexts(flag: str, contexts, cfg, shape: str, kind: str = "shape") -> None:
    """ValueError naming `flag` for a context longer than the model shape's max_position_embeddings (no checkpoint
    of the shape has seen such positions; RoPE past them only extrapolates). kind: what `shape` names ("model" for a
    loaded model's spec)."""
    over = [c for c in contexts if c > cfg.max_position_embeddings]
    if over:
        raise ValueError(f"{flag} {','.join(map(str, over))}: longer than the {shape} {kind}'s context of "
                         f"{cfg.max_position_embeddings} tokens (max_position_embeddings); expected at most that")


def require_gpu(bench: str, smoke: str | None = None) -> None:
    """ValueError unless JAX's backend is the GPU: `jsparse bench BENCH` times GPU kernels at real model shapes, which
    on a CPU ran for hours or ran out of memory, measuring nothing. `smoke`: the flag of the benchmark's CPU smoke
    run (interpreted kernels at tiny sizes), named in the message."""
    import jax

    if jax.default_backend() != "gpu":
        raise ValueError(f"jsparse bench {bench} times GPU kernels at real model shapes; this host's JAX backend is "
                         f"{jax.default_backend()!r}: expected 'gpu'"
                         + (f" (or {smoke} for a CPU smoke run at tiny sizes)" if smoke else ""))


def check_budget(budget: float) -> None:
    """A `--budget` of the benchmarks: ValueError naming it unless it is a kept fraction of the context in (0, 1]."""
    if not 0.0 < budget <= 1.0:  # NaN fails too
        raise ValueError(f"--budget {budget:g}: expected a kept fraction of the context in (0, 1]")


def out_path(out: str | None, name: str) -> str | None:
    """The file `--out` names (see `add_out_argument`; None for none); its folder is created (ValueError naming
    --out when a file is in the way). Benchmarks call it before their work, so that a bad --out ends no run."""
    if out is None:
        return None
    path = os.path.join(out, name) if out.endswith(("/", os.sep)) or os.path.isdir(out) else out
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where the folder, or one above it, would be
        raise ValueError(f"--out {out}: {folder} cannot be a folder, a file is in its way: expected a file in a "
                         f"folder, or a folder to write {name} in") from None
    return path


def device_facts() -> dict:
    d = jax.devices()[0]
    return {"device": getattr(d, "device_kind", str(d)), "platform": d.platform, "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": source_commit(), "command": command_line()}


def measure_hbm_gbs(nbytes: int = 2 << 30) -> float:
    """Device memory bandwidth from a large copy (bytes read + bytes written over the time)."""
    n = nbytes // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.0001)
    ms = time_ms(f, x, iters=10)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def measure_matmul_tflops(n: int = 8192) -> float:
    """bf16 matmul rate (TFLOP/s) of an n x n x n product."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    ms = time_ms(f, a, b, iters=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


# The results schema: what every benchmark JSON names (its rows then hold the dense baseline of the same run).
SCHEMA = ("device", "jax", "date", "commit", "command")


def write_json(path: str, payload: dict) -> None:
    """Writes a benchmark's record to `path`; raises ValueError if a key of SCHEMA is missing (start payloads from
    `device_facts()`)."""
    missing = [k for k in SCHEMA if k not in payload]
    if missing:
        raise ValueError(f"benchmark record for {path} lacks {missing}; every record names {list(SCHEMA)} "
                         "(start it from eval.bench.common.device_facts())")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def table(rows: list[dict], columns: list[str]) -> str:
    """A small Markdown table of `rows` (missing values as '-')."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def dense_einsum_decode(q, k, v, lengths):
    """Dense decode in plain XLA over the head-major cache (T = 1): q [B, 1, Hq, D], k, v [B, Hkv, N, D]."""
    b, _, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bhnd->bhgn", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    s = jnp.where(jnp.arange(n) < lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgn,bhnd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, 1, hq, d).astype(q.dtype)
