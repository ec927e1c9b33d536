"""Long preparation work off the router's loop, bounded: refused past its admitted count,
answered within its deadline, and a large structured-output schema prepared while the loop
keeps its 1 ms timer."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

from proto import generate_pb2 as pb
from router.admission import AdmissionConfig
from router.attempt import RequestFailed
from router.frontend import Frontend, ask_from_pb
from router.gate import AdmissionGate
from router.members import Members
from router.off_loop import OffLoop
from router.servicer import Generation
from tests.unit.helpers import heartbeat


def test_past_its_admitted_count_a_request_is_refused_and_past_its_deadline_answered() -> None:
    release = threading.Event()
    pool = OffLoop(workers=1, max_waiting=2, timeout_s=0.3)

    async def scenario() -> None:
        slow = [asyncio.create_task(pool.run(lambda: release.wait(10))) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(RequestFailed) as e:
            await pool.run(lambda: 1)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_after_s == 1.0
        for task in slow:
            with pytest.raises(RequestFailed) as e:
                await task
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "over 0.3 s" in e.value.message
        assert pool.num_running == 2  # past their deadline, still counted until their work ends
        release.set()
        while pool.num_running:
            await asyncio.sleep(0.01)
        assert await pool.run(lambda: 7) == 7

    asyncio.run(scenario())
    assert (pool.num_refused, pool.num_timed_out) == (1, 2)
    pool.close()


def test_a_large_ref_schema_is_prepared_while_the_loop_keeps_its_timer(tiny_llama_dir: str) -> None:
    """Thousands of `$ref`s to one large node (each spelled the same): the check reads the
    node once, off the loop; the loop's 1 ms timer is never late by much."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {
        f"q{j}": {"type": "integer"} for j in range(4)}} for i in range(150)}}
    schema = json.dumps({"$defs": {"big": big}, "anyOf": [{"$ref": "#/$defs/big"}] * 1200}, separators=(",", ":"))
    assert len(schema) > 40_000
    members = Members()
    members.update({"d0": heartbeat("d0", "decode", address="10.0.0.1:1", model_id="m", block_size=16,
                                    vocab_size=512, max_model_len=512, num_total_blocks=64)})
    service = Generation(Frontend(tiny_llama_dir), AdmissionGate(AdmissionConfig(), time.monotonic), None,  # type: ignore[arg-type]
                         members)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
        max_tokens=2, constraint=pb.Constraint(kind="json_schema", value=schema)))
    late: list[float] = []

    async def probe(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)

    async def scenario() -> None:
        stop = asyncio.Event()
        timer = asyncio.create_task(probe(stop))
        await asyncio.sleep(0.02)
        prep = await service.prepare(ask_from_pb(request))
        assert prep.params.constraint is not None
        stop.set()
        await timer

    asyncio.run(scenario())
    assert max(late) < 1.0, f"the loop stalled {max(late) * 1e3:.0f} ms"  # 6.5 ms here idle; 12.6 s on the loop before
    service.off_loop.close()
