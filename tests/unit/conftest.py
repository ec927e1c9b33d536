"""Unit tests never start Ray: any ray.init under tests/unit/ raises. `kernels`: the native
CPU kernels, built once per session."""
from __future__ import annotations

import os
import shutil
import sys
import types

import pytest


def _refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("unit tests must not start Ray; move this test to tests/integration/")


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import ray
    except ImportError:
        ray = types.ModuleType("ray")
        monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setattr(ray, "init", _refuse, raising=False)


@pytest.fixture(scope="session")
def kernels():  # type: ignore[no-untyped-def]
    """engine.native's kernels. Skips without a C compiler; fails, not skips, when one is on
    PATH and the build still does not load."""
    from engine import native

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on PATH: the native kernels can't be built here")
    k = native.load()
    assert k is not None, "a C compiler is on PATH but the native kernels did not build (see the log)"
    return k
