"""Speculative decoding in one engine (engine/spec/spec_decode.py, spec_verify.py, speculator.py):
the n-gram proposer, the load-aware policy, exact greedy output and exact blocks."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.core.request import Request, SamplingParams
from engine.spec.spec_decode import NgramProposer, SpecPolicy
from engine.types import RequestId


def test_ngram_proposes_what_followed_the_most_recent_match_of_the_longest_suffix() -> None:
    p = NgramProposer(1, 3)
    assert p.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the later "1 2 3"
    assert p.lookup([5, 6, 1, 2, 4, 2], 3) == [4, 2]  # "4 2" and "2" alone: "2" matched, then 4 2
    assert p.lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.lookup([7], 3) == []
    assert NgramProposer(2, 3).lookup([5, 6, 1, 2, 4, 2], 3) == []  # "4 2" never came before


def req(rid: str, prompt: int = 8, max_tokens: int = 100, outputs: int = 1) -> Request:
    r = Request(RequestId(rid), list(range(prompt)), SamplingParams(max_tokens=max_tokens), arrival_time=0.0)
    r.output_token_ids = [1] * outputs
    return r


def test_the_policy_gives_fewer_tokens_as_the_batch_grows_and_none_at_its_limit() -> None:
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batched_tokens=32), 1024)
    for n, k in ((1, 4), (4, 4), (8, 3), (12, 1), (16, 1), (17, 0), (32, 0), (40, 0)):
        batch = [req(f"r{i}") for i in range(n)]
        assert [kk for _, kk in policy.plan(batch)] == ([k] * n if k else []), n
    near_end = req("end", max_tokens=10, outputs=8)  # two tokens left: one proposal and the target's own
    at_context = req("ctx", prompt=1020, outputs=2)  # 1022 of 1024 tokens
    assert [(r.request_id, k) for r, k in policy.plan([near_end, at_context])] == [("end", 1), ("ctx", 1)]
    doubtful, sure = req("doubtful"), req("sure")
    doubtful.spec_acceptance = 0.4  # about 40 % of its proposals kept lately: two of four are worth verifying
    assert [(r.request_id, k) for r, k in policy.plan([doubtful, sure])] == [("doubtful", 2), ("sure", 4)]


def test_priced_proposals_pay_alone_and_only_near_certain_ones_in_a_full_cpu_batch() -> None:
    """Step cost a = 10 ms, b = 2 ms a row (a CPU: a row costs what a request does), no KV term."""
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batched_tokens=64), 1024)
    cpu = (0.010, 0.002, 0.0, 0.0)
    alone = req("alone")
    alone.spec_acceptance = 0.5  # the j-th kept with 0.5^j: 0.5 x 12 > 1 x 2; 0.25 x 14 > 1.5 x 2; 0.125 x 16 < 1.75 x 2
    assert [(r.request_id, k) for r, k in policy.plan([alone], cpu)] == [("alone", 2)]
    batch = [req(f"r{i}") for i in range(32)]
    for r in batch:
        r.spec_acceptance = 0.5  # 0.5 x 74 ms < 32 x 2 ms: no proposal pays
    assert policy.plan(batch, cpu) == []
    batch[7].spec_acceptance = 0.95  # 0.95 x 74 > 32 x 2; 0.9025 x 76 > 32.95 x 2; 0.857 x 78 < 33.85 x 2
    assert [(r.request_id, k) for r, k in policy.plan(batch, cpu)] == [("r7", 2)]
    gpu = (0.006, 0.00002, 0.0, 0.0)  # a memory-bound step: a row is nearly free, so proposals pay up to the cap
    planned = {r.request_id: k for r, k in policy.plan(batch, gpu)}
    assert sum(planned.values()) == 32 and planned["r7"] == 4  # 32 decodes + 32 proposals, the surest first
    assert len(planned) == 29
    kv = (0.010, 0.002, 1e-5, 0.0)  # a row also reads its request's context: 1,000 tokens cost 10 ms more
    long = req("long", prompt=996)
    long.spec_acceptance = 0.6  # 997 tokens: a step 22 ms, a row 12 ms: 0.6 x 22 > 12; 0.36 x 34 < 1.6 x 12
    assert policy.plan([long], kv) == [(long, 1)]
    slow_draft = req("d")
    slow_draft.spec_acceptance = 0.5
    assert policy.plan([slow_draft], cpu, propose_s=0.02) == []  # 0.5 x 12 < 22: the draft costs more than it brings
    # speculating at all costs a step 3 ms more (the one-call decode path left): 1.75 tokens in
    # 16 + 3 ms beat 1 in 12, so alone it still pays; 2 ms more per step of 32 rows does not
    assert [(r.request_id, k) for r, k in policy.plan([alone], (0.010, 0.002, 0.0, 0.003))] == [("alone", 2)]
    assert policy.plan([alone], (0.010, 0.002, 0.0, 0.010)) == []  # 1.75 in 26 ms < 1 in 12


def test_a_request_whose_proposals_keep_failing_backs_off_twice_as_long_each_time() -> None:
    policy = SpecPolicy(SpeculativeConfig(method="ngram", min_acceptance=0.3, backoff_steps=4), 1024)
    r = req("r")
    paused_steps = []
    for _ in range(3):
        while policy.plan([r]):
            policy.verified(r, 4, 0)  # every proposal rejected
        start = policy.step
        while not policy.plan([r]):
            pass
        paused_steps.append(policy.step - start)
    assert paused_steps == [4, 8, 16]
    policy.verified(r, 4, 3)  # it proposes well again: the next failure starts over
    assert r.spec_failures == 0


@pytest.fixture
def engines(tiny_llama_dir: str) -> tuple[LLMEngine, LLMEngine]:
    def make(spec: SpeculativeConfig) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=tiny_llama_dir, detokenize=False, speculative=spec,
                                      cache=CacheConfig(block_size=4, num_blocks=256),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    # unpriced: on the tiny model a verifying step costs more than its proposals bring, and
    # these tests are about what verification does
    return make(SpeculativeConfig()), make(SpeculativeConfig(method="ngram", num_speculative_tokens=5, ngram_min=1,
                                                             priced=False))


def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (copying is what prompt lookup is for), of mixed lengths:
    one is long enough to be prefilled in chunks beside the others' decodes."""
    base = [11, 12, 13, 14, 15, 16, 17, 18]
    return [base * 3, [40, 41, 42, 40, 41, 42, 40], list(range(100, 190)) + base * 2, [7] * 5, base + [3, 4] * 6]


def test_greedy_tokens_are_identical_with_ngram_speculation_and_blocks_come_back(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    plain, spec = engines
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25, 60, 33, 47)]
    want = [c.token_ids for c in plain.generate(repetitive_prompts(), params)]
    got = [c.token_ids for c in spec.generate(repetitive_prompts(), params)]
    assert got == want
    c = spec.speculator.counters  # type: ignore[union-attr]
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0  # it did speculate, and was right sometimes
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens
    usage = spec.check_invariants()
    assert usage.num_in_use == 0  # every block back
    assert usage == plain.check_invariants()  # and the same ones cached: no rejected token's block


def test_proposals_are_cut_at_a_stop_token_and_at_max_tokens(engines: tuple[LLMEngine, LLMEngine]) -> None:
    plain, spec = engines
    prompt = [21, 22, 23, 24] * 4
    free_run = plain.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop = free_run[9]
    for params in (SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)),
                   SamplingParams(max_tokens=7, ignore_eos=True)):
        want = plain.generate([prompt], params)[0]
        got = spec.generate([prompt], params)[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert spec.check_invariants().num_in_use == 0


CHI2_DF5_P001 = 20.515
"""Chi-square critical value, 5 degrees of freedom, significance 0.001 (the test's alpha)."""


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("proposer", ["wrong", "right", "draft distribution"])
def test_rejection_sampling_keeps_the_target_distribution(proposer: str) -> None:
    import torch

    from engine.model.sampler import Sampler
    from engine.spec.spec_verify import verify

    vocab, trials = 6, 8000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
                           [0.0, 1.5, 0.2, 1.0, -0.5, 0.1],
                           [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])  # p_0, p_1 (after d_0), p_2 (after d_0 d_1)
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 2.0]]), dim=-1)
    sampler, drafts = Sampler(1234, "cpu"), torch.Generator().manual_seed(99)
    r = Request(RequestId("r"), [1, 2, 3], SamplingParams(max_tokens=10, temperature=1.0), arrival_time=0.0)
    first, second = [0] * vocab, [0] * vocab
    fixed = {"wrong": [4, 0], "right": [0, 1]}
    for _ in range(trials):
        if proposer == "draft distribution":
            proposals = [int(torch.multinomial(q[j], 1, generator=drafts)) for j in range(2)]
            v = verify(sampler, logits, r, proposals, q)
        else:
            proposals = fixed[proposer]
            v = verify(sampler, logits, r, proposals)
        tokens = [t for t, _ in v.tokens]
        assert tokens[: v.num_accepted] == proposals[: v.num_accepted] and len(tokens) == v.num_accepted + 1
        first[tokens[0]] += 1
        if tokens[0] == proposals[0]:  # the second token was drawn after d_0: it must follow p_1
            second[tokens[1]] += 1
    assert chi2(first, p[0].tolist()) < CHI2_DF5_P001
    assert chi2(second, p[1].tolist()) < CHI2_DF5_P001
    if proposer == "right":
        assert first[0] / trials == pytest.approx(float(p[0, 0]), abs=0.02)  # accepted as often as it is likely


@pytest.mark.parametrize("draft", ["the target itself", "its first layer"])
def test_greedy_tokens_are_identical_with_a_draft_model(tiny_llama_dir: str, tmp_path, draft: str) -> None:  # type: ignore[no-untyped-def]
    from engine.model.tiny_model import make_draft_model

    draft_dir = tiny_llama_dir if draft == "the target itself" else str(make_draft_model(tiny_llama_dir, tmp_path, 1))

    def make(spec: SpeculativeConfig) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=tiny_llama_dir, detokenize=False, speculative=spec,
                                      cache=CacheConfig(block_size=4, num_blocks=256),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    plain = make(SpeculativeConfig())
    spec = make(SpeculativeConfig(method="draft", draft_model_dir=draft_dir, num_speculative_tokens=3))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25, 60, 33, 47)]
    want = [c.token_ids for c in plain.generate(repetitive_prompts(), params)]
    assert [c.token_ids for c in spec.generate(repetitive_prompts(), params)] == want
    c = spec.speculator.counters  # type: ignore[union-attr]
    if draft == "the target itself":  # a perfect guess is always accepted: the draft's own KV is exact too
        assert c.num_draft_tokens > 50 and c.num_accepted_tokens == c.num_draft_tokens
    assert spec.check_invariants().num_in_use == 0
    proposer = spec.speculator.proposer  # type: ignore[union-attr]
    spec.speculator.propose(spec.scheduler)  # type: ignore[union-attr]  # a step with nobody left frees them
    assert proposer.shadows == {} and proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks


def test_a_seeded_sampled_request_gets_the_same_tokens_with_speculation_or_without(
        engines: tuple[LLMEngine, LLMEngine]) -> None:
    plain, spec = engines
    params = [SamplingParams(max_tokens=40, temperature=0.15, seed=s, ignore_eos=True) for s in range(5)]
    want = [c.token_ids for c in plain.generate(repetitive_prompts(), params)]
    got = [c.token_ids for c in spec.generate(repetitive_prompts(), params)]
    assert got == want  # each position's draw is the plain step's draw: proposals only decide how many at once
    assert spec.speculator.counters.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_speculation_under_preemption_keeps_tokens_and_blocks_exact(tiny_llama_dir: str) -> None:
    def make(spec: SpeculativeConfig) -> LLMEngine:  # 24 blocks of 4 tokens: five requests cannot all fit
        return LLMEngine(EngineConfig(model_dir=tiny_llama_dir, detokenize=False, speculative=spec,
                                      cache=CacheConfig(block_size=4, num_blocks=24),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    plain, spec = make(SpeculativeConfig()), make(SpeculativeConfig(method="ngram", num_speculative_tokens=5))
    prompts = [[11, 12, 13, 14] * 2, [40, 41, 42] * 3, [7, 8] * 4, [20, 21, 22, 23, 24] * 2, [5] * 6]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in spec.generate(prompts, params)] == want
    assert spec.scheduler.num_preemptions > 0  # preempted while speculating, recomputed from accepted tokens only
    assert spec.check_invariants().num_in_use == 0


def test_an_abort_between_speculative_steps_frees_every_block_and_the_drafts_kv(tiny_llama_dir: str) -> None:
    spec = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, detokenize=False,
                                  speculative=SpeculativeConfig(method="draft", draft_model_dir=tiny_llama_dir),
                                  cache=CacheConfig(block_size=4, num_blocks=128)))
    keep = spec.add_request([11, 12, 13, 14] * 3, SamplingParams(max_tokens=30, ignore_eos=True))
    gone = spec.add_request([40, 41, 42] * 4, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        spec.step()
    proposer = spec.speculator.proposer  # type: ignore[union-attr]
    assert {keep, gone} <= set(proposer.shadows)  # both speculated: each has KV in the draft's pool too
    assert spec.abort(gone)
    while spec.has_unfinished():
        spec.step()
    assert spec.check_invariants().num_in_use == 0
    spec.speculator.propose(spec.scheduler)  # type: ignore[union-attr]
    assert proposer.shadows == {} and proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks


def test_make_tiny_model_writes_a_draft_of_a_checkpoint(tiny_llama_dir: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json as _json

    from cluster.cli import main

    assert main(["make-tiny-model", str(tmp_path / "d"), "--draft-of", tiny_llama_dir, "--draft-layers", "1"]) == 0
    assert _json.loads((tmp_path / "d" / "config.json").read_text())["num_hidden_layers"] == 1
    assert (tmp_path / "d" / "tokenizer.json").read_bytes() == (Path(tiny_llama_dir) / "tokenizer.json").read_bytes()
    assert main(["make-tiny-model", str(tmp_path / "e"), "--draft-of", tiny_llama_dir, "--draft-layers", "9"]) == 2
    assert "keeps 1 to 2 layers, not 9" in capsys.readouterr().err


def test_the_step_cost_learns_what_speculating_at_all_adds() -> None:
    from engine.spec.spec_cost import SpecCost

    cost = SpecCost()
    cost.observe(1, 100, False, 0.012)
    assert cost.latest is None  # the rows have not varied
    for i, (rows, spec) in enumerate(((1, False), (3, True), (2, True), (1, False), (5, True), (4, True)) * 20):
        kv = 200 + (137 * i) % 500  # contexts vary on their own
        cost.observe(rows, kv, spec, 0.010 + 0.002 * rows + 1e-6 * kv + 0.003 * spec)
    a, b, c, o = cost.latest  # type: ignore[misc]
    assert (a, b, c, o) == pytest.approx((0.010, 0.002, 1e-6, 0.003), rel=0.02)
    plain = SpecCost()  # never speculated: no overhead term to fit, it is 0
    for rows in (1, 2, 3) * 10:
        plain.observe(rows, 50 * rows, False, 0.01 + 0.002 * rows)
    assert plain.latest is not None and plain.latest[3] == 0.0


def test_a_new_request_starts_from_what_the_engines_proposals_kept_lately() -> None:
    """On text where proposals fail, each new request would otherwise pay again to learn it."""
    from engine.spec.spec_decode import PRIOR_RELAX_STEPS

    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batched_tokens=64), 1024)
    cpu = (0.010, 0.002, 0.0, 0.003)  # alone, 2 proposals at 0.5 pay (1.75 in 19 ms > 1 in 12)
    fresh = req("fresh")
    assert policy.acceptance(fresh) == 1.0 and policy.plan([fresh], cpu) == [(fresh, 4)]
    for i in range(40):  # other requests' proposals all failed
        policy.verified(req(f"old{i}"), 2, 0)
    assert policy.prior < 0.15
    assert policy.plan([req("new")], cpu) == []  # 1.1 tokens in 15 ms < 1 in 12: it does not propose
    sure = req("sure")
    sure.spec_acceptance = 0.9  # its own record outweighs the prior
    assert policy.plan([sure], cpu) == [(sure, 4)]
    for _ in range(2 * PRIOR_RELAX_STEPS):  # nothing verified for a while: the prior drifts back
        policy.plan([])
    assert policy.prior > 0.85 and policy.plan([req("later")], cpu) != []
