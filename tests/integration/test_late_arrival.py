"""A transfer's `ready` lands (KVArrived queued) and the decode side aborts the request
before it pumps that event: the arrival is dropped, the engine loop goes on, every block
comes back. And a request id reserved again after such an abort gets its own transfer's KV,
never the stale one's (events are matched by reservation, not by request id alone).

The hostile run that found it: `remote_kv_ready` raised `unknown request` inside the decode
worker's idle hook, which killed its engine loop with 92 blocks held."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from decode_worker.kv_receive import Landed, RemoteFailure, RemoteKV
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from kvfabric import SenderConfig, ShmKVAllocator
from kvfabric.address import Ticket
from prefill_worker.kv_push import KVPusher
from tests.integration.reference import make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@contextlib.contextmanager
def fabric_pair(model_dir: str) -> Iterator[tuple[LLMEngine, KVPusher, RemoteKV]]:
    """A prefill engine pushing over shm into a decode engine's pool, as the two workers hold them."""
    prefill = make_engine(model_dir, role="prefill", budget=64)
    pusher = KVPusher(prefill, SenderConfig(transport="shm"))
    prefill.handoff = pusher
    allocator = ShmKVAllocator()
    decode = RemoteKV(make_engine(model_dir, role="decode", allocator=allocator), allocator)
    try:
        yield prefill, pusher, decode
    finally:
        pusher.close()
        decode.close()


def _push_until_ready(prefill, pusher: KVPusher, decode: RemoteKV, ticket: Ticket) -> None:
    """Step the prefill side until the receiver closed the reservation (ready in), without pumping."""
    deadline = time.monotonic() + 30
    while decode.receiver.table.get(ticket.reservation_id) is not None or pusher.num_open:
        assert time.monotonic() < deadline, "the push never completed"
        if prefill.has_schedulable():
            prefill.step()
        for d in pusher.take_done():
            assert d.error is None, d.error
            pusher.settle(d)
        time.sleep(0.001)


def _transfer(prefill: LLMEngine, pusher: KVPusher, decode: RemoteKV, prompt: list[int], rid: str,
              ticket: Ticket | None = None) -> Ticket:
    """Reserve (unless `ticket` is given), prefill and push until the receiver has the `ready`."""
    ticket = ticket or decode.reserve(prompt, PARAMS, request_id=rid)
    assert ticket is not None
    pusher.attach(ticket)
    prefill.add_request(prompt, PARAMS, rid)
    _push_until_ready(prefill, pusher, decode, ticket)
    return ticket


def _drain(decode: RemoteKV) -> list[Landed | RemoteFailure]:
    items: list[Landed | RemoteFailure] = []
    for _ in range(20):
        items += decode.pump(timeout_s=0.01)
    return items


def test_an_arrival_for_a_request_aborted_before_the_pump_is_dropped(tiny_llama_dir: str) -> None:
    with fabric_pair(tiny_llama_dir) as (prefill, pusher, decode):
        gone, kept = random_prompts([40, 24], 512, seed=5)
        _transfer(prefill, pusher, decode, gone, "gone")
        assert decode.abort("gone")  # its KVArrived is still queued in the receiver
        assert decode.engine.check_invariants().num_in_use == 0

        _transfer(prefill, pusher, decode, kept, "kept")
        items = _drain(decode)
        assert [(type(i).__name__, i.request_id) for i in items] == [("Landed", "kept")]
        assert decode.engine.abort("kept")
        assert decode.engine.check_invariants().num_in_use == 0
        assert prefill.check_invariants().num_in_use == 0


def test_a_request_id_reserved_again_ignores_its_stale_arrival(tiny_llama_dir: str) -> None:
    with fabric_pair(tiny_llama_dir) as (prefill, pusher, decode):
        first, second = random_prompts([40, 40], 512, seed=9)
        ticket = _transfer(prefill, pusher, decode, first, "r")
        assert decode.abort("r")
        again = decode.reserve(second, PARAMS, request_id="r")  # a retry under the same id
        assert again is not None and again.reservation_id != ticket.reservation_id
        assert _drain(decode) == []  # the first transfer's arrival is not the retry's
        assert decode.engine.scheduler.requests["r"].num_computed_tokens == 0

        _transfer(prefill, pusher, decode, second, "r", again)
        items = _drain(decode)
        assert [(type(i).__name__, i.request_id) for i in items] == [("Landed", "r")]
        assert decode.abort("r")
        assert decode.engine.check_invariants().num_in_use == 0


def test_a_request_that_ends_at_its_first_token_keeps_its_blocks_until_its_push_done(tiny_llama_dir: str) -> None:
    """The prefill worker's path for EOS / max_tokens 1: the transfer is cancelled, and the
    blocks the lane may still be reading stay off the pool until its PushDone is settled."""
    with fabric_pair(tiny_llama_dir) as (prefill, pusher, decode):
        (prompt,) = random_prompts([40], 512, seed=13)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        ticket = decode.reserve(prompt, one, request_id="one")
        assert ticket is not None
        handoff = pusher.attach(ticket)
        deadline = time.monotonic() + 10
        while handoff.transfer is None:  # opened: the cancel then reaches the receiver as an abort
            assert time.monotonic() < deadline
            time.sleep(0.001)
        prefill.add_request(prompt, one, "one")
        (out,) = prefill.step()
        assert out.finished and out.finish_reason.value == "length"
        assert pusher.cancel("one", "finished at the first token")
        assert prefill.kv.held("one") == list(range(10))  # 40 tokens in blocks of 4
        assert prefill.check_invariants().num_in_use == 10
        done = []
        while not done:
            assert time.monotonic() < deadline
            done = pusher.take_done()
            time.sleep(0.001)
        assert [d.request_id for d in done] == ["one"] and done[0].error == "finished at the first token"
        assert prefill.check_invariants().num_in_use == 10  # not before the PushDone is settled
        pusher.settle(done[0])
        assert prefill.check_invariants().num_in_use == 0 and prefill.kv.num_held == 0
        items = _drain(decode)  # the receiver learns the sender gave up: its reservation goes
        assert [(type(i).__name__, i.request_id) for i in items] == [("RemoteFailure", "one")]
        assert decode.engine.check_invariants().num_in_use == 0
