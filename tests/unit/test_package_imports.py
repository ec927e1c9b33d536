"""The package graph docs/architecture.md draws, read from the code (every import, lazy ones
inside functions too): no loop between packages, the roles never import each other or
`cluster`, and nothing below `cluster` imports it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proto", "router", "prefill_worker", "decode_worker", "control", "engine", "kvfabric", "kvstore", "cluster",
            "sim", "loadgen")


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != package:
                        graph[package].add(top)
    return graph


def test_no_package_imports_itself_back() -> None:
    graph = package_graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    loops = sorted(p for p in PACKAGES if p in reach(p))
    assert loops == [], {p: sorted(graph[p]) for p in loops}


def test_the_roles_and_the_layers_below_them_import_what_the_design_says() -> None:
    graph = package_graph()
    roles = {"router", "prefill_worker", "decode_worker"}
    for role in roles:
        assert not graph[role] & (roles | {"cluster", "sim", "loadgen"}), (role, sorted(graph[role]))
    for below in ("engine", "kvfabric", "control", "proto"):
        assert not graph[below] & (roles | {"cluster", "sim", "loadgen"}), (below, sorted(graph[below]))
    assert "kvfabric" not in graph["engine"] and not graph["kvfabric"] - {"engine"}, (graph["engine"], graph["kvfabric"])
    assert not graph["kvstore"] & (roles | {"cluster", "sim", "loadgen"}), sorted(graph["kvstore"])
    assert "kvstore" not in graph["engine"] | graph["kvfabric"] | graph["control"], "a layer below the tier imports it"
    assert [p for p in PACKAGES if "cluster" in graph[p]] == []


def test_every_package_is_installed() -> None:
    """What `pip install .` ships (pyproject's packages) is every package of the project: one
    left out works from the checkout and fails where splitserve is installed (a `ray up` host)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    top = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    found = {".".join(p.parent.relative_to(ROOT).parts) for t in top for p in (ROOT / t).rglob("__init__.py")}
    assert found == listed and top == set(PACKAGES), (sorted(found - listed), sorted(listed - found))
