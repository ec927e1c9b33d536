"""A decode worker that stops reading must not stall the prefill worker's engine.

One prefill engine pushes two requests over tcp: one to a healthy decode engine, one to
a receiver that stops reading at its first data frame (a real `FabricReceiver` whose
connection thread blocks, so the sender's socket fills and its `ready` gets no ack).
The engine keeps stepping at its usual pace (bound: no step over `STEP_BOUND_S`, while
the stall lasts seconds), the healthy request's KV lands while the other is stalled,
and the stalled request fails: on the decode side by its lease, on the prefill side by
the ack timeout, and every block on the prefill side is freed.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from decode_worker.kv_receive import Landed, RemoteKV
from engine.core.request import SamplingParams
from kvfabric import (
    BlockRegion, FabricLayout, FabricReceiver, KVArrived, ReceiverConfig, SenderConfig, ShmKVAllocator, TransferFailed,
)
from prefill_worker.kv_push import KVPusher
from tests.integration.reference import make_engine, random_prompts

LEASE_S = 1.0
ACK_TIMEOUT_S = 3.0
STEP_BOUND_S = ACK_TIMEOUT_S / 2
"""Longest any prefill step may take while the other request's receiver is stalled: a step
of this tiny model takes a few ms, and one that waited on the stalled lane would last the
stall (ACK_TIMEOUT_S); the bound sits between, far from both, so a loaded machine's slow
step does not fail it."""


class StalledReceiver(FabricReceiver):
    """Stops reading its connection at the first data frame, until `release` is set."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.stalled = threading.Event()

    def _receive_frame(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.stalled.set()
        self.release.wait(30)
        super()._receive_frame(*args, **kwargs)


def drive(prefill, pusher: KVPusher, healthy: RemoteKV,  # type: ignore[no-untyped-def]
          stalled: StalledReceiver) -> tuple[list[float], dict[str, tuple[float, str | None]], float | None, float]:
    """Steps the prefill engine until both hand-offs ended and the stalled reservation failed on
    its receiver: each step's duration, when each hand-off ended (s, error), when the healthy KV
    landed and when the stalled one failed on the decode side."""
    steps: list[float] = []
    done_at: dict[str, tuple[float, str | None]] = {}
    landed_at, failed_on_decode_at = None, None
    started = time.monotonic()
    while len(done_at) < 2 or failed_on_decode_at is None:
        assert time.monotonic() - started < 20, f"not over in 20 s: {done_at}, {failed_on_decode_at}"
        if prefill.has_schedulable():
            t = time.perf_counter()
            prefill.step()
            steps.append(time.perf_counter() - t)
        else:
            time.sleep(0.002)
        for d in pusher.take_done():
            done_at[d.request_id] = (time.monotonic() - started, d.error)
            pusher.settle(d)
        if any(isinstance(item, Landed) for item in healthy.pump()):
            landed_at = time.monotonic() - started
        for ev in stalled.poll():
            assert not isinstance(ev, KVArrived)
            if isinstance(ev, TransferFailed):
                assert ev.request_id == "s" and "lease" in ev.reason
                failed_on_decode_at = time.monotonic() - started
    return steps, done_at, landed_at, failed_on_decode_at


def test_a_stalled_decode_receiver_does_not_slow_the_prefill_steps(tiny_llama_dir: str) -> None:
    prefill = make_engine(tiny_llama_dir, role="prefill", budget=16)
    pusher = KVPusher(prefill, SenderConfig(transport="tcp", ack_timeout_s=ACK_TIMEOUT_S, io_timeout_s=ACK_TIMEOUT_S,
                                            renew_interval_s=LEASE_S / 4))
    prefill.handoff = pusher
    allocator = ShmKVAllocator()
    healthy = RemoteKV(make_engine(tiny_llama_dir, role="decode", allocator=allocator), allocator,
                       ReceiverConfig(lease_s=LEASE_S))
    layout = FabricLayout.of_pool(prefill.model_id, prefill.kv_pool.layout)
    pool = np.zeros((64, layout.block_bytes), dtype=np.uint8)
    stalled = StalledReceiver(layout, BlockRegion(pool), ReceiverConfig(lease_s=LEASE_S))
    try:
        prompt_s, prompt_h = random_prompts([200, 40], 512, seed=21)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        ticket_s = stalled.expect("s", list(range(51)), 0)
        ticket_h = healthy.reserve(prompt_h, params, request_id="h")
        assert ticket_h is not None
        pusher.attach(ticket_s)
        pusher.attach(ticket_h)
        prefill.add_request(prompt_s, params, "s")
        prefill.add_request(prompt_h, params, "h")

        steps, done_at, landed_at, failed_on_decode_at = drive(prefill, pusher, healthy, stalled)

        assert stalled.stalled.is_set()
        assert max(steps) < STEP_BOUND_S, sorted(steps)[-5:]
        assert done_at["h"][1] is None and landed_at is not None
        assert landed_at < done_at["s"][0]  # the healthy KV landed while the other lane was stalled
        assert done_at["s"][1] is not None and "did not answer" in done_at["s"][1]
        assert failed_on_decode_at < ACK_TIMEOUT_S + 1.0  # the lease went first: LEASE_S after the last renewal
        assert prefill.check_invariants().num_in_use == 0
        assert pusher.num_open == 0
    finally:
        stalled.release.set()
        pusher.close()
        healthy.close()
        stalled.close()
