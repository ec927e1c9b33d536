"""n choices from one prompt (engine/core/forks.py): computed once, forked at the first token,
each choice drawing as a request of seed + i would; the prompt's full blocks shared, the
partial last one copied; on a prefill worker the other choices' first tokens are drawn and
sent, and the decode worker forks with them, so the KV crosses once."""
from __future__ import annotations

import pytest

from engine.core.forks import choice_params
from engine.core.request import InvalidRequestError, RequestStatus, SamplingParams
from engine.types import choice_id
from tests.integration.reference import make_engine, random_prompts
from tests.integration.test_engine_roles import CollectingHandoff

PARAMS = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=4, ignore_eos=True)


def _alone(model_dir: str, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    return [make_engine(model_dir).generate([prompt], choice_params(params, i))[0].token_ids for i in range(params.n)]


def test_n_choices_share_one_prefill_and_equal_their_seeds_alone(tiny_llama_dir: str) -> None:
    [prompt] = random_prompts([21], 512, seed=1)  # 21 tokens in 4-token blocks: 5 full, 1 partial
    e = make_engine(tiny_llama_dir, budget=32)
    rid = e.add_request(prompt, PARAMS)
    first = e.step()  # the whole prompt, then the fork: 4 first tokens
    assert sorted(o.request_id for o in first) == sorted(choice_id(rid, i) for i in range(4))
    assert e.block_pool.usage().num_in_use == 6 + 3  # the parent's 6; 5 shared, 1 copied per child
    assert e.num_prompt_tokens == 21  # the prompt counts once
    tokens = {o.request_id: list(o.new_token_ids) for o in first}
    while e.has_unfinished():
        for o in e.step():
            tokens[o.request_id] += o.new_token_ids
    got = [tokens[choice_id(rid, i)] for i in range(4)]
    assert got == _alone(tiny_llama_dir, prompt, PARAMS) and len({tuple(t) for t in got}) == 4
    assert e.check_invariants().num_in_use == 0
    greedy = e.generate([prompt], SamplingParams(max_tokens=5, n=3))
    assert len(greedy) == 3 and greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


def test_the_decode_worker_forks_what_one_prefill_pushed(tiny_llama_dir: str) -> None:
    [prompt] = random_prompts([18], 512, seed=2)
    handoff = CollectingHandoff()
    prefill = make_engine(tiny_llama_dir, role="prefill", budget=16, handoff=handoff)
    decode = make_engine(tiny_llama_dir, role="decode")
    rid = prefill.add_request(prompt, PARAMS)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    [out] = outs
    assert len(out.choice_tokens) == 3  # the other choices' first tokens, drawn on the prefill worker
    res = decode.connector.reserve(prompt, PARAMS, request_id=rid)
    src, first = handoff.finished[rid]
    assert res is not None and len(res.block_ids) == len(src) == 5  # one reservation, one push
    decode.kv_pool.tensor[res.block_ids] = prefill.kv_pool.tensor[src]
    prefill.connector.give_back(rid)
    tokens = {}
    for o in decode.connector.landed(rid, first, [t for t, _ in out.choice_tokens]):
        tokens[o.request_id] = list(o.new_token_ids)
    assert decode.block_pool.usage().num_in_use == 5 + 3  # 4 full blocks shared, the partial one copied
    while decode.has_unfinished():
        for o in decode.step():
            tokens[o.request_id] += o.new_token_ids
    assert [tokens[choice_id(rid, i)] for i in range(4)] == _alone(tiny_llama_dir, prompt, PARAMS)
    assert decode.check_invariants().num_in_use == 0 and prefill.check_invariants().num_in_use == 0
    with pytest.raises(InvalidRequestError, match="has 4 choices; 2 first tokens came"):
        decode.connector.reserve(prompt, PARAMS, request_id="other")
        decode.connector.landed("other", first, [1])


def test_a_choice_without_a_block_for_its_copy_recomputes_and_draws_the_same(tiny_llama_dir: str) -> None:
    [prompt] = random_prompts([9], 512, seed=3)  # 3 blocks, the last partial
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=3, ignore_eos=True)
    e = make_engine(tiny_llama_dir, num_blocks=4, budget=16)  # room for the parent and one copy
    rid = e.add_request(prompt, params)
    assert {o.request_id for o in e.step()} == {rid, choice_id(rid, 1)}
    late = e.scheduler.requests[choice_id(rid, 2)]
    assert late.status is RequestStatus.PREEMPTED and late.block_ids == [] and late.num_computed_tokens == 0
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished():
        for o in e.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    alone = _alone(tiny_llama_dir, prompt, params)
    assert tokens[choice_id(rid, 2)] == alone[2]  # its prompt and first token recomputed: the same draw
    assert e.check_invariants().num_in_use == 0


def test_n_is_bounded() -> None:
    with pytest.raises(InvalidRequestError, match=r"n must be in \[1, 16\]"):
        SamplingParams(n=17)


def test_a_request_id_cannot_take_or_be_taken_by_a_choice(tiny_llama_dir: str) -> None:
    """`a#1` then `a` with n=2 once killed the engine loop (KeyError in the scheduler's `del` at
    the fork, which overwrote `a#1`); both orders are now refused up front and the engine runs on."""
    [prompt] = random_prompts([9], 512, seed=4)
    e = make_engine(tiny_llama_dir, budget=16)
    with pytest.raises(InvalidRequestError, match=r"request id 'a#1' has the form of a choice's id"):
        e.add_request(prompt, SamplingParams(max_tokens=3), request_id="a#1")
    e.add_request(prompt, SamplingParams(max_tokens=3, n=2), request_id="b")
    e.add_request(prompt, SamplingParams(max_tokens=3), request_id="c")
    with pytest.raises(InvalidRequestError, match=r"request id 'c' is already in use"):
        e.add_request(prompt, SamplingParams(max_tokens=3, n=2), request_id="c")
    e.add_request(prompt, SamplingParams(max_tokens=3), request_id="d#x")  # not a choice's form: free to use
    with pytest.raises(InvalidRequestError, match=r"request id 'd#x#1' has the form"):
        e.add_request(prompt, SamplingParams(max_tokens=3), request_id="d#x#1")
    done: dict[str, list[int]] = {}
    while e.has_unfinished():
        for o in e.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert sorted(done) == ["b", "b#1", "c", "d#x"] and all(len(t) == 3 for t in done.values())
    assert e.check_invariants().num_in_use == 0
