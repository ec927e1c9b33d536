"""A transport error that is not a FabricError (a CUDA runtime or NCCL error from CuPy, say)
fails that request's transfer only: the other request's KV lands, the prefill engine keeps
stepping, and both sides end with every block free."""
from __future__ import annotations

import time

import pytest

from decode_worker.kv_receive import Landed, RemoteFailure, RemoteKV
from engine.core.request import SamplingParams
from kvfabric import SenderConfig, ShmKVAllocator
from kvfabric.sender import Transfer
from prefill_worker.kv_push import KVPusher
from tests.integration.reference import make_engine, random_prompts


def test_a_non_fabric_transport_error_fails_only_its_transfer(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    push = Transfer.push

    def flaky(self: Transfer, src_block_ids: list[int], first_index: int, after: object = None) -> None:
        if self.request_id == "bad":
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        push(self, src_block_ids, first_index, after)

    monkeypatch.setattr(Transfer, "push", flaky)
    prefill = make_engine(tiny_llama_dir, role="prefill", budget=16)
    pusher = KVPusher(prefill, SenderConfig(transport="shm"))
    prefill.handoff = pusher
    allocator = ShmKVAllocator()
    decode = RemoteKV(make_engine(tiny_llama_dir, role="decode", allocator=allocator), allocator)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        prompts = dict(zip(("bad", "good"), random_prompts([40, 40], 512, seed=31), strict=True))
        for rid, prompt in prompts.items():
            ticket = decode.reserve(prompt, params, request_id=rid)
            assert ticket is not None
            pusher.attach(ticket)
            prefill.add_request(prompt, params, rid)
        done, landed, failed = {}, set(), {}
        deadline = time.monotonic() + 30
        while len(done) < 2 or len(landed) + len(failed) < 2:
            assert time.monotonic() < deadline, (done, landed, failed)
            if prefill.has_schedulable():
                prefill.step()
            for d in pusher.take_done():
                done[d.request_id] = d.error
                pusher.settle(d)
            for item in decode.pump(timeout_s=0.01):
                if isinstance(item, Landed):
                    landed.add(item.request_id)
                elif isinstance(item, RemoteFailure):
                    failed[item.request_id] = item.reason
        assert done["good"] is None and landed == {"good"}
        assert "cudaErrorIllegalAddress" in done["bad"] and "sender aborted" in failed["bad"]
        assert prefill.check_invariants().num_in_use == 0
        decode.abort("good")
        for _ in range(50):  # the shm writer's fence comes back through pump()
            decode.pump(timeout_s=0.02)
            if decode.engine.check_invariants().num_in_use == 0:
                break
        assert decode.engine.check_invariants().num_in_use == 0
    finally:
        pusher.close()
        decode.close()
