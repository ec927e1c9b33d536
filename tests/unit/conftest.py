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


@pytest.fixture(autouse=True)
def _two_threads_for_the_kernels(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The native kernels split their work over torch's thread count: their tests run on two
    threads (the suite's processes run on one, tests/conftest.py), so the splits are checked."""
    if "kernels" not in request.fixturenames:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def kernels():  # type: ignore[no-untyped-def]
    """engine.kernels.native's kernels. Skips without a C compiler; fails, not skips, when one is on
    PATH and the build still does not load."""
    from engine.kernels import native

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on PATH: the native kernels can't be built here")
    k = native.load()
    assert k is not None, "a C compiler is on PATH but the native kernels did not build (see the log)"
    return k
