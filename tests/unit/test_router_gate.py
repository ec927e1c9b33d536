"""The admission wait's end says what happened: the client's deadline (DEADLINE_EXCEEDED) or
the router's queue limit (RESOURCE_EXHAUSTED with a retry hint), never one for the other."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.core.request import SamplingParams
from router.admission import AdmissionConfig
from router.attempt import Deadline, Prepared, RequestFailed
from router.gate import AdmissionGate


def prep(rid: str) -> Prepared:
    return Prepared(rid, [1, 2, 3], SamplingParams(max_tokens=7), 0, "")


async def queued_behind_a_full_budget(deadline_s: float | None) -> RequestFailed:
    gate = AdmissionGate(AdmissionConfig(max_inflight_tokens=10, max_queue_wait_s=0.3, min_retry_after_s=0.2),
                         time.monotonic)
    await gate.admit(prep("a"), Deadline(None), 10)  # takes the whole budget

    async def expire() -> None:  # the router's timer
        while True:
            await asyncio.sleep(0.05)
            gate.expire()

    timer = asyncio.create_task(expire())
    try:
        deadline = Deadline(None if deadline_s is None else time.monotonic() + deadline_s)
        with pytest.raises(RequestFailed) as e:
            await gate.admit(prep("b"), deadline, 10)
        return e.value
    finally:
        timer.cancel()


def test_the_queue_limit_is_resource_exhausted_with_a_retry_hint() -> None:
    started = time.monotonic()
    failed = asyncio.run(queued_behind_a_full_budget(None))
    # at the queue limit (0.3 s), not the 10 s budget wait: a bound no loaded machine reaches
    assert failed.code == grpc.StatusCode.RESOURCE_EXHAUSTED and 0.25 < time.monotonic() - started < 8.0
    assert "waited 0.3 s for admission (the router's queue limit)" in failed.message
    assert failed.retry_after_s is not None and failed.retry_after_s >= 0.2


def test_the_clients_deadline_is_deadline_exceeded() -> None:
    failed = asyncio.run(queued_behind_a_full_budget(0.15))
    assert failed.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline passed while it waited for admission" in failed.message
