"""Which jsparse produced a result: the commit results and benchmark JSONs record (`source_commit`)."""

from __future__ import annotations

import json
import os
import subprocess

# The folder the jsparse package sits in: a clone's root (the editable install), or site-packages.
INSTALL_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def installed_version() -> str:
    """An installed jsparse (a wheel, not a checkout): the commit pip recorded for a `git+` install
    (direct_url.json's vcs_info), else "jsparse VERSION (installed; commit unknown)"."""
    from importlib import metadata

    try:
        dist = metadata.distribution("jsparse")
    except metadata.PackageNotFoundError:
        return "unknown"
    try:
        commit = (json.loads(dist.read_text("direct_url.json") or "{}").get("vcs_info") or {}).get("commit_id")
    except (ValueError, AttributeError):
        commit = None
    return commit or f"jsparse {dist.version} (installed; commit unknown)"


def source_commit(root: str | None = None) -> str:
    """$GIT_COMMIT, else HEAD's hash of the checkout at `root` with "-dirty" when tracked files differ from it (the
    code that ran was not that commit's: an uncommitted edit, or a copied tree whose .git is older than its files),
    else "unknown".

    root None: the checkout this code runs from, whatever the working directory; when jsparse does not run from the
    top of a checkout (installed in site-packages, perhaps inside a venv within another repository, whose commit
    would be the wrong one), `installed_version()`."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    here = root is None
    root = INSTALL_ROOT if here else root

    def run(*a):
        return subprocess.check_output(["git", "-C", root, *a], text=True, stderr=subprocess.DEVNULL,
                                       timeout=30).strip()

    try:
        if here and os.path.realpath(run("rev-parse", "--show-toplevel")) != os.path.realpath(root):
            return installed_version()
        head = run("rev-parse", "HEAD")
        return head + ("-dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return installed_version() if here else "unknown"
