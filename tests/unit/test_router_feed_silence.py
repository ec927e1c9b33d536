"""The router's judgement of a worker whose heartbeat expired (router/feed.py): kept on its last
heartbeat while its health check answers SERVING, for at most `max_silent_s`; dropped at once
when the check fails, when it was not serving, or with no check at all."""
from __future__ import annotations

import asyncio

from control.heartbeat import Heartbeat
from router.feed import RegistryFeed
from router.kv_index import KVIndex
from router.loads import LoadBook
from router.members import Members
from tests.conftest import FakeClock
from tests.unit.helpers import heartbeat


class Reader:
    def __init__(self) -> None:
        self.beats: dict[str, Heartbeat] = {}

    async def heartbeats(self) -> dict[str, Heartbeat]:
        return dict(self.beats)


def beat(worker_id: str, state: str = "serving") -> Heartbeat:
    return heartbeat(worker_id, "decode", address=f"10.0.0.{worker_id[-1]}:1", state=state, incarnation="i",
                     model_id="m", block_size=16, vocab_size=100, max_model_len=64, num_total_blocks=8)


def test_a_silent_worker_is_kept_while_it_answers_and_for_a_bounded_time() -> None:
    clock, reader, members, asked = FakeClock(), Reader(), Members(("*",)), []
    answers = {"10.0.0.1:1": True, "10.0.0.2:1": False, "10.0.0.3:1": True}

    async def confirm(address: str, role: str) -> bool:
        asked.append((address, role))
        return answers[address]

    left: list[str] = []

    async def on_left(address: str) -> None:
        left.append(address)

    feed = RegistryFeed(reader, members, KVIndex(clock), LoadBook(clock), 0.5, 10, on_left=on_left,  # type: ignore[arg-type]
                        confirm=confirm, max_silent_s=30.0, clock=clock)
    reader.beats = {"d1": beat("d1"), "d2": beat("d2"), "d3": beat("d3", "draining")}
    asyncio.run(feed.refresh())
    assert members.ids() == ["d1", "d2", "d3"] and asked == []
    clock.advance(5.0)
    reader.beats = {}  # every heartbeat expired
    asyncio.run(feed.refresh())
    assert members.ids() == ["d1"] and feed.num_silent_kept == 1  # d2's check failed; d3 was draining
    assert sorted(asked) == [("10.0.0.1:1", "decode"), ("10.0.0.2:1", "decode")]
    assert sorted(left) == ["10.0.0.2:1", "10.0.0.3:1"]
    assert feed.loads.gone("d1") is False and members.serving("decode") == ["d1"]
    clock.advance(24.0)  # 29 s without a heartbeat: still kept
    asyncio.run(feed.refresh())
    assert members.ids() == ["d1"] and feed.num_silent_kept == 2
    clock.advance(2.0)  # 31 s: past max_silent_s, health check or not
    asyncio.run(feed.refresh())
    assert members.ids() == [] and left[-1] == "10.0.0.1:1" and feed.num_silent_kept == 2
    reader.beats = {"d1": beat("d1")}  # it beats again: a member again, its silence forgotten
    asyncio.run(feed.refresh())
    assert members.ids() == ["d1"]


def test_without_a_check_a_silent_worker_leaves_at_once() -> None:
    clock, reader, members = FakeClock(), Reader(), Members(("*",))
    feed = RegistryFeed(reader, members, KVIndex(clock), LoadBook(clock), 0.5, 10)  # type: ignore[arg-type]
    reader.beats = {"d1": beat("d1")}
    asyncio.run(feed.refresh())
    reader.beats = {}
    asyncio.run(feed.refresh())
    assert members.ids() == [] and feed.num_silent_kept == 0
