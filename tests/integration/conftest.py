"""Fixtures for the integration tests: the Ray node a module's clusters run on, and a Generation
stub on the module's own `cluster` fixture."""
from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cluster.local import LocalCluster
from proto import generate_pb2_grpc as pb_grpc
from tests.integration.cluster_checks import join_shared_node, leave_shared_node


@pytest.fixture(scope="module", autouse=True)
def ray_node(request: pytest.FixtureRequest) -> None:
    """A module that sets `SHARES_RAY_NODE = True` runs its clusters on this test process's
    shared Ray node (`join_shared_node`); every other module runs with none up: its clusters
    start a node of their own (LocalCluster's, offering exactly its pools' resources), and
    its tests may count on no Ray in this process."""
    if getattr(request.module, "SHARES_RAY_NODE", False):
        join_shared_node()
    else:
        leave_shared_node()


@pytest.fixture(scope="module")
def stub(cluster: LocalCluster) -> Iterator[pb_grpc.GenerationStub]:
    """One channel to the module's cluster (a module defining `cluster` gets it; it may define its own)."""
    with grpc.insecure_channel(cluster.address) as channel:
        yield pb_grpc.GenerationStub(channel)
