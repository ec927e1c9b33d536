"""A short abort storm (benchmarks/hostile/abort_storm.py runs the long one): requests through a real
cluster, each cancelled by its client at a random moment (queued, prefilling, at the first
token, mid-decode, or never). Afterwards nothing is held anywhere and the workers added no shm
segment to their KV pools."""
from __future__ import annotations

import asyncio
import os

import pytest

from benchmarks.hostile.abort_storm import EXPECTED_CODES, storm, storm_cluster, worker_pids
from cluster.local import LocalCluster
from kvfabric.region import segments_of
from tests.integration.cluster_checks import assert_idle

SHARES_RAY_NODE = True  # its clusters run on the test process's shared Ray node (tests/integration/conftest.py)

pytestmark = pytest.mark.timeout(600)


def test_an_abort_storm_leaves_nothing_held(tiny_llama_dir: str) -> None:
    with LocalCluster(storm_cluster(tiny_llama_dir)) as cluster:
        pids = worker_pids(cluster)
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [0] * len(pids)  # not Ray's niceness 15
        shm_before = segments_of(pids)
        assert shm_before  # the decode workers' KV pools
        result = asyncio.run(storm(cluster.address, num_requests=400, concurrency=32, seed=1))
        assert sum(result.sent.values()) == sum(result.ended.values()) == 400
        assert set(result.ended) <= EXPECTED_CODES, result.ended
        assert result.ended["OK"] >= 40 and result.ended["CANCELLED"] >= 200, result.ended
        assert_idle(cluster, timeout_s=30)
        assert segments_of(pids) == shm_before
        stats = cluster.router_stats()[0]
        assert stats["num_admitted"] == stats["num_queued"] == stats["inflight_tokens"] == 0
