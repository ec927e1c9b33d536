"""The engine through its KV seam alone (engine/kv_connector.py), with a fake mover in place of
kvfabric and the KV tier: KV that lands late, transfers that fail with and without a writer
that may still write, fences, a push's loan past its request's end, and the tier's loans. The
engine's block accounting holds after each (`check_invariants`: every block in use is a
request's or a loan's)."""
from __future__ import annotations

import pytest

from engine.core.block_pool import BlockHash
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.core.request import FinishReason, SamplingParams
from engine.types import RequestId

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 17, 33, 65, 129, 257, 3, 7, 11]  # 10 tokens: 3 blocks of 4


def engine(model_dir: str, role: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, role=role, cache=CacheConfig(block_size=4, num_blocks=32),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64), max_model_len=128))


class FakeMover:
    """Moves a prompt's KV from a prefill engine into a decode engine's reserved blocks by a
    plain tensor copy, when the test says (as kvfabric would land it, late or never)."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        self.prefill, self.decode = prefill, decode
        self.first: dict[str, int] = {}
        self.src: dict[str, list[int]] = {}
        prefill.handoff = self

    def on_blocks_computed(self, request) -> None:  # noqa: ANN001  (the engine's KVHandoff)
        pass

    def on_prefill_finished(self, request, block_ids, first_token_id) -> None:  # noqa: ANN001
        self.src[request.request_id], self.first[request.request_id] = list(block_ids), first_token_id

    def prefill_for(self, rid: str, prompt: list[int]) -> None:
        self.prefill.connector.lend(rid)
        self.prefill.add_request(prompt, PARAMS, request_id=rid)
        while rid not in self.first:
            self.prefill.step()

    def land(self, rid: str, block_ids: list[int], skip: int) -> None:
        src = self.src[rid]
        self.decode.kv_pool.tensor[block_ids[skip:]] = self.prefill.kv_pool.tensor[src[skip:]]
        self.prefill.connector.give_back(rid)
        self.decode.connector.landed(RequestId(rid), self.first[rid])


@pytest.fixture(scope="module")
def greedy(tiny_llama_dir: str) -> list[int]:
    return engine(tiny_llama_dir, "both").generate([PROMPT], PARAMS)[0].token_ids


def run(e: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_kv_that_lands_late_joins_the_batch_and_decodes_as_the_monolithic_engine(tiny_llama_dir: str,
                                                                                  greedy: list[int]) -> None:
    prefill, decode = engine(tiny_llama_dir, "prefill"), engine(tiny_llama_dir, "decode")
    mover = FakeMover(prefill, decode)
    res = decode.connector.reserve(PROMPT, PARAMS, request_id="late")
    assert res is not None and res.block_ids == [0, 1, 2] and res.num_skip_blocks == 0
    decode.add_request([4, 8, 15, 16, 23, 42], PARAMS, request_id="local")
    for _ in range(3):  # the other request decodes; the reserved one waits for its KV
        decode.step()
        assert decode.scheduler.requests[RequestId("late")].num_computed_tokens == 0
    local = decode.scheduler.requests[RequestId("local")]
    assert decode.check_invariants().num_in_use == 3 + len(local.block_ids)  # the reservation's and the local one's
    mover.prefill_for("late", PROMPT)
    assert prefill.connector.num_lent == 1
    mover.land("late", res.block_ids, res.num_skip_blocks)
    tokens = run(decode)
    assert [mover.first["late"], *tokens["late"]] == greedy
    assert decode.check_invariants().num_in_use == 0 and prefill.check_invariants().num_in_use == 0
    assert decode.connector.num_lent == 0 and prefill.connector.num_lent == 0


def test_a_failed_transfer_whose_writer_may_still_write_quarantines_its_blocks_until_fenced(tiny_llama_dir: str) -> None:
    decode = engine(tiny_llama_dir, "decode")
    res = decode.connector.reserve(PROMPT, PARAMS, request_id="r")
    assert res is not None and res.block_ids == [0, 1, 2]
    assert decode.connector.end("r", writer_may_write=True)
    assert RequestId("r") not in decode.scheduler.requests
    assert decode.check_invariants().num_in_use == 3 and decode.connector.num_lent == 1  # quarantined
    other = decode.connector.reserve(PROMPT, PARAMS, request_id="s")  # the quarantined blocks are not handed out
    assert other is not None and set(other.block_ids).isdisjoint({0, 1, 2})
    assert decode.connector.fenced("r") and not decode.connector.fenced("r")
    assert decode.connector.end("s")
    assert decode.check_invariants().num_in_use == 0 and decode.connector.num_lent == 0


def test_a_failed_transfer_with_no_writer_left_frees_its_blocks_at_once(tiny_llama_dir: str) -> None:
    decode = engine(tiny_llama_dir, "decode")
    assert decode.connector.reserve(PROMPT, PARAMS, request_id="r") is not None
    assert decode.connector.end("r") and not decode.connector.end("r")
    assert decode.check_invariants().num_in_use == 0 and not decode.connector.fenced("r")


def test_a_push_keeps_its_loan_past_the_end_of_its_request(tiny_llama_dir: str) -> None:
    prefill = engine(tiny_llama_dir, "prefill")
    prefill.connector.lend("p")
    prefill.add_request(PROMPT, PARAMS, request_id="p")
    outs = [o for _ in range(4) for o in prefill.step()]
    assert [o.finish_reason for o in outs] == [FinishReason.PREFILL_DONE]
    assert not prefill.abort("p")  # ended already; its blocks are the push's
    assert prefill.check_invariants().num_in_use == 3 and prefill.connector.num_lent == 1
    assert prefill.connector.give_back("p") and not prefill.connector.give_back("p")
    assert prefill.check_invariants().num_in_use == 0


def test_the_kv_tier_borrows_cached_blocks_and_publishes_fetched_ones(tiny_llama_dir: str) -> None:
    e = engine(tiny_llama_dir, "both")
    e.generate([PROMPT], PARAMS)
    stored = [h for ev in e.take_kv_events() if ev.kind == "stored" for h in ev.block_hashes]
    assert len(stored) == 3  # 15 tokens computed: 3 full blocks
    lent = e.connector.lend_cached("offload-1", stored)
    assert [h for _, h in lent] == stored and e.connector.num_lent == 1
    assert e.check_invariants().num_in_use == 3
    assert e.connector.give_back("offload-1") and e.check_invariants().num_in_use == 0
    assert e.connector.lend_cached("offload-2", [BlockHash(b"\x01" * 32)]) == [] and e.connector.num_lent == 0
    fetched = [BlockHash(bytes([i]) * 32) for i in (7, 8)]
    blocks = e.connector.lend_new("fetch-1", 2)
    assert blocks is not None and len(blocks) == 2 and e.check_invariants().num_in_use == 2
    e.connector.publish("fetch-1", fetched, parent=None)
    assert e.connector.cached_run([*fetched, BlockHash(b"\x09" * 32)]) == 2
    assert e.connector.num_lent == 0 and e.check_invariants().num_in_use == 0
    assert e.connector.lend_new("fetch-2", 33) is None  # more than the pool holds
