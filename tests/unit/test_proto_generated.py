"""The generated gRPC code is exactly what proto/regen.py writes from generate.proto.

The check runs in a process of its own: grpc_tools' protoc compiler links its own protobuf, and
importing it into a process that has loaded NIXL (whose wheel bundles another libprotobuf and
gRPC) segfaults; an xdist worker that had run a NIXL test died here."""
from __future__ import annotations

import subprocess
import sys

from proto.regen import ROOT


def test_generated_code_is_current() -> None:
    r = subprocess.run([sys.executable, "-m", "proto.regen", "--check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr + "\nrun ./dev python -m proto.regen and commit the result"
