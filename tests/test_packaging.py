"""A wheel of the project (what `pip install .` or `pip install git+...` installs, not the editable install of
scripts/setup.sh) holds what the code reads at run time: the shipped artifacts and the eval texts, found from any
working directory; and not the committed results."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = {".git", ".venv", "build", "runs", "tests", "dist", "results", "__pycache__"}


def _copy_tree(dst: str) -> None:
    """The repository without its venv, git, tests and committed results (a build writes build/ in its source)."""
    shutil.copytree(ROOT, dst, ignore=lambda d, names: [n for n in names if n in _SKIP or n.endswith(".egg-info")])


def test_the_wheel_holds_the_shipped_artifacts_and_eval_texts_and_finds_them_anywhere(tmp_path):
    src, dist, site, cwd = (tmp_path / n for n in ("src", "dist", "site", "elsewhere"))
    _copy_tree(str(src))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("jsparse-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    needed = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
              for top in ("jsparse/shipped", "eval/data") for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs}
    assert {"jsparse/shipped/smollm2/kascade/arrays.npz", "eval/data/call_of_the_wild.txt"} <= needed
    assert needed <= names, f"not in the wheel: {sorted(needed - names)}"
    assert not [n for n in names if n.startswith("eval/results/")]
    assert any(n.endswith("licenses/LICENSE") for n in names)
    # The installed copy, from a folder outside it: relative shipped paths resolve where jsparse is installed.
    cwd.mkdir()
    script = (
        "import os, jsparse, eval.ppl as ppl\n"
        "from jsparse.artifacts import load_artifact\n"
        f"assert jsparse.__file__.startswith({str(site)!r}), jsparse.__file__\n"
        "art = load_artifact('jsparse/shipped/smollm2/kascade', 'kascade')\n"
        "assert jsparse.shipped_artifact('tsa').startswith(os.path.join(os.path.dirname(jsparse.__path__[0]), 'jsparse'))\n"
        "assert os.path.isfile(ppl.DEFAULT_CORPUS) and os.path.isfile(ppl.DEV_CORPUS)\n"
        "print('ok', art.kind)\n")
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok kascade" in out.stdout, out.stderr[-2000:]
