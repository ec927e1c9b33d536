"""Prefill role -> block copy -> decode role equals the monolithic engine (in one process).

This is the contract kvfabric builds on: P hands off computed blocks and the first
token; D reserves blocks (reusing its cached prefix), receives the missing ones, and
decodes from there.
"""
from __future__ import annotations

from engine.core.request import FinishReason, SamplingParams
from tests.integration.reference import hf_greedy, make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


class CollectingHandoff:
    def __init__(self) -> None:
        self.finished: dict[str, tuple[list[int], int]] = {}
        self.chunk_calls: dict[str, list[int]] = {}

    def on_blocks_computed(self, request) -> None:
        self.chunk_calls.setdefault(request.request_id, []).append(request.num_computed_tokens)

    def on_prefill_finished(self, request, block_ids, first_token_id) -> None:
        self.finished[request.request_id] = (list(block_ids), first_token_id)


def _disaggregated(model_dir: str, prompts: list[list[int]], prefill, decode, handoff,
                   params: SamplingParams = PARAMS) -> list[list[int]]:
    rids = [prefill.add_request(p, params) for p in prompts]
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finish_reason is FinishReason.PREFILL_DONE
    tokens = {}
    for rid, prompt in zip(rids, prompts, strict=True):
        src_blocks, first = handoff.finished[rid]
        res = decode.connector.reserve(prompt, params, request_id=rid)
        assert res is not None and len(res.block_ids) == len(src_blocks)
        start = res.num_skip_blocks  # cached on D, or before its first query's window: not sent
        decode.kv_pool.tensor[res.block_ids[start:]] = prefill.kv_pool.tensor[src_blocks[start:]]
        prefill.connector.give_back(rid)
        tokens[rid] = [first]
        decode.connector.landed(rid, first)
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[r] for r in rids]


def test_prefill_then_decode_equals_transformers(tiny_model_dir: str) -> None:
    prompts = random_prompts([5, 16, 23, 40], 512, seed=4)
    handoff = CollectingHandoff()
    prefill = make_engine(tiny_model_dir, role="prefill", budget=16, handoff=handoff)
    decode = make_engine(tiny_model_dir, role="decode")
    outputs = _disaggregated(tiny_model_dir, prompts, prefill, decode, handoff)
    for p, toks in zip(prompts, outputs, strict=True):
        assert toks == hf_greedy(tiny_model_dir, tuple(p), 10)
    # the 40-token prompt took three 16-token-budget steps: the hook saw every chunk boundary
    assert max(handoff.chunk_calls.values(), key=len)[-1] == 40
    for engine in (prefill, decode):
        assert engine.check_invariants().num_in_use == (engine.kv.null_block is not None)  # a window's null block


def test_decode_reuses_its_cached_prefix_so_only_missing_blocks_travel(tiny_llama_dir: str) -> None:
    stem = random_prompts([12], 512, seed=5)[0]
    first, second = stem + [7], stem + [9, 10, 11]
    handoff = CollectingHandoff()
    prefill = make_engine(tiny_llama_dir, role="prefill", handoff=handoff)
    decode = make_engine(tiny_llama_dir, role="decode")
    _disaggregated(tiny_llama_dir, [first], prefill, decode, handoff)
    res = decode.connector.reserve(second, PARAMS, request_id="probe")
    assert res is not None and res.num_cached_tokens == 12  # three full blocks of the stem
    decode.abort("probe")
    out = _disaggregated(tiny_llama_dir, [second], prefill, decode, handoff)
    assert out[0] == hf_greedy(tiny_llama_dir, tuple(second), 10)
    assert decode.check_invariants().num_in_use == 0


def test_handed_off_blocks_stay_in_use_until_released(tiny_llama_dir: str) -> None:
    handoff = CollectingHandoff()
    prefill = make_engine(tiny_llama_dir, role="prefill", handoff=handoff)
    rid = prefill.add_request(list(range(3, 12)), PARAMS)
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.check_invariants().num_in_use == 3
    assert prefill.connector.give_back(rid)
    assert not prefill.connector.give_back(rid)
    assert prefill.check_invariants().num_in_use == 0


def test_abort_frees_a_reservation_and_a_handoff(tiny_llama_dir: str) -> None:
    handoff = CollectingHandoff()
    prefill = make_engine(tiny_llama_dir, role="prefill", handoff=handoff)
    decode = make_engine(tiny_llama_dir, role="decode")
    rid = prefill.add_request(list(range(3, 12)), PARAMS)
    while prefill.has_unfinished():
        prefill.step()
    assert decode.connector.reserve(list(range(3, 12)), PARAMS, request_id=rid) is not None
    assert prefill.abort(rid) and decode.abort(rid)
    assert prefill.check_invariants().num_in_use == 0
    assert decode.check_invariants().num_in_use == 0


def test_reservation_refused_when_decode_pool_is_full(tiny_llama_dir: str) -> None:
    decode = make_engine(tiny_llama_dir, role="decode", num_blocks=4)
    assert decode.connector.reserve(list(range(3, 15)), PARAMS, request_id="a") is not None
    assert decode.connector.reserve(list(range(20, 30)), PARAMS, request_id="b") is None
    assert decode.check_invariants().num_in_use == 3


def test_sampling_controls_give_the_same_tokens_whichever_worker_samples(tiny_llama_dir: str) -> None:
    """Penalties, logit_bias and min_tokens read only the request's own tokens: the first
    token drawn on the prefill worker and the rest on the decode worker equal one engine's."""
    prompts = random_prompts([6, 19, 33], 512, seed=5)
    for params in (SamplingParams(max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4,
                                  logit_bias=((17, 3.0), (99, -100.0))),
                   SamplingParams(max_tokens=12, temperature=0.9, seed=3, min_p=0.2, min_tokens=12,
                                  presence_penalty=-0.5)):
        handoff = CollectingHandoff()
        prefill = make_engine(tiny_llama_dir, role="prefill", budget=16, handoff=handoff)
        decode = make_engine(tiny_llama_dir, role="decode")
        alone = [c.token_ids for c in make_engine(tiny_llama_dir).generate(prompts, params)]
        plain = [c.token_ids for c in make_engine(tiny_llama_dir).generate(
            prompts, SamplingParams(max_tokens=12, temperature=params.temperature, seed=params.seed))]
        assert _disaggregated(tiny_llama_dir, prompts, prefill, decode, handoff, params) == alone
        assert alone != plain  # the controls changed the tokens
        assert all(99 not in t for t in alone)
