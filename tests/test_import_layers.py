"""The package's import graph has no cycle, and no layer imports a layer above it.

Layers, lowest first; a module imports its own layer and those below:

    contracts  mirrorsd.*           errors, names, manifest, ONNX wire format, flags, output folders, weights, ...
    devices    mirrorsd.devices.*   probing, placement, sessions, the kernels library
    runtime    mirrorsd.runtime.*   the decoding core, the planner (runtime/planner), the libmirrorsd binding
    export     mirrorsd.export.*    torch-side export (checks what it writes with runtime sessions)
    apps       mirrorsd.apps.*      CLI, plan, bench, peers; mirrorsd.__main__ is the package's entry point

Every import counts, at module level or inside a function (a lazy import is still a seam). Read from the source
with ast, so nothing is imported.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("contracts", "devices", "runtime", "export", "apps")


def layer(module: str) -> int:
    parts = module.split(".")
    if module == "mirrorsd.__main__" or parts[1:2] == ["apps"]:
        return LAYERS.index("apps")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS[1:4] else 0


def package_modules() -> dict[str, Path]:
    """Dotted module name -> source file, from pyproject's package-dir map (the repository keeps its own folders)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[str, Path] = {}
    dirs = config["package-dir"]
    for package in config["packages"]:
        mapped = max((key for key in dirs if package == key or package.startswith(key + ".")), key=len)
        folder = ROOT / dirs[mapped] / package[len(mapped):].lstrip(".").replace(".", "/")
        for path in folder.glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:  # a name inside a module -> that module
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a circle (strongly connected, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


pytestmark = pytest.mark.skipif(tomllib is None, reason="reads pyproject.toml with tomllib (Python 3.11+)")


def test_the_modules_are_found():
    modules = package_modules()
    for name in ("mirrorsd.errors", "mirrorsd.devices.kernels", "mirrorsd.runtime.planner.auto", "mirrorsd.apps.cli",
                 "mirrorsd.export.graphs.exit_head"):
        assert name in modules
    assert sum(len(targets) for targets in import_graph(modules).values()) > 100


def test_no_import_cycle():
    assert cycles(import_graph(package_modules())) == []


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_layer_imports_one_above_it():
    graph = import_graph(package_modules())
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))
    assert upward == []
