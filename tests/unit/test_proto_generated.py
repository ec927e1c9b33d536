"""The generated gRPC code is exactly what proto/regen.py writes from generate.proto."""
from __future__ import annotations

from proto import regen


def test_generated_code_is_current() -> None:
    assert regen.stale_files() == [], "run ./dev python -m proto.regen and commit the result"
