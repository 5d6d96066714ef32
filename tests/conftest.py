"""Shared fixtures: our logits for a converted model, and the logit comparison used by the parity tests.

Most of the suite compiles far more than it computes (interpret-mode kernels, tiny models, many shapes), so XLA's
LLVM backend runs at -O0 there (`jax_disable_most_optimizations`: the HLO passes, fusion included, still run and
the float operations are the same; only the machine code is less optimised): about half the CPU time of a
kernel-heavy file (tests/test_local_attention.py 54 s -> 29 s, tests/test_generate.py 48 s -> 27 s). The files
that run the bundled 135M model for real (XLA_OPTIMIZED_FILES) compute more than they compile and keep the
optimised backend (the README's eval command: 118 s of CPU optimised, 150 s at -O0). JSPARSE_TEST_XLA_OPT=1
optimises every file. The environment variable carries the setting into the subprocesses some tests start.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

# f32 matmuls at full f32 precision on every backend: a GPU's default runs them in TF32 (10-bit mantissa), so the
# jnp references of the f32 kernel tests drift by ~1e-4 from the kernels' f32 results and 49 kernel tests failed
# on an H200 (2026-12-04); the CPU already computes in f32, so nothing changes there. Set before jax is imported.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
if os.environ.get("JSPARSE_TEST_XLA_OPT") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The Mosaic GPU interpreter (tests/test_*_mgpu.py) runs every simulated warpgroup and TMA engine as its own XLA CPU
# computation that blocks in barrier callbacks until the others arrive, so it needs as many threads in XLA's CPU
# pool as it simulates. That pool has one thread per schedulable CPU unless NPROC says otherwise (XLA's CPU client
# reads it): on a machine that gives a worker one CPU, the interpreter waited forever (reproduced here with
# `taskset -c 0`; the CI run of 2026-11-25 hung). Eight threads keep it moving on any machine.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))
# JAX's persistent compilation cache, for every compile of the suite (subprocesses included): about 60% of the suite's
# time is XLA compiling programs that do not change between runs, and a warm cache serves them from disk
# (tests/test_generate.py and five other files: 232 s cold, 65 s warm, 2026-12-03). A cold run (a fresh machine) is
# no slower: the cache only adds writes. Keys are the program and its compile options, so a hit is the same
# executable; programs with host callbacks are never cached. JSPARSE_TEST_XLA_CACHE names the folder (default
# `$JSPARSE_CACHE/xla-tests`, i.e. ~/.cache/jsparse/xla-tests), or `off`. JAX's own size limit is not used: with one
# set, every write lists the whole folder under a file lock (thousands of entries, two workers: the suite ran at
# half speed); `pytest_configure` trims the folder once per run instead (`XLA_CACHE_MAX_BYTES`).
XLA_CACHE_MAX_BYTES = 2 << 30
_xla_cache = os.environ.get("JSPARSE_TEST_XLA_CACHE") or os.path.join(
    os.environ.get("JSPARSE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jsparse"), "xla-tests")
if _xla_cache != "off":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _xla_cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

import jax  # noqa: E402  (after the environment above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

MAX_MAPPINGS = 30000
# test_cli.py and test_api_edges.py run the bundled model too, but for a few tokens: at -O0 they took 119-122 s of CPU
# against 149-152 s optimised (both files, cold compilation caches, 2026-12-05); test_readme.py and test_bundled.py
# took 110 s optimised against 123 s at -O0.
XLA_OPTIMIZED_FILES = ("test_readme.py", "test_bundled.py")


@pytest.fixture(autouse=True, scope="module")
def _xla_backend_optimization(request):
    """-O0 for the compile-bound files, the optimised backend for XLA_OPTIMIZED_FILES (read at each compile).

    After each file, `jax.clear_caches()` drops the file's compiled executables. Every XLA CPU executable keeps its
    own memory mappings, and a worker that ran a few hundred tests reached ~36,000 of the kernel's 65,530
    (vm.max_map_count): the next compile segfaulted inside XLA (tests/test_sliding_window.py, 2026-11-29, locally
    and in CI), and pytest-xdist stopped handing out files after the crash, so the run hung until CI's limit.
    Cleared per file, a worker stays near 1,100 mappings.
    """
    if os.environ.get("JSPARSE_TEST_XLA_OPT") != "1":
        jax.config.update("jax_disable_most_optimizations", request.path.name not in XLA_OPTIMIZED_FILES)
    yield
    jax.clear_caches()
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: stop with a clear error well before the kernel's limit, not a segfault inside XLA
        count = sum(1 for _ in maps.open())
        assert count < MAX_MAPPINGS, (f"{count} memory mappings after {request.path.name} with jax's caches "
                                      f"cleared (limit here {MAX_MAPPINGS}; the kernel's is 65,530): what holds "
                                      f"compiled executables across files?")


@pytest.fixture
def mosaic_interpreter_on_the_cpu():
    """Runs a test's Mosaic GPU interpreter on the host's CPU device, as on CI. The interpreter simulates a GPU's
    warpgroups with host callbacks; with its inputs on a GPU (a GPU host's default device) the interpreted kernels
    did not finish in 400 s (jax 0.11.2, an H200, 2026-12-04), where the CPU takes 2-5 s a test."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def trim_cache(folder: Path, max_bytes: int) -> int:
    """Deletes the oldest files (by modification time) of `folder` until it holds at most max_bytes / 2, when it
    holds more than max_bytes; returns how many it deleted."""
    if not folder.is_dir():
        return 0
    entries = sorted((st.st_mtime, st.st_size, p) for p in folder.iterdir() if p.is_file() for st in [p.stat()])
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, p in entries:
        if total <= max_bytes // 2:
            break
        p.unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


def pytest_configure(config):
    """Once per run (the xdist controller, or a plain pytest process): the compilation cache kept under its bound."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if folder and not hasattr(config, "workerinput"):
        trim_cache(Path(folder), XLA_CACHE_MAX_BYTES)


def _our_logits(cfg, params, tokens, method_name: str = "dense") -> np.ndarray:
    """f32[B, T, V] logits of `models.llama.prefill(..., all_logits=True)` for tokens: int[B, T]."""
    from jsparse.methods import make_method
    from models import llama
    from models.cache import init_cache

    tokens = jnp.asarray(np.asarray(tokens), jnp.int32)
    B, T = tokens.shape
    method = make_method(method_name)
    cache = init_cache(cfg, B, T, params.embed.dtype)
    lengths = jnp.full((B,), T, jnp.int32)
    fn = jax.jit(lambda p, t, c: llama.prefill(p, cfg, method, t, lengths, c, method.init_state(cfg, B, T),
                                                all_logits=True)[0])
    with jax.default_matmul_precision("highest"):  # no TF32 for f32 matmuls when run on a GPU
        return np.asarray(fn(params, tokens, cache))


def _compare(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |ours - ref|, mean over positions of KL(softmax(ref) || softmax(ours))), both f32[..., V]."""
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    logp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    logq = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    kl = float(np.mean(np.sum(np.exp(logp) * (logp - logq), axis=-1)))
    return float(np.max(np.abs(ours - ref))), kl


@pytest.fixture(scope="session")
def parity():
    """`parity.logits(cfg, params, tokens)` and `parity.compare(ours, ref) -> (max_abs_diff, kl)`."""
    return types.SimpleNamespace(logits=_our_logits, compare=_compare)


# The files of 15 s or more, slowest first (from `--durations=0` of a whole run on a 2-core machine, 2026-12-03; the
# rest follow in collection order). With `--dist loadfile --no-loadscope-reorder` (scripts/test.sh) the workers take
# files in this order, longest first, so the two workers finish together (their totals within seconds of each other
# in a simulation over that run's durations; the order before left them a minute apart); xdist's own order (most
# tests first) started the slowest files (test_readme, test_bundled, test_sharding: a few long tests each) last.
SLOW_FILES_FIRST = (
    "test_sts.py", "test_readme.py", "test_sharding.py", "test_bench_model.py", "test_tsa.py", "test_butler.py",
    "test_methods.py", "test_sharding_sts.py", "test_evosparse_select_kernel.py", "test_topk_select_gpu.py",
    "test_kascade_blocks.py", "test_stacked_decode.py", "test_block_scores.py", "test_head_probs.py",
    "test_evosparse.py", "test_kascade_anchor.py", "test_anchor_attention.py", "test_bundled.py", "test_cli.py",
    "test_train.py", "test_speculative.py", "test_kascade_segments.py", "test_evosparse_branchless.py",
    "test_eval_continuation.py", "test_sparse_attention.py", "test_generate.py", "test_eval_sts.py",
    "test_fused_params.py", "test_parity_hf.py", "test_anchor_mgpu.py", "test_eval_sweep.py",
    "test_local_attention.py", "test_logit_mse.py", "test_sliding_window.py", "test_kv_write.py",
    "test_recipe_time.py", "test_topk_select.py", "test_tasks.py", "test_sparse_prefill_mgpu.py", "test_eval.py",
    "test_tsa_scoring.py", "test_api_edges.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
