"""KV handed off between workers of different tensor-parallel degrees, through real kvfabric:
a prefill worker split over P processes pushes each rank's KV heads, from that rank's own
pool, into the pools of a decode worker split over D processes, whatever P and D are; the
decode worker's greedy tokens equal the whole model's in one process, and every block on
every rank of both sides is free afterwards.

The prefill worker (tests/integration/prefill_peer.py) runs in a child process with its child
ranks; the decode worker runs here, its ranks children of this process. The tiny Llama has 2
KV heads: at D 4 each is replicated on two ranks, and each replica gets it.
"""
from __future__ import annotations

import pytest

from decode_worker.kv_receive import RemoteKV
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.parallel.tp_ranks import TensorRanks
from kvfabric import ReceiverConfig
from kvfabric.nixl_ranks import RankPool
from kvfabric.pools import kv_allocator, rank_allocator
from kvfabric.region import AgentRegion
from tests.conftest import skip_without_nixl
from tests.integration.fabric_peer import Peer
from tests.integration.prefill_peer import prefill_main
from tests.integration.reference import engine_config, make_engine, random_prompts
from tests.integration.test_disaggregated_kv import run_decode

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("p,d,transport,kv,rank_pools", [
    (2, 1, "shm", "auto", "mapped"), (1, 2, "tcp", "auto", "mapped"), (2, 4, "shm", "auto", "mapped"),
    (2, 2, "tcp", "auto", "mapped"), (2, 4, "nixl", "auto", "mapped"), (2, 4, "shm", "fp8", "mapped"),
    (1, 2, "nixl", "auto", "own agents"), (2, 1, "nixl", "auto", "own agents"), (2, 4, "nixl", "auto", "own agents")])
def test_prefill_and_decode_at_different_degrees_give_the_whole_models_tokens(
    tiny_llama_dir: str, p: int, d: int, transport: str, kv: str, rank_pools: str,
) -> None:
    """(nixl at 2 -> 4: each piece narrower than a block, written one row of it at a time;
    fp8: every rank's pool in e4m3, re-sharded byte for byte; own agents: each further rank's
    pool, on both sides, private to its process and registered with a NIXL agent of its own
    there, as a GPU rank's is, `kvfabric.nixl_ranks.RankPool`: a further prefill rank's agent posts
    the writes of its heads, into a further decode rank's pool through that rank's agent.)"""
    skip_without_nixl(transport)
    prompts = random_prompts([5, 16, 23, 41], 512, seed=p * 10 + d)
    reference = make_engine(tiny_llama_dir, kv_cache_dtype=kv)
    want = {f"r{i}": c.token_ids for i, c in enumerate(reference.generate(prompts, PARAMS))}
    prefill = Peer(prefill_main, tiny_llama_dir, transport, 16, "cpu", 512, p, kv, rank_pools, daemon=False)
    per_rank = RankPool if rank_pools == "own agents" else rank_allocator("cpu")
    ranks = TensorRanks(d, per_rank) if d > 1 else None
    config = engine_config(tiny_llama_dir, role="decode", kv_cache_dtype=kv)
    allocator = kv_allocator("cpu", transport)
    remote = None
    try:
        engine = LLMEngine(ranks.start(config) if ranks else config, allocator=allocator)
        remote = RemoteKV(engine, allocator, ReceiverConfig(nixl=transport == "nixl"))
        assert remote.refusal is None and remote.receiver.layout.world == d
        if rank_pools == "own agents" and d > 1:  # reachable through their agents alone
            assert remote.receiver.address.transports == ("nixl",)
            assert all(isinstance(r, AgentRegion) for r in remote.pools.regions[1:])
        tickets = [remote.reserve(prompt, PARAMS, request_id=f"r{i}") for i, prompt in enumerate(prompts)]
        assert set(prefill.call("attach", [t.to_wire() for t in tickets]).values()) == {None}
        reply = prefill.call("prefill", [(prompt, t.request_id, MAX_TOKENS) for prompt, t in zip(prompts, tickets)],
                             timeout_s=120)
        assert all(error is None for _, _, error, _ in reply["done"])
        assert reply["in_use"] == 0  # the prefill side's blocks (the same ids on each of its ranks) all free
        assert reply["rank_posts"] == (rank_pools == "own agents" and p > 1)  # its further ranks posted their heads
        tokens: dict[str, list[int]] = {rid: [] for rid in want}
        assert run_decode(remote, tokens, len(prompts)) == []
        assert tokens == want
        assert engine.check_invariants().num_in_use == 0  # every rank's pool: the same block ids, all free
        assert remote.receiver.held_block_ids() == [] and remote.receiver.num_reservations() == 0
        if ranks is not None:
            engine.release_followers()
    finally:
        prefill.stop()
        if remote is not None:
            remote.close()
        if ranks is not None:
            ranks.stop()
        allocator.close()
