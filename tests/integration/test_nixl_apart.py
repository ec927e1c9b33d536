"""The tests parametrized over the nixl transport, in a pytest process of their own
(tests/conftest.py `NIXL_APART`): transfers, the disaggregated hand-off, TP head re-sharding,
the KV tier's offload and fetch, and the link cut across namespaces, each over NIXL. Their
NIXL agents run in that process, never in a worker of the main suite: this module does not
even load NIXL (it asks only whether the package is installed), because NIXL's wheel carries its
own gRPC and protobuf libraries, and a process holding them segfaults later when grpc_tools'
protoc compiler is imported (tests/unit/test_proto_generated.py, which now runs it apart too)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.nixl import MODULES as NIXL_MODULES

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("test_kvfabric_transfer", "test_disaggregated_kv", "test_tensor_parallel_kv", "test_kv_tier",
           "test_separate_hosts")

pytestmark = pytest.mark.timeout(900)


def test_the_nixl_variants_pass_in_a_process_of_their_own() -> None:
    if not any(importlib.util.find_spec(name) for name in NIXL_MODULES):
        pytest.skip(f"NIXL is not installed ({', '.join(NIXL_MODULES)}): pip install nixl-cu12")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-k", "nixl",
                        "-rfEs", *(f"tests/integration/{m}.py" for m in MODULES)], cwd=ROOT,
                       env={**os.environ, "SPLITSERVE_TEST_NIXL": "1"}, capture_output=True, text=True, timeout=840)
    out = r.stdout + r.stderr
    # pytest's summary line, read as pytest wrote it: UCX logs lines such as "connect ... failed:
    # Connection refused" in between when a killed-peer test's peer is gone
    summary = ([line for line in out.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s", line)]
               or [""])[-1]
    assert r.returncode == 0 and re.search(r"\d+ passed", summary), out[-6000:]
    assert "skipped" not in summary or os.geteuid() != 0, out[-3000:]  # as root, the namespaces' too
