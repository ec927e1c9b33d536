"""The disaggregated path on GPUs, workers as plain processes (the GPU machines have no Ray).

A prefill engine in a child process pushes through kvfabric (cuda_ipc: both on one GPU)
into a decode engine's device pool in this process:
- greedy tokens equal the monolithic engine on the same GPU and `transformers` (both
  float32, TF32 off; the session's cached transformers model stays on the CPU);
- a 2,000-token prompt prefilled in one chunk and pushed as its step returns lands with
  exactly the bytes the prefill pool holds (while the step ends in a host sync, the
  sampler's `tolist()`, this cannot catch a push that ignores the step's CUDA event;
  test_kvfabric_gpu's late-written push can);
- an abort after the transfer opened frees both pools.
Needs CUDA and CuPy (the `gpu` extra).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from decode_worker.kv_receive import Landed, RemoteFailure, RemoteKV
from engine.core.request import SamplingParams
from kvfabric.pools import kv_allocator
from tests.integration.fabric_peer import Peer
from tests.integration.prefill_peer import prefill_main
from tests.integration.reference import hf_greedy, make_engine, random_prompts

MAX_TOKENS = 8


@pytest.fixture(autouse=True)
def _gpu_extra() -> None:
    pytest.importorskip("cupy")
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture
def prefill(tiny_llama_dir: str) -> Iterator[Peer]:
    peer = Peer(prefill_main, tiny_llama_dir, "cuda_ipc", 2048, "cuda", 1024)
    yield peer
    peer.stop()


@pytest.fixture
def decode(tiny_llama_dir: str) -> Iterator[RemoteKV]:
    allocator = kv_allocator("cuda")
    engine = make_engine(tiny_llama_dir, role="decode", device="cuda", num_blocks=1024, allocator=allocator)
    remote = RemoteKV(engine, allocator)
    yield remote
    remote.close()


def arrive(decode: RemoteKV, expected: int) -> dict[str, list[int]]:
    """Pumps until `expected` requests landed; returns each one's tokens so far (the first)."""
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    while len(tokens) < expected:
        assert time.monotonic() < deadline, f"only {len(tokens)} of {expected} arrived"
        for item in decode.pump(timeout_s=0.05):
            assert not isinstance(item, RemoteFailure), item
            if isinstance(item, Landed):
                tokens[item.request_id] = list(item.output.new_token_ids)
    return tokens


def test_disaggregated_on_one_gpu_equals_monolithic_and_transformers(tiny_llama_dir: str, prefill: Peer,
                                                                     decode: RemoteKV) -> None:
    prompts = random_prompts([5, 23, 64, 300], 512, seed=41)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    tickets = [decode.reserve(p, params, request_id=f"g{i}") for i, p in enumerate(prompts)]
    assert set(prefill.call("attach", [t.to_wire() for t in tickets]).values()) == {None}
    reply = prefill.call("prefill", [(p, t.request_id, MAX_TOKENS) for p, t in zip(prompts, tickets)], timeout_s=120)
    assert reply["in_use"] == 0 and all(error is None for _, _, error, _ in reply["done"])
    tokens = arrive(decode, len(prompts))
    while decode.engine.has_unfinished():
        for out in decode.engine.step():
            tokens[out.request_id] += out.new_token_ids
    mono = make_engine(tiny_llama_dir, device="cuda").generate(prompts, params)
    for i, (p, want) in enumerate(zip(prompts, mono, strict=True)):
        assert tokens[f"g{i}"] == want.token_ids
        assert tokens[f"g{i}"] == hf_greedy(tiny_llama_dir, tuple(p), MAX_TOKENS)
    assert decode.engine.check_invariants().num_in_use == 0


def test_a_long_chunk_pushed_as_its_step_returns_lands_with_the_bytes_the_pool_holds(prefill: Peer,
                                                                                     decode: RemoteKV) -> None:
    prompt = random_prompts([2000], 512, seed=42)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ticket = decode.reserve(prompt, params, request_id="long")
    assert prefill.call("attach", [ticket.to_wire()]) == {"long": None}
    reply = prefill.call("prefill", [(prompt, "long", 4)], timeout_s=120)
    [(_, _, error, pushes)] = reply["done"]
    assert error is None and pushes in (1, 2)  # one chunk: its blocks right after that step (+ a partial last one)
    arrive(decode, 1)
    torch.cuda.synchronize()
    pool = decode.engine.kv_pool.tensor
    expected = reply["pool_bytes"]["long"]
    num_blocks = len(expected) // (pool[0].numel() * pool.element_size())
    assert num_blocks == 500  # 2,000 tokens in 4-token blocks
    assert pool[list(ticket.block_ids[:num_blocks])].cpu().numpy().tobytes() == expected
    decode.abort("long")


def test_an_abort_after_the_transfer_opened_frees_both_pools(prefill: Peer, decode: RemoteKV) -> None:
    prompt = random_prompts([600], 512, seed=43)[0]
    ticket = decode.reserve(prompt, SamplingParams(max_tokens=4, ignore_eos=True), request_id="gone")
    assert prefill.call("attach", [ticket.to_wire()]) == {"gone": None}
    decode.abort("gone")  # one-sided: quarantined until the prefill side acknowledges the revocation
    reply = prefill.call("prefill", [(prompt, "gone", 4)], timeout_s=120)
    [(_, _, error, _)] = reply["done"]
    assert error is not None and reply["in_use"] == 0
    deadline = time.monotonic() + 10
    while decode.engine.check_invariants().num_in_use and time.monotonic() < deadline:
        decode.pump(timeout_s=0.1)
    assert decode.engine.check_invariants().num_in_use == 0 and decode.receiver.held_block_ids() == []
