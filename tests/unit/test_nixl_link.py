"""kvfabric/nixl.py `NixlLink` with the agents and ranks' posters stood in for (NIXL itself
runs in tests/integration/test_nixl_apart.py's process): each piece of heads is written from
its source rank (this process's agent, or the rank's own through its `RankClient`) into the
agent that holds its destination rank's pool, and settling waits for both kinds of writes."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvfabric.errors import PeerUnavailable
from kvfabric.layout import FabricLayout, HeadMap, Run
from kvfabric.nixl import NixlLink, Posted

SPLIT = FabricLayout("m", "float32", num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype_bytes=4,
                     model_kv_heads=2, shards=(0, 1))
BB = SPLIT.block_bytes


class Nixl:
    """This process's NIXL agent's calls: every write posted, each DONE at its first check."""

    def __init__(self) -> None:
        self.posted: list[tuple[np.ndarray, np.ndarray, str]] = []

    def get_xfer_descs(self, descs: np.ndarray, kind: str) -> np.ndarray:
        return descs

    def initialize_xfer(self, op: str, src: np.ndarray, dst: np.ndarray, remote: str) -> object:
        self.posted.append((src, dst, remote))
        return SimpleNamespace(release=lambda: None)

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"


class Agent:
    kind = "DRAM"

    def __init__(self, pools: list[tuple[int, int, int]]) -> None:
        self.pools, self.nixl, self.calls = pools, Nixl(), threading.Lock()
        self.pacer = SimpleNamespace(begin=lambda n=1: None, end=lambda n=1: None)
        self.added: list[bytes] = []
        self.dropped: list[str] = []

    def add_remote(self, metadata: bytes) -> str:
        self.added.append(metadata)
        return "here:" + metadata.decode()

    def drop_remote(self, name: str) -> None:
        self.dropped.append(name)

    def live(self) -> Nixl:
        return self.nixl


class Client:
    """A further rank's poster: its writes in flight until `checks` say otherwise."""

    def __init__(self, checks: list[str]) -> None:
        self.checks, self.writes, self.added, self.released, self.dropped = checks, [], [], [], []

    def add_remote(self, metadata: bytes) -> str:
        self.added.append(metadata)
        return "rank1:" + metadata.decode()

    def write(self, remote: str, src: np.ndarray, dst: np.ndarray) -> int:
        self.writes.append((remote, src, dst))
        return len(self.writes)

    def check(self, hid: int) -> str:
        state = self.checks.pop(0)
        if state == "ERR":
            raise PeerUnavailable("tensor-parallel rank's poster: the write failed")
        return state

    def release(self, hids: list[int]) -> None:
        self.released.extend(hids)

    def drop_remote(self, name: str) -> None:
        self.dropped.append(name)


def link(client: Client) -> tuple[NixlLink, Agent]:
    agent = Agent([(0x1000_0000, 8 * BB, 0)])  # rank 0's pool, here
    heads = HeadMap.between(SPLIT, SPLIT)
    receiver_pools = [(0x9000_0000, 8 * BB, 0), (0xA000_0000, 8 * BB, 0)]
    return NixlLink(agent, b"rx", receiver_pools, heads, [b"", b"rx-rank1"], [None, client],
                    [agent.pools[0], (0x2000_0000, 8 * BB, 0)]), agent


def test_each_piece_goes_from_its_ranks_agent_to_the_agent_holding_its_destination() -> None:
    client = Client(["PROC", "DONE"])
    nixl_link, agent = link(client)
    assert agent.added == [b"rx", b"rx-rank1"] and client.added == [b"rx", b"rx-rank1"]
    assert nixl_link.remotes == ["here:rx", "here:rx-rank1"]
    posted = Posted()
    nixl_link.post(posted, [Run(0, 2, 5, 3)])  # blocks 2..4 -> the reservation's 5..7
    [(src, dst, remote)] = agent.nixl.posted  # rank 0's heads: from here, to the receiver's own agent
    assert remote == "here:rx" and src.tolist() == [[0x1000_0000 + 2 * BB, 3 * BB, 0]]
    assert dst.tolist() == [[0x9000_0000 + 5 * BB, 3 * BB, 0]]
    [(remote, src, dst)] = client.writes  # rank 1's: posted by rank 1, to the receiver's rank 1's agent
    assert remote == "rank1:rx-rank1" and src.tolist() == [[0x2000_0000 + 2 * BB, 3 * BB, 0]]
    assert dst.tolist() == [[0xA000_0000 + 5 * BB, 3 * BB, 0]]
    assert posted.ranks == [(1, 1)] and len(posted.handles) == 1
    nixl_link.settle(posted, timeout_s=5)  # the rank said PROC, then DONE
    assert posted.handles == [] and posted.ranks == [] and client.checks == []
    nixl_link.close()
    assert agent.dropped == ["here:rx", "here:rx-rank1"] and client.dropped == ["rank1:rx", "rank1:rx-rank1"]


def test_a_ranks_failed_write_fails_the_transfer_and_releases_what_is_left() -> None:
    client = Client(["ERR"])
    nixl_link, _ = link(client)
    posted = Posted()
    nixl_link.post(posted, [Run(0, 0, 0, 1)])
    nixl_link.post(posted, [Run(1, 1, 1, 1)])
    with pytest.raises(PeerUnavailable, match="the write failed"):
        nixl_link.settle(posted, timeout_s=5)
    assert client.released == [1, 2] and posted.ranks == [] and posted.handles == []
