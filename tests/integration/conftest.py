"""Fixtures for the integration tests: a Generation stub on the module's own `cluster` fixture."""
from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cluster.local import LocalCluster
from proto import generate_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(cluster: LocalCluster) -> Iterator[pb_grpc.GenerationStub]:
    """One channel to the module's cluster (a module defining `cluster` gets it; it may define its own)."""
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)
