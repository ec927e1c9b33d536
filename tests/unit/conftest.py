"""Unit tests never start Ray: any ray.init under tests/unit/ raises."""
from __future__ import annotations

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
