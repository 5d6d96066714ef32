"""Imports run one way: no cycle among the modules of jsparse, models, pallas_kernels, train and eval, and no
import from a lower layer to a higher one (pallas_kernels < models < jsparse < train, eval < jsparse.cli; see
tests/import_graph.py). The checker itself is tested on small synthetic packages that break each rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from import_graph import PACKAGES, cycles, import_graph, layer, upward_imports

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT)


def test_graph_covers_every_package(graph):
    for pkg in PACKAGES:
        assert pkg in graph, f"package {pkg} not found under {ROOT}"
    assert len(graph) > 50
    # Spot checks that lazy (function-level) and `from pkg import module` imports are seen.
    assert "jsparse.methods" in graph["jsparse.api"]
    assert "eval.harness" in graph["eval.cli_eval"] or any(m.startswith("eval.") for m in graph["eval.cli_eval"])


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (each list is a set of modules importing each other in a ring):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)


def test_no_upward_imports(graph):
    found = upward_imports(graph)
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, b in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_a_synthetic_cycle(tmp_path):
    """A three-module ring through a lazy import and a relative import, and a clean sibling."""
    _write(tmp_path, {
        "models/__init__.py": "",
        "models/a.py": "from models.b import f\n",
        "models/b.py": "def f():\n    from . import c\n",
        "models/c.py": "import models.a\n",
        "models/d.py": "from models import a\n",
    })
    graph = import_graph(tmp_path, packages=("models",))
    assert graph["models.b"] == {"models.c"}
    assert graph["models.d"] == {"models.a"}
    assert cycles(graph) == [["models.a", "models.b", "models.c"]]
    assert upward_imports(graph) == []


def test_checker_finds_a_cycle_through_a_package_init(tmp_path):
    """The issue's shape: api -> methods (its __init__ imports calib) -> calib -> api."""
    _write(tmp_path, {
        "jsparse/__init__.py": "",
        "jsparse/api.py": "from jsparse.methods import make\n",
        "jsparse/methods/__init__.py": "from jsparse.methods import calib\ndef make(): pass\n",
        "jsparse/methods/calib.py": "def run():\n    from jsparse.api import fingerprint\n",
    })
    found = cycles(import_graph(tmp_path, packages=("jsparse",)))
    assert found == [["jsparse.api", "jsparse.methods", "jsparse.methods.calib"]]


def test_checker_finds_an_upward_import(tmp_path):
    _write(tmp_path, {
        "pallas_kernels/__init__.py": "",
        "pallas_kernels/k.py": "import numpy\n",
        "models/__init__.py": "",
        "models/m.py": "from pallas_kernels import k\nfrom jsparse.cli import FLAGS\n",
        "jsparse/__init__.py": "",
        "jsparse/cli.py": "from models import m\nFLAGS = 1\n",
    })
    graph = import_graph(tmp_path, packages=("pallas_kernels", "models", "jsparse"))
    # Importing jsparse.cli also runs jsparse/__init__.py: both are above models.
    assert upward_imports(graph) == [("models.m", "jsparse"), ("models.m", "jsparse.cli")]
    assert cycles(graph) == [["jsparse.cli", "models.m"]]
