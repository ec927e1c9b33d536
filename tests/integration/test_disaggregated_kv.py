"""Prefill engine (child process) -> kvfabric -> decode engine (this process), for shm, tcp and nixl.

Greedy tokens must equal transformers (and so the monolithic engine) for concurrent
prompts; blocks are pushed chunk by chunk while prefill goes on; the decode side's cached
prefix is not sent again; no block is leaked on either side.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from decode_worker.kv_receive import RemoteFailure, RemoteKV
from engine.core.forks import choice_params
from engine.model.model_config import ModelConfig
from engine.core.request import FinishReason, SamplingParams
from engine.types import choice_id
from kvfabric import ReceiverConfig, ShmKVAllocator
from kvfabric.address import ONE_SIDED
from kvfabric.pools import kv_allocator
from tests.conftest import skip_without_nixl
from tests.integration.fabric_peer import Peer
from tests.integration.prefill_peer import prefill_main
from tests.integration.reference import hf_greedy, make_engine, random_prompts

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(params=["shm", "tcp", "nixl"])
def transport(request: pytest.FixtureRequest) -> str:
    skip_without_nixl(request.param)
    return request.param


@pytest.fixture
def prefill(tiny_llama_dir: str, transport: str) -> Iterator[Peer]:
    peer = Peer(prefill_main, tiny_llama_dir, transport, 16)
    yield peer
    peer.stop()


@pytest.fixture
def decode(tiny_llama_dir: str, transport: str) -> Iterator[RemoteKV]:
    allocator = kv_allocator("cpu", transport)  # as a decode worker's: private huge pages for nixl, else shm
    engine = make_engine(tiny_llama_dir, role="decode", allocator=allocator)
    remote = RemoteKV(engine, allocator, ReceiverConfig(nixl=transport == "nixl"))
    assert ("shm" in remote.receiver.address.transports) == (transport != "nixl")
    yield remote
    remote.close()


def run_decode(decode: RemoteKV, tokens: dict[str, list[int]], expected: int) -> list[RemoteFailure]:
    failures = []
    arrived = 0
    deadline = time.monotonic() + 60
    while arrived < expected or decode.engine.has_unfinished():
        assert time.monotonic() < deadline, f"only {arrived} of {expected} transfers arrived"
        for item in decode.pump(timeout_s=0.05 if arrived < expected else 0):
            arrived += 1
            if isinstance(item, RemoteFailure):
                failures.append(item)
            else:
                tokens[item.request_id] += item.output.new_token_ids
        for out in decode.engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH
    return failures


def test_disaggregated_greedy_equals_transformers_with_chunked_pushes(
    tiny_llama_dir: str, prefill: Peer, decode: RemoteKV, transport: str,
) -> None:
    prompts = random_prompts([5, 16, 23, 41, 64], 512, seed=11)
    tickets = [decode.reserve(p, PARAMS, request_id=f"p{i}") for i, p in enumerate(prompts)]
    assert all(t is not None for t in tickets)
    assert set(prefill.call("attach", [t.to_wire() for t in tickets]).values()) == {None}
    reply = prefill.call("prefill", [(p, t.request_id, MAX_TOKENS) for p, t in zip(prompts, tickets)], timeout_s=60)
    assert reply["in_use"] == 0  # the prefill side released every handed-off block
    firsts = {rid: first for rid, first, error, _ in reply["done"]}
    assert all(error is None for _, _, error, _ in reply["done"])
    pushes = {rid: n for rid, _, _, n in reply["done"]}
    assert pushes["p4"] >= 4  # 64 tokens at a 16-token budget: pushed after every chunk, not at the end
    tokens = {f"p{i}": [] for i in range(len(prompts))}
    blocks = {t.request_id: list(t.block_ids) for t in tickets}
    assert run_decode(decode, tokens, len(prompts)) == []
    pool = decode.engine.kv_pool
    for i, p in enumerate(prompts):
        expected = hf_greedy(tiny_llama_dir, tuple(p), MAX_TOKENS)
        assert tokens[f"p{i}"] == expected
        assert firsts[f"p{i}"] == expected[0]
        full = len(p) // pool.layout.block_size  # the prompt's full blocks, which decoding never writes
        sent = reply["pool_bytes"][f"p{i}"][: full * pool.layout.block_bytes]
        assert pool.tensor[blocks[f"p{i}"][:full]].numpy().tobytes() == sent  # as the prefill pool held them
    assert decode.engine.check_invariants().num_in_use == 0
    assert decode.receiver.held_block_ids() == []


def test_cached_prefix_on_decode_is_not_sent_again(tiny_llama_dir: str, prefill: Peer, decode: RemoteKV) -> None:
    stem = random_prompts([16], 512, seed=12)[0]
    first, second = stem + [9, 8, 7], stem + [5, 4]
    t1 = decode.reserve(first, PARAMS, request_id="a")
    prefill.call("attach", [t1.to_wire()])
    prefill.call("prefill", [(first, "a", MAX_TOKENS)], timeout_s=60)
    tokens = {"a": [], "b": []}
    run_decode(decode, tokens, 1)
    t2 = decode.reserve(second, PARAMS, request_id="b")
    assert t2.num_skip_blocks == 4  # the stem's four 4-token blocks are cached on decode
    prefill.call("attach", [t2.to_wire()])
    prefill.call("prefill", [(second, "b", MAX_TOKENS)], timeout_s=60)
    run_decode(decode, tokens, 1)
    assert tokens["b"] == hf_greedy(tiny_llama_dir, tuple(second), MAX_TOKENS)
    assert decode.engine.check_invariants().num_in_use == 0


def test_abort_before_the_prefill_worker_opened_it_is_refused_there(prefill: Peer, decode: RemoteKV) -> None:
    ticket = decode.reserve(random_prompts([30], 512, seed=13)[0], PARAMS, request_id="x")
    assert decode.abort("x")
    assert decode.engine.check_invariants().num_in_use == 0  # nobody had opened it: freed at once
    [error] = prefill.call("attach", [ticket.to_wire()]).values()
    assert "unknown, expired or revoked" in error


def test_abort_during_prefill_frees_both_sides(prefill: Peer, decode: RemoteKV, transport: str) -> None:
    prompt = random_prompts([60], 512, seed=14)[0]
    ticket = decode.reserve(prompt, PARAMS, request_id="y")
    assert prefill.call("attach", [ticket.to_wire()]) == {"y": None}
    assert decode.abort("y")  # the client went away after the prefill worker opened the transfer
    if transport in ONE_SIDED:  # quarantined until the prefill side acknowledges
        # The prefill process may acknowledge the revocation at once (the receiver then holds
        # nothing), but the engine gets the blocks back only when pump() sees the fence.
        assert decode.receiver.held_block_ids() in (list(ticket.block_ids), [])
        assert decode.engine.check_invariants().num_in_use == len(ticket.block_ids)
    else:  # two-sided, no frame in flight: free at once
        assert decode.receiver.held_block_ids() == []
        assert decode.engine.check_invariants().num_in_use == 0
    reply = prefill.call("prefill", [(prompt, "y", MAX_TOKENS)], timeout_s=60)
    [(rid, first, error, _)] = reply["done"]
    assert rid == "y" and first is None and "aborted" in error
    assert reply["in_use"] == 0
    assert decode.pump(timeout_s=0.5) == []  # the fence (shm) frees silently: nothing to report
    assert decode.receiver.held_block_ids() == []
    assert decode.engine.check_invariants().num_in_use == 0


def test_every_architecture_crosses_kvfabric_with_the_tokens_of_transformers(tiny_model_dir: str) -> None:
    """Each family's tiny checkpoint (tests/conftest.py `tiny_model_dir`: windows, experts, Gemma's
    norms, fused checkpoints) through the real path: a prefill engine in another process pushes
    its blocks over shm into the decode engine, which decodes transformers' greedy tokens."""
    peer = Peer(prefill_main, tiny_model_dir, "shm", 16)
    allocator = ShmKVAllocator()
    remote = RemoteKV(make_engine(tiny_model_dir, role="decode", allocator=allocator), allocator)
    try:
        prompts = random_prompts([7, 37], 512, seed=13)  # 37: three chunks, past the 8- and 16-key windows
        tickets = [remote.reserve(p, PARAMS, request_id=f"f{i}") for i, p in enumerate(prompts)]
        assert all(t is not None for t in tickets)
        assert set(peer.call("attach", [t.to_wire() for t in tickets]).values()) == {None}
        reply = peer.call("prefill", [(p, t.request_id, MAX_TOKENS) for p, t in zip(prompts, tickets)], timeout_s=60)
        assert all(error is None for _, _, error, _ in reply["done"]) and reply["in_use"] == 0
        # 4-token blocks; where every layer slides a 16-key window (mistral), the decode's first
        # query (37) reads keys 22..: the 5 blocks before are neither reserved nor pushed
        window = ModelConfig.from_dir(tiny_model_dir).kv_window
        assert [t.num_skip_blocks for t in tickets] == ([0, 5] if window == 16 else [0, 0])
        assert reply["pushed_blocks"] == ({"f0": 2, "f1": 5} if window == 16 else {"f0": 2, "f1": 10})
        tokens: dict[str, list[int]] = {f"f{i}": [] for i in range(len(prompts))}
        assert run_decode(remote, tokens, len(prompts)) == []
        for i, p in enumerate(prompts):
            assert tokens[f"f{i}"] == hf_greedy(tiny_model_dir, tuple(p), MAX_TOKENS), f"prompt of {len(p)} tokens"
        assert remote.engine.check_invariants().num_in_use == (window > 0)  # a window's null block
    finally:
        remote.close()
        peer.stop()


def test_n_choices_cross_kvfabric_once_and_fork_on_the_decode_worker(tiny_llama_dir: str, prefill: Peer,
                                                                     decode: RemoteKV) -> None:
    """n = 4, seeded: the prompt is prefilled and pushed once (its 6 blocks); the other choices'
    first tokens ride with the first one in kvfabric's ready; the decode worker forks: 5 full
    blocks shared, the partial one copied 3 times; each choice equals a request of seed + i
    alone; every block comes back."""
    [prompt] = random_prompts([22], 512, seed=21)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, n=4, ignore_eos=True)
    ticket = decode.reserve(prompt, params, request_id="n4")
    assert ticket is not None and len(ticket.block_ids) == 6
    prefill.call("attach", [ticket.to_wire()])
    reply = prefill.call("prefill", [(prompt, "n4", MAX_TOKENS, {"temperature": 1.0, "seed": 11, "n": 4})],
                         timeout_s=60)
    assert reply["pushed_blocks"] == {"n4": 6} and reply["in_use"] == 0
    tokens = {choice_id("n4", i): [] for i in range(4)}
    arrived = 0
    deadline = time.monotonic() + 60
    while arrived < 4:  # the parent's and its choices' first tokens land together
        assert time.monotonic() < deadline
        for item in decode.pump(timeout_s=0.05):
            assert not isinstance(item, RemoteFailure)
            tokens[item.output.request_id] += item.output.new_token_ids
            arrived += 1
    assert decode.engine.block_pool.usage().num_in_use == 6 + 3
    while decode.engine.has_unfinished():
        for out in decode.engine.step():
            tokens[out.request_id] += out.new_token_ids
    alone = [make_engine(tiny_llama_dir).generate([prompt], choice_params(params, i))[0].token_ids for i in range(4)]
    assert [tokens[choice_id("n4", i)] for i in range(4)] == alone
    assert decode.engine.check_invariants().num_in_use == 0


def test_fp8_kv_crosses_at_half_the_bytes_with_the_monolithic_tokens_and_a_16_bit_decode_is_refused(
    tiny_llama_dir: str, transport: str,
) -> None:
    """FP8 KV as the pools hold it (e4m3 bytes, the scales the model's, the same on both
    sides): the decode engine continues with the tokens the monolithic FP8 engine gives, from
    blocks half a bfloat16 pool's bytes; a decode worker whose pool is bfloat16 is refused at
    the hello, by name."""
    prompts = random_prompts([5, 23, 41], 512, seed=21)
    want = {f"k{i}": c.token_ids for i, c in enumerate(
        make_engine(tiny_llama_dir, kv_cache_dtype="fp8").generate(prompts, PARAMS))}
    peer = Peer(prefill_main, tiny_llama_dir, transport, 16, "cpu", 512, 1, "fp8")
    allocator = kv_allocator("cpu", transport)
    engine = make_engine(tiny_llama_dir, role="decode", allocator=allocator, kv_cache_dtype="fp8")
    remote = RemoteKV(engine, allocator, ReceiverConfig(nixl=transport == "nixl"))
    try:
        assert remote.receiver.layout.dtype == "float8_e4m3fn" and remote.receiver.layout.dtype_bytes == 1
        tickets = [remote.reserve(p, PARAMS, request_id=f"k{i}") for i, p in enumerate(prompts)]
        assert set(peer.call("attach", [t.to_wire() for t in tickets]).values()) == {None}
        reply = peer.call("prefill", [(p, t.request_id, MAX_TOKENS) for p, t in zip(prompts, tickets)], timeout_s=60)
        assert all(error is None for _, _, error, _ in reply["done"]) and reply["in_use"] == 0
        tokens: dict[str, list[int]] = {rid: [] for rid in want}
        assert run_decode(remote, tokens, len(prompts)) == []
        assert tokens == want
        bf16_block = engine.layout.num_layers * 2 * engine.layout.block_size * engine.layout.num_kv_heads \
            * engine.layout.head_dim * 2
        for t in tickets:  # what crossed: the pushed blocks' bytes, e4m3 (half of bfloat16's)
            assert len(reply["pool_bytes"][t.request_id]) == len(t.block_ids) * bf16_block // 2
        assert engine.check_invariants().num_in_use == 0 and remote.receiver.held_block_ids() == []
    finally:
        remote.close()
    allocator = kv_allocator("cpu", transport)
    remote = RemoteKV(make_engine(tiny_llama_dir, role="decode", allocator=allocator, dtype="bfloat16"), allocator,
                      ReceiverConfig(nixl=transport == "nixl"))  # a 16-bit pool
    try:
        ticket = remote.reserve(prompts[0], PARAMS, request_id="k16")
        [error] = peer.call("attach", [ticket.to_wire()]).values()
        assert error is not None and "differs" in error and "kv-fp8" in error, error
        remote.abort("k16")
        assert remote.engine.check_invariants().num_in_use == 0
    finally:
        peer.stop()
        remote.close()
