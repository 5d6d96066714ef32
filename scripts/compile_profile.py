"""A pytest plugin that records where the suite's time goes: per test file and per test, the wall time, XLA's backend
compile time (jax.monitoring's compile events) and the part of it spent on eager op-by-op compiles (a jnp / lax
function or a private jax function called outside any jit: `jit(broadcast_in_dim)`, `jit(_normal)`, ...).

    PYTHONPATH=scripts JAX_PLATFORMS=cpu .venv/bin/python -m pytest -p compile_profile tests/test_x.py
    COMPILE_PROFILE_OUT=/tmp/prof.json ... -n 2 --dist loadfile tests    # one file per xdist worker: prof.gw0.json

Each process writes COMPILE_PROFILE_OUT (default compile_profile.json) with its worker id before the suffix:
`eval.bench.common.device_facts()` with "cpu_count", then {"files": {file: {"wall", "compile", "compile_n", "eager",
"eager_n", "fn:jit(NAME)": seconds}}, "tests": {nodeid: {"wall", "compile", "compile_n", "eager", "eager_n"}}}.
Compile seconds are XLA's (`/jax/core/compile/backend_compile_duration`), lowering and tracing not included. A hit
of the suite's persistent compilation cache (`tests/conftest.py`) compiles nothing: profile with
JSPARSE_TEST_XLA_CACHE=off (or an empty folder) to see every compile. Subprocesses a test starts are not seen.
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest
from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_files = collections.defaultdict(lambda: collections.defaultdict(float))
_tests = collections.defaultdict(lambda: collections.defaultdict(float))
_current = {"file": "(collection)", "test": "(collection)"}
_public = None


def is_eager(fun_name: str) -> bool:
    """Whether a compiled function's name is an op called eagerly: `jit(NAME)` with NAME a jax.numpy or jax.lax
    function, or private (jax's own wrappers: `_normal`, `_where`, `_reduce_sum`)."""
    global _public
    if _public is None:
        import jax

        _public = set(dir(jax.numpy)) | set(dir(jax.lax))
    name = fun_name[4:-1] if fun_name.startswith("jit(") and fun_name.endswith(")") else fun_name
    return name.startswith("_") or name in _public


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    if event != COMPILE_EVENT:
        return
    name = str(kwargs.get("fun_name", "?"))
    f, t = _files[_current["file"]], _tests[_current["test"]]
    for rec in (f, t):
        rec["compile"] += seconds
        rec["compile_n"] += 1
        if is_eager(name):
            rec["eager"] += seconds
            rec["eager_n"] += 1
    f["fn:" + name] += seconds


monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["file"], _current["test"] = item.path.name, item.nodeid
    t0 = time.perf_counter()
    yield
    dt = time.perf_counter() - t0
    _files[item.path.name]["wall"] += dt
    _tests[item.nodeid]["wall"] += dt


def pytest_sessionfinish(session):
    base, ext = os.path.splitext(os.environ.get("COMPILE_PROFILE_OUT", "compile_profile.json"))
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = f"{base}.{worker}{ext}" if worker else base + ext
    if not _files:  # the xdist controller runs no test
        return
    with open(path, "w") as fh:
        json.dump({**_meta(), "files": {k: dict(v) for k, v in _files.items()},
                   "tests": {k: dict(v) for k, v in _tests.items()}}, fh, indent=1)


def _meta() -> dict:
    """What every committed result names (`eval.bench.common.device_facts`: device, jax, date, commit, command),
    and the CPU count."""
    from eval.bench.common import device_facts

    return {**device_facts(), "cpu_count": os.cpu_count()}
