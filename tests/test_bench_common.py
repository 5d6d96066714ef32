"""eval.bench.common's timing helpers and the commit a benchmark JSON names."""

import json
import os
import subprocess
import time
import types

import jax.numpy as jnp

from eval.bench.common import pipelined_ms, time_ms
from jsparse.provenance import source_commit


def _sleeper(calls, ms):
    def fn(x):
        calls.append(1)
        time.sleep(ms / 1e3)
        return x + 1
    return fn


def test_pipelined_ms_calls_warmup_plus_n_times_and_averages_over_n():
    calls = []
    got = pipelined_ms(_sleeper(calls, 2.0), (jnp.ones(3),), n=5, warmup=2)
    assert len(calls) == 7
    assert 2.0 <= got < 50.0


def test_time_ms_is_the_median_of_blocked_calls():
    calls = []
    got = time_ms(_sleeper(calls, 2.0), jnp.ones(3), warmup=1, iters=4)
    assert len(calls) == 5
    assert 2.0 <= got < 50.0


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


def test_an_installed_jsparse_records_its_version_not_a_surrounding_repository(tmp_path, monkeypatch):
    """jsparse installed in a venv that lies inside another git repository recorded that repository's commit as
    its own; now a jsparse that does not run from the top of a checkout records its installed version (or the
    commit pip recorded for a git+ install)."""
    from jsparse import provenance

    monkeypatch.delenv("GIT_COMMIT", raising=False)
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
    assert installed.startswith("jsparse 0.1.0") or len(installed) == 40
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
