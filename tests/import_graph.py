"""The import graph of the project's packages, read from the source with `ast` (nothing is imported), and the two
rules it must keep: no cycle, and no import from a lower layer to a higher one.

Every `import`/`from ... import` counts, at module level or inside a function (a lazy import still closes a cycle
when it runs). Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`, so those are edges too, except
the importer's own ancestors (already being imported when it runs). Only modules of the given packages are nodes.

Layers, lowest first (an import may go down or sideways, never up):
  0 pallas_kernels   1 models   2 jsparse (the library)   3 train, eval   4 jsparse.cli and jsparse.__main__ (the
  command)
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("pallas_kernels", "models", "jsparse", "train", "eval")
LAYERS = {"pallas_kernels": 0, "models": 1, "jsparse": 2, "train": 3, "eval": 3, "jsparse.cli": 4, "jsparse.__main__": 4}


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under root/<package> (a package is its __init__)."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _is_package(name: str, files: dict[str, Path]) -> bool:
    return name in files and files[name].name == "__init__.py"


def imports_of(name: str, file: Path, files: dict[str, Path]) -> set[str]:
    """The project modules that running `file` (module `name`) imports, with the package __init__s they run."""
    tree = ast.parse(file.read_text(), filename=str(file))
    package = name if _is_package(name, files) else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets.add(mod)
            for a in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                if f"{mod}.{a.name}" in files:
                    targets.add(f"{mod}.{a.name}")
    own_ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out = set()
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in files and prefix not in own_ancestors and prefix != name:
                out.add(prefix)
    return out


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: the project modules it imports} for every module of `packages` under root."""
    files = module_files(root, packages)
    return {name: imports_of(name, f, files) for name, f in files.items()}


def layer(name: str) -> int:
    """The layer of a module: the longest entry of LAYERS that is the module or a package holding it."""
    best, rank = "", None
    for prefix, r in LAYERS.items():
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best, rank = prefix, r
    if rank is None:
        raise ValueError(f"module {name!r} is in no layer of {sorted(LAYERS)}")
    return rank


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), each sorted:
    every import cycle lies inside one of them. Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1 or node in graph.get(node, ()):
                        out.append(sorted(comp))
    return sorted(out)
