"""An admitted request that no decode worker has KV room for right now waits for room
(`RouterConfig.kv_wait_s`) instead of being refused; with the fake workers of `tests.unit.router_fakes`."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.core.request import SamplingParams
from router.attempt import Deadline, Prepared, Progress, RequestFailed
from router.choices import Choices
from tests.unit.router_fakes import EXPECTED, MAX_TOKENS, PROMPT, assert_settled, good_decode, make_flow
from tests.unit.helpers import heartbeat


def one_request_of_room(kv_wait_s: float):  # type: ignore[no-untyped-def]
    """One decode worker whose pool holds one request (40 + 5 tokens: 3 blocks of 16) at a time,
    answering each after 0.2 s."""
    flow, streams = make_flow({"d0": lambda req: [0.2, *good_decode(req)]}, mode="colocated", kv_wait_s=kv_wait_s)
    flow.members.update({"d0": heartbeat("d0", "decode", address="d0", model_id="m", block_size=16, vocab_size=1000,
                                         max_model_len=512, num_total_blocks=4)})
    flow.loads.num_blocks = flow.members.num_blocks()
    return flow, streams


async def two_at_once(flow) -> list[list[int] | RequestFailed]:  # type: ignore[no-untyped-def]
    async def one(rid: str, prompt: list[int]) -> list[int] | RequestFailed:
        prep = Prepared(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 0, "")
        progress = Progress(time.perf_counter())
        try:
            return [t async for r in flow.run(prep, Deadline(None), progress, Choices(prep, progress, [None]))
                    for t in r.token_ids]
        except RequestFailed as e:
            return e
    return list(await asyncio.gather(one("r1", PROMPT), one("r2", [t + 500 for t in PROMPT])))  # no shared prefix


def test_the_second_request_waits_for_the_firsts_blocks_and_runs() -> None:
    flow, streams = one_request_of_room(kv_wait_s=2.0)
    started = time.monotonic()
    assert asyncio.run(two_at_once(flow)) == [EXPECTED, EXPECTED]
    assert time.monotonic() - started >= 0.4  # one after the other
    assert streams.tried() == ["d0", "d0"] and flow.stats["num_kv_waits"] == 1
    assert_settled(flow, streams)


@pytest.mark.parametrize("kv_wait_s", [0.0, 0.1])
def test_past_kv_wait_s_it_is_refused_with_a_retry_hint(kv_wait_s: float) -> None:
    flow, streams = one_request_of_room(kv_wait_s)
    got = asyncio.run(two_at_once(flow))
    assert got[0] == EXPECTED
    assert isinstance(got[1], RequestFailed) and got[1].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no decode worker has free KV blocks" in got[1].message and got[1].retry_after_s == 1.0
    assert streams.tried() == ["d0"]
    assert_settled(flow, streams)
