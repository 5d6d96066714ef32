"""eval.bench.common's timing helpers and the commit a benchmark JSON names."""

import json
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval.bench import common
from jsparse.provenance import source_commit


class _FakeDevice:
    """A clock (seconds) for eval.bench.common's `time`: each call costs the host 1 ms to issue and queues `work`
    ms on a device that runs one call at a time; blocking on a result waits until the device has finished it."""

    def __init__(self, work_ms):
        self.now, self.free_at, self.work = 0.0, 0.0, list(work_ms)
        self.perf_counter = lambda: self.now

    def __call__(self, x):
        self.now += 1e-3
        self.free_at = max(self.now, self.free_at) + self.work.pop(0) * 1e-3
        dev = self

        class Pending:
            def block_until_ready(self, done=self.free_at):
                dev.now = max(dev.now, done)
                return self
        return Pending()


def test_time_ms_is_the_median_of_blocked_calls_on_a_fake_clock(monkeypatch):
    """Each blocked call takes 1 ms to issue plus its device time: 1 ms warmup, then 1, 1, 1, 100 ms of work: the
    median of (2, 2, 2, 101) is 2 ms (not the mean, 26.75; not 1 ms, the issue time alone)."""
    dev = _FakeDevice([1, 1, 1, 1, 100])
    monkeypatch.setattr(common, "time", dev)
    assert common.time_ms(dev, 0, warmup=1, iters=4) == pytest.approx(2.0)
    assert dev.work == []


def test_pipelined_ms_blocks_once_and_excludes_the_warmup_on_a_fake_clock(monkeypatch):
    """2 blocked warmup calls (3 ms each, not timed), then n = 4 calls of 2 ms device work issued 1 ms apart and
    blocked on once: the device is busy from 1 ms to 9 ms, so 9 / 4 ms a call (blocking on every call: 3 ms)."""
    dev = _FakeDevice([2] * 6)
    monkeypatch.setattr(common, "time", dev)
    assert common.pipelined_ms(dev, (0,), n=4, warmup=2) == pytest.approx(9 / 4)
    assert dev.work == []


def test_command_line_of_a_script_run_quotes_its_arguments(monkeypatch):
    """Run as a script (no `jsparse bench` COMMAND), the command is `python` + argv, shell-quoted so that it can be
    pasted back."""
    monkeypatch.setattr(common, "COMMAND", None)
    monkeypatch.setattr(sys, "argv", ["eval/bench/model.py", "--out", "my results/x.json", "--methods", "a;b"])
    assert common.command_line() == "python eval/bench/model.py --out 'my results/x.json' --methods 'a;b'"


def test_out_path_of_a_bare_file_name_and_write_json_into_a_new_folder(tmp_path, monkeypatch):
    """`--out x.json` (every benchmark's default is a bare name in the current folder) is that file; write_json
    creates the folder it writes in."""
    monkeypatch.chdir(tmp_path)
    assert common.out_path("x.json", "d.json") == "x.json"
    rec = {"device": "cpu", "jax": "0", "date": "d", "commit": "c", "command": "jsparse bench x", "rows": [1]}
    common.write_json(str(tmp_path / "a" / "b" / "r.json"), rec)
    assert json.loads((tmp_path / "a" / "b" / "r.json").read_text()) == rec


def test_table_is_markdown_with_missing_values_as_a_dash():
    assert common.table([{"a": 1.234567, "b": None}, {"a": 2, "b": "x", "c": 3}], ["a", "b"]) == (
        "| a | b |\n|---|---|\n| 1.235 | - |\n| 2 | x |")
    assert common.table([{"a": 12345.6}], ["a", "z"]).splitlines()[2] == "| 1.235e+04 | - |"


def _dense_decode_f64(q, k, v, lengths):
    """q [B, 1, Hq, D], k, v [B, Hkv, N, D]: softmax(q k / sqrt(D)) v over the first lengths[b] tokens, query head h
    reading kv head h // (Hq // Hkv), in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, _, hq, d = q.shape
    g = hq // k.shape[1]
    o = np.zeros((b, 1, hq, d))
    for i in range(b):
        for h in range(hq):
            L = int(lengths[i])
            s = k[i, h // g, :L] @ q[i, 0, h] / math.sqrt(d)
            p = np.exp(s - s.max())
            o[i, 0, h] = p / p.sum() @ v[i, h // g, :L]
    return o


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_dense_einsum_decode_matches_a_float64_reference(dtype, tol):
    """The dense XLA baseline that `jsparse bench attention`/`sparse_attention` time: GQA (4 query heads on 2 kv
    heads, query head h on kv head h // 2), scaled by 1/sqrt(D), the tokens at and past `lengths` masked, in q's
    dtype."""
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (2, 1, 4, 8), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (2, 2, 16, 8), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (2, 2, 16, 8), jnp.float32).astype(dtype)
    lengths = jnp.array([16, 5], jnp.int32)
    o = common.dense_einsum_decode(q, k, v, lengths)
    assert o.dtype == jnp.dtype(dtype) and o.shape == (2, 1, 4, 8)
    np.testing.assert_allclose(np.asarray(o, np.float64), _dense_decode_f64(q, k, v, lengths), rtol=tol, atol=tol)


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    """HEAD's hash, "-dirty" once a tracked file differs from it, $GIT_COMMIT over both, "unknown" outside a repo;
    by default the checkout this code runs from, not the working directory's (a JSON written from inside another
    repository recorded that repository's commit)."""
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert source_commit(str(tmp_path)) == "unknown"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert source_commit().split("-")[0] == subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], check=True,
                                                        capture_output=True, text=True).stdout.strip()
    git = lambda *a: subprocess.run(["git", *a], check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    root = str(tmp_path)
    assert source_commit(root) == head
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files do not make the run another commit's code
    assert source_commit(root) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert source_commit(root) == head + "-dirty"
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert source_commit(root) == "abc1234"


def _installed_as(monkeypatch, version: str):
    """jsparse's distribution metadata as pip leaves it for a wheel of `version` (no direct_url.json), whatever this
    environment has: the suite also runs from a tree on PYTHONPATH, with no jsparse installed (the GPU host)."""
    from importlib import metadata

    real = metadata.distribution
    fake = types.SimpleNamespace(version=version, read_text=lambda name: None)
    monkeypatch.setattr(metadata, "distribution", lambda name: fake if name == "jsparse" else real(name))


def test_an_installed_jsparse_records_its_version_not_a_surrounding_repository(tmp_path, monkeypatch):
    """jsparse installed in a venv that lies inside another git repository recorded that repository's commit as
    its own; now a jsparse that does not run from the top of a checkout records its installed version (or the
    commit pip recorded for a git+ install)."""
    from jsparse import provenance

    monkeypatch.delenv("GIT_COMMIT", raising=False)
    _installed_as(monkeypatch, "0.1.0")
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    site = tmp_path / "venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    monkeypatch.setattr(provenance, "INSTALL_ROOT", str(site))
    installed = provenance.installed_version()
    assert installed == "jsparse 0.1.0 (installed; commit unknown)"
    assert provenance.source_commit() == installed != git("rev-parse", "HEAD")
    monkeypatch.setattr(provenance, "INSTALL_ROOT", str(tmp_path))  # the top of a checkout: its HEAD
    assert provenance.source_commit() == git("rev-parse", "HEAD")
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert provenance.source_commit() == "abc1234"


def test_source_commit_of_a_subfolder_and_of_an_install_outside_any_repository(tmp_path, monkeypatch):
    """An explicit root inside a checkout records that checkout's HEAD; jsparse installed outside any repository
    records its installed version (not "unknown")."""
    from jsparse import provenance

    monkeypatch.delenv("GIT_COMMIT", raising=False)
    _installed_as(monkeypatch, "0.1.0")
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    git("init", "-q")
    (repo / "sub" / "f.py").write_text("a = 1\n")
    git("add", "sub/f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert source_commit(str(repo / "sub")) == git("rev-parse", "HEAD")
    site = tmp_path / "venv" / "lib" / "site-packages"  # no repository around it
    site.mkdir(parents=True)
    monkeypatch.setattr(provenance, "INSTALL_ROOT", str(site))
    assert provenance.source_commit() == provenance.installed_version() != "unknown"


def test_installed_version_reads_the_commit_pip_recorded(monkeypatch):
    """A `git+` install: direct_url.json's vcs_info.commit_id; without it (or a direct_url.json that is not an
    object) the version."""
    from importlib import metadata

    from jsparse import provenance

    def dist(text):
        return types.SimpleNamespace(version="9.9", read_text=lambda name: text if name == "direct_url.json" else None)

    for text, want in ((json.dumps({"url": "git+https://x", "vcs_info": {"vcs": "git", "commit_id": "c0ffee"}}),
                        "c0ffee"),
                       (json.dumps({"url": "file:///x"}), "jsparse 9.9 (installed; commit unknown)"),
                       ("[1]", "jsparse 9.9 (installed; commit unknown)"),
                       (None, "jsparse 9.9 (installed; commit unknown)")):
        monkeypatch.setattr(metadata, "distribution", lambda name, t=text: dist(t))
        assert provenance.installed_version() == want, text
