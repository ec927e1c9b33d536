"""Checks on a running LocalCluster that several test modules share."""
from __future__ import annotations

import time

from cluster.local import LocalCluster


def assert_idle(cluster: LocalCluster, timeout_s: float = 15.0) -> None:
    """Within `timeout_s` the cluster holds nothing for any request (`LocalCluster.holdings`)."""
    deadline = time.monotonic() + timeout_s
    while held := cluster.holdings():
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle {timeout_s} s after the test: {held}")
        time.sleep(0.2)
