"""The router's request flow with in-process fake workers (`tests.unit.router_fakes`).

Every test checks the exact status code or token stream, which workers were tried, that
every call was cancelled and that the load book holds nothing afterwards (bookings settled
once).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from engine.core.request import FinishReason, SamplingParams
from proto import generate_pb2 as pb
from router.attempt import Deadline, Prepared, Progress, RequestFailed
from router.clients import WorkerRequest
from router.flow import RequestFlow
from router.choices import Choices
from router.reply import Reply
from tests.unit.router_fakes import (
    EXPECTED, HANG, MAX_TOKENS, PROMPT, Script, arrived, assert_settled, first, first_call_then, good_decode,
    good_prefill, make_flow, reserved, rpc_error, run,
)
from tests.unit.helpers import heartbeat


def test_remote_prefill_streams_the_first_token_from_p_and_the_rest_from_d() -> None:
    flow, streams = make_flow({"p0": good_prefill, "p1": good_prefill, "d0": good_decode, "d1": good_decode})
    got, responses = asyncio.run(run(flow))
    assert got == EXPECTED
    assert responses[0].token_ids == [100] and responses[0].route.prefill_worker in ("p0", "p1")
    assert responses[-1].finish_reason is FinishReason.LENGTH
    assert [type(r).__name__ for _, r, _ in streams.calls] == ["DecodeRequest", "PrefillRequest"]
    assert streams.calls[1][1].ticket == pb.KVTicket(request_id="r1", reservation_id=7)  # D's reservation goes to P
    assert flow.stats == {"num_local_prefill": 0, "num_remote_prefill": 1, "num_retries": 0, "num_busy_waits": 0,
                          "num_kv_waits": 0}
    assert_settled(flow, streams)


def test_a_prefill_failure_is_retried_on_the_other_prefill_worker() -> None:
    prefill = first_call_then(lambda req: [rpc_error(grpc.StatusCode.INTERNAL, "InvariantError: boom")], good_prefill)
    flow, streams = make_flow({"p0": prefill, "p1": prefill, "d0": good_decode, "d1": good_decode})
    got, responses = asyncio.run(run(flow))
    assert got == EXPECTED
    tried = streams.tried()
    assert len(tried) == 4 and {tried[1], tried[3]} == {"p0", "p1"}
    assert responses[-1].route.prefill_worker == tried[3]
    assert flow.stats["num_retries"] == 1
    assert flow.down_workers() == []  # INTERNAL: a fault hit the request, the worker still serves
    assert_settled(flow, streams)


def test_every_call_of_every_try_carries_the_tenant_and_its_weight() -> None:
    prefill = first_call_then(lambda req: [rpc_error(grpc.StatusCode.INTERNAL, "InvariantError: boom")], good_prefill)
    flow, streams = make_flow({"p0": prefill, "p1": prefill, "d0": good_decode, "d1": good_decode})
    prep = Prepared("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 2, "gold", tenant_weight=3.0)
    progress = Progress(time.perf_counter())

    async def go() -> list[Reply]:
        return [r async for r in flow.run(prep, Deadline(None), progress, Choices(prep, progress, [None]))]
    asyncio.run(go())
    assert len(streams.calls) == 4  # a retry after the prefill failure
    assert [(r.tenant, r.tenant_weight, r.priority) for _, r, _ in streams.calls] == [("gold", 3.0, 2)] * 4
    assert_settled(flow, streams)


def test_invalid_argument_from_a_worker_ends_the_request_without_a_retry() -> None:
    invalid = lambda req: [rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "token ids [9999] are outside")]  # noqa: E731
    flow, streams = make_flow({"p0": invalid, "p1": invalid, "d0": good_decode, "d1": good_decode})
    with pytest.raises(RequestFailed) as e:
        asyncio.run(run(flow))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "outside" in e.value.message
    assert flow.stats["num_retries"] == 0 and len(streams.calls) == 2
    assert_settled(flow, streams)


def test_a_decode_death_mid_stream_continues_on_the_other_decode_worker() -> None:
    dies = lambda req: [*good_decode(req)[:4], rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")]  # noqa: E731
    decode = first_call_then(dies, good_decode)
    flow, streams = make_flow({"p0": good_prefill, "d0": decode, "d1": decode})
    got, responses = asyncio.run(run(flow))
    assert got == EXPECTED  # one unbroken stream: 100, 101, 102 from the first D, the rest from the other
    victim = streams.tried()[0]
    assert responses[-1].route.decode_worker not in ("", victim)
    [retry] = [r for _, r, _ in streams.calls[2:] if isinstance(r, pb.DecodeRequest)]
    assert list(retry.prompt_token_ids) == PROMPT + [100, 101, 102] and retry.sampling.max_tokens == 2
    assert retry.request_id == "r1~1"
    assert flow.stats["num_retries"] == 1 and flow.down_workers() == [victim]
    assert_settled(flow, streams)


def test_a_transfer_failure_after_the_first_token_blames_the_prefill_worker() -> None:
    aborted = rpc_error(grpc.StatusCode.ABORTED, "request r1: KV transfer failed: peer gone")
    decode = first_call_then(lambda req: [reserved(), aborted], good_decode)
    prefill = first_call_then(lambda req: [first(100), HANG], good_prefill)
    flow, streams = make_flow({"p0": prefill, "p1": prefill, "d0": decode})
    got, responses = asyncio.run(run(flow))
    assert got == EXPECTED  # the first token (from the first P) is sent once, the retry continues after it
    tried = streams.tried()
    assert tried[0] == tried[2] == "d0" and {tried[1], tried[3]} == {"p0", "p1"}
    assert responses[-1].route.prefill_worker == tried[3]
    assert flow.stats["num_retries"] == 1
    assert flow.down_workers() == []  # ABORTED: its transfer failed, the workers live
    assert_settled(flow, streams)


def test_a_request_past_its_deadline_ends_with_deadline_exceeded_and_frees_everything() -> None:
    flow, streams = make_flow({"p0": good_prefill, "d0": lambda req: [reserved(), arrived(), HANG]})
    started = time.monotonic()
    with pytest.raises(RequestFailed) as e:
        asyncio.run(run(flow, deadline_s=0.3))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.25 < time.monotonic() - started < 20.0  # its deadline, not the hanging worker's (forever)
    assert flow.stats["num_retries"] == 0  # the request's own deadline: no other worker is tried
    assert_settled(flow, streams)


def test_a_client_cancel_cancels_both_worker_calls_and_settles_the_booking() -> None:
    flow, streams = make_flow({"p0": lambda req: [first(100), HANG], "d0": lambda req: [reserved(), HANG]})

    async def cancel_after_first() -> list[Reply]:
        prep = Prepared("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS), 0, "")
        progress = Progress(time.perf_counter())
        got = []

        async def consume() -> None:
            async for r in flow.run(prep, Deadline(None), progress, Choices(prep, progress, [None])):
                got.append(r)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.01)
        task.cancel()  # what grpc does to the servicer when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    got = asyncio.run(cancel_after_first())
    assert [r.token_ids for r in got] == [[100]]
    assert_settled(flow, streams)


def test_a_closed_stream_cancels_both_worker_calls_before_its_close_returns() -> None:
    """The HTTP door closes a request's stream when its client goes (aclose): by the time the
    close returns, both worker calls are cancelled and the booking settled, not once the
    garbage collector finalizes the try."""
    flow, streams = make_flow({"p0": lambda req: [first(100), HANG], "d0": lambda req: [reserved(), HANG]})

    async def close_after_first() -> list[int]:
        prep = Prepared("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS), 0, "")
        progress = Progress(time.perf_counter())
        replies = flow.run(prep, Deadline(None), progress, Choices(prep, progress, [None]))
        got = await anext(replies)
        await replies.aclose()
        assert_settled(flow, streams)  # at once: no turn of the loop in between
        return got.token_ids

    assert asyncio.run(close_after_first()) == [100]


def test_no_decode_worker_left_is_unavailable_with_a_retry_hint() -> None:
    dead = lambda req: [rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect")]  # noqa: E731
    flow, streams = make_flow({"d0": dead, "d1": dead}, mode="colocated")
    started = time.monotonic()
    with pytest.raises(RequestFailed) as e:
        asyncio.run(run(flow))
    assert 0.3 <= time.monotonic() - started < 20.0  # it waited no_worker_wait_s for one to join, no more
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.retry_after_s == 1.0
    assert sorted(streams.tried()) == ["d0", "d1"]
    assert flow.down_workers() == ["d0", "d1"]
    assert_settled(flow, streams)


def test_a_request_with_no_decode_worker_waits_for_one_to_join() -> None:
    dead = lambda req: [rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect")]  # noqa: E731
    flow, streams = make_flow({"d0": dead}, mode="colocated")
    streams.scripts["d9"] = good_decode

    async def replaced_meanwhile() -> list[int]:
        async def join() -> None:
            while "d0" not in streams.tried():  # the request found d0 dead and waits for a worker
                await asyncio.sleep(0.005)
            assert not requesting.done()  # d9 below is the only worker it can get
            # the controller's replacement starts serving
            flow.members.update({w: heartbeat(w, "decode", address=w, model_id="m", block_size=16, vocab_size=1000,
                                              max_model_len=512, num_total_blocks=64) for w in ("d0", "d9")})
            flow.loads.num_blocks = flow.members.num_blocks()

        requesting = asyncio.ensure_future(run(flow))
        await join()
        got, _ = await requesting
        return got

    assert asyncio.run(replaced_meanwhile()) == EXPECTED
    assert streams.tried() == ["d0", "d9"] and flow.stats["num_retries"] == 1


def test_the_router_measures_inter_token_latency_for_the_autoscaler() -> None:
    from router.frontend import ItlWindow

    flow, _ = make_flow({"p0": good_prefill, "d0": good_decode})
    window = ItlWindow()
    prep = Prepared("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 0, "")
    progress = Progress(time.perf_counter())

    async def go() -> None:
        async for _ in flow.run(prep, Deadline(None), progress, Choices(prep, progress, [None], window)):
            pass

    asyncio.run(go())
    assert len(window.samples) == MAX_TOKENS - 1  # one interval per token after the first
    assert window.p50_ms() is not None and window.p50_ms() >= 0


def slow_decode(pause_s: float) -> Callable[[WorkerRequest], Script]:
    """A decode worker that holds the request `pause_s` before its second token (queued behind others)."""
    def script(req: WorkerRequest) -> Script:
        events = good_decode(req)
        return [*events[:2], pause_s, *events[2:]]
    return script


def beating(flow: RequestFlow, *workers: str) -> None:
    """The registry's current read: these workers heartbeat."""
    flow.loads.set_heartbeats({w: heartbeat(w, "decode" if w.startswith("d") else "prefill", num_total_blocks=64,
                                            num_free_blocks=64) for w in workers})


def test_a_busy_decode_worker_that_still_heartbeats_is_waited_on_not_retried() -> None:
    flow, streams = make_flow({"p0": good_prefill, "d0": slow_decode(0.5), "d1": good_decode},
                              decode_idle_timeout_s=0.15)
    flow.members.drain("d1")  # d0 gets the request
    beating(flow, "p0", "d0", "d1")
    got, _ = asyncio.run(run(flow))
    assert got == EXPECTED
    assert streams.tried() == ["d0", "p0"]  # no retry: the worker was busy, not dead
    assert flow.stats["num_retries"] == 0 and flow.stats["num_busy_waits"] >= 2
    assert flow.down_workers() == []
    assert_settled(flow, streams)


def test_a_silent_decode_worker_whose_heartbeat_is_gone_is_dead_and_the_request_moves() -> None:
    decode = first_call_then(slow_decode(30.0), good_decode)
    flow, streams = make_flow({"p0": good_prefill, "d0": decode, "d1": decode}, decode_idle_timeout_s=0.15)
    beating(flow, "p0", "d0", "d1")

    async def go() -> list[int]:
        async def expire_victim() -> None:
            while not streams.calls:
                await asyncio.sleep(0.01)
            beating(flow, "p0", *({"d0", "d1"} - {streams.tried()[0]}))  # its heartbeat expired
        expiring = asyncio.create_task(expire_victim())
        got, _ = await run(flow)
        await expiring
        return got

    assert asyncio.run(go()) == EXPECTED
    victim = streams.tried()[0]
    assert flow.stats["num_retries"] == 1 and flow.down_workers() == [victim]
    assert_settled(flow, streams)


def test_a_worker_busy_past_busy_wait_s_ends_the_request_resource_exhausted() -> None:
    flow, streams = make_flow({"p0": good_prefill, "d0": slow_decode(30.0)}, decode_idle_timeout_s=0.1,
                              busy_wait_s=0.35)
    beating(flow, "p0", "d0")
    with pytest.raises(RequestFailed) as e:
        asyncio.run(run(flow))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "d0 is alive but sent nothing for this request in 0 s" in e.value.message
    assert flow.stats["num_retries"] == 0 and streams.tried() == ["d0", "p0"]
    assert_settled(flow, streams)


def test_a_down_mark_outlasts_its_time_while_the_registry_is_away(clock) -> None:  # type: ignore[no-untyped-def]
    dead = lambda req: [rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect")]  # noqa: E731
    flow, streams = make_flow({"d0": dead, "d1": good_decode}, mode="colocated", no_worker_wait_s=0.0)
    flow.clock = clock
    beating(flow, "d0", "d1")
    flow.loads.set_heartbeats(None)  # Redis goes away
    flow.members.drain("d1")
    with pytest.raises(RequestFailed):
        asyncio.run(run(flow))  # d0 fails as unreachable: down
    assert flow.down_workers() == ["d0"]
    clock.advance(flow.config.worker_down_s + 60)
    assert flow.down_workers() == ["d0"]  # no heartbeat could clear it meanwhile
    beating(flow, "d0", "d1")  # the registry is back and d0 heartbeats: the mark expires as usual
    assert flow.down_workers() == []


def test_a_prompt_is_hashed_once_for_admission_and_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core.hashing import BlockHasher

    calls: list[int] = []
    real = BlockHasher.hash_prompt
    monkeypatch.setattr(BlockHasher, "hash_prompt", lambda self, ids, tenant: calls.append(len(ids)) or real(
        self, ids, tenant))
    flow, _ = make_flow({"p0": good_prefill, "d0": good_decode})
    prep = Prepared("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), 0, "")
    assert flow.cached_tokens(prep) == 0  # the admission's look at the KV index
    progress = Progress(time.perf_counter())

    async def go() -> None:
        async for _ in flow.run(prep, Deadline(None), progress, Choices(prep, progress, [None])):
            pass

    asyncio.run(go())
    assert calls == [len(PROMPT)]  # the first try routed on the hashes admission computed
