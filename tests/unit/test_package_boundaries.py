"""The package boundaries the design holds: the router process loads no torch, nor does the
controller's or the command line's (only a worker's process computes); the roles import
neither each other nor `cluster`; the control plane below them is torch-free."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("router", "prefill_worker", "decode_worker")


def test_the_router_process_imports_no_torch() -> None:
    code = ("import sys, router.service, control.reader, control.worker_host; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine.model.decoder', "
            "'engine.llm_engine', 'prefill_worker', 'decode_worker', 'cluster'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_controller_and_the_command_line_import_no_torch() -> None:
    """The controller imports both worker classes to create their actors: their modules load
    torch and the engine only when a worker is made (each cluster start once paid ~2.6
    CPU-seconds and ~180 MB for it in the controller, and again in `serve`'s process)."""
    code = ("import sys, cluster.controller, cluster.local, cluster.cli; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine.model.decoder', "
            "'engine.llm_engine', 'engine.engine_loop', 'kvstore.tier'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def imported_packages(package: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_neither_another_role_nor_cluster(role: str) -> None:
    others = {*ROLES, "cluster"} - {role}
    assert imported_packages(role) & others == set()


def test_the_control_plane_imports_no_role_and_no_torch() -> None:
    assert imported_packages("control") & {*ROLES, "cluster", "torch"} == set()


ENGINE_INSIDES = ("kv", "kv_pool", "block_pool", "kv_shards", "follower_pools")
"""An engine's pool, block pool, cache manager and ranks' pools: only engine/ touches them."""


@pytest.mark.parametrize("package", [*ROLES, "kvstore", "kvfabric", "control"])
def test_kv_movers_reach_the_engines_blocks_only_through_its_connector(package: str) -> None:
    """The P/D hand-off and the KV tier borrow, reserve and return blocks through
    `LLMEngine.connector` (engine/kv_connector.py), never by the engine's own attributes."""
    reached = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES and isinstance(node.value, ast.Name) \
                    and node.value.id in ("e", "engine", "self.engine"):
                reached.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES and isinstance(node.value, ast.Attribute) \
                    and node.value.attr in ("engine", "_engine"):
                reached.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.value.attr}.{node.attr}")
    assert reached == []
