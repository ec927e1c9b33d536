"""The overlapped decode (engine/model/overlap.py) on CPU: the same path a GPU worker takes by
default, checked for the same tokens as the engine without it, and for the blocks a request
that ends with a step in flight keeps until that step lands."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams


def _engine(model: str, overlap: bool, max_seqs: int = 8, num_blocks: int = 400) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model, overlap=overlap, max_model_len=256,
                                  cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs)))


def _workload(vocab: int, n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy, seeded sampled and logprob requests of uneven lengths."""
    g = random.Random(seed)
    prompts = [[g.randrange(3, vocab) for _ in range(g.randrange(3, 20))] for _ in range(n)]
    params = [SamplingParams(max_tokens=g.randrange(1, 30), ignore_eos=True, logprobs=i % 3 == 0,
                             temperature=0.0 if i % 2 else 0.8, seed=None if i % 2 else 100 + i) for i in range(n)]
    return prompts, params


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
         late: int = 0) -> dict[str, tuple[list[int], list[float], str | None]]:
    """All requests to the end, the last `late` of them added while the others decode."""
    ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in
           enumerate(zip(prompts[: len(prompts) - late], params, strict=False))]
    got: dict[str, tuple[list[int], list[float], str | None]] = {i: ([], [], None) for i in ids}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 6:
            for i in range(len(prompts) - late, len(prompts)):
                got[engine.add_request(prompts[i], params[i], request_id=f"r{i}")] = ([], [], None)
        for o in engine.step():
            tokens, logprobs, _ = got[o.request_id]
            got[o.request_id] = (tokens + o.new_token_ids, logprobs + o.new_logprobs,
                                 o.finish_reason.value if o.finish_reason else None)
    assert engine.overlap.current is None
    return got


def test_overlapped_decode_gives_the_same_tokens_and_logprobs_and_frees_every_block(tiny_llama_dir: str) -> None:
    """(The padded buckets with overlap, the GPU's path: tests/unit/test_triton_kernels.py.)"""
    plain = _engine(tiny_llama_dir, overlap=False)
    vocab = plain.model_config.vocab_size
    prompts, params = _workload(vocab)
    want = _run(plain, prompts, params, late=3)
    overlapped = _engine(tiny_llama_dir, overlap=True)
    got = _run(overlapped, prompts, params, late=3)
    assert set(got) == set(want)
    for rid, (tokens, logprobs, reason) in want.items():
        assert got[rid][0] == tokens, rid
        assert got[rid][2] == reason == "length"
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-5)
    assert overlapped.overlap.num_guessed_rows > 100  # most decode rows were launched ahead
    assert overlapped.overlap.num_wasted_rows == 0  # max_tokens is known: no row past it
    usage = overlapped.check_invariants()
    assert usage.num_in_use == 0 and overlapped.kv.num_held == 0


class _Copied:
    """CUDA's host copy injected on CPU: each draw tensor copied to a fresh one, an event per flight."""

    def __init__(self) -> None:
        self.copies = 0
        self.waited = 0

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        return t.clone()

    def recorded(self) -> _Copied:
        return self

    def synchronize(self) -> None:
        self.waited += 1


def test_the_gpu_flights_host_copies_carry_tokens_logprobs_and_alternatives(tiny_llama_dir: str) -> None:
    """The path a flight takes on CUDA (its draw copied to the host behind an event), with top
    alternatives on some rows: the same tokens, logprobs and alternatives as without overlap."""
    prompts = [[5, 9, 13, 17], [7, 7, 8], [21, 3, 4, 9, 10, 11], [6, 6]]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, logprobs=i % 2 == 0, top_logprobs=3 if i == 0 else 0,
                             temperature=0.8 if i == 3 else 0.0, seed=7) for i in range(4)]
    want = _engine(tiny_llama_dir, overlap=False).generate(prompts, params)
    e = _engine(tiny_llama_dir, overlap=True)
    e.overlap.host_copy = copied = _Copied()
    got = e.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert [t.token_ids for t in g.top_logprobs] == [t.token_ids for t in w.top_logprobs]
    assert [len(t.token_ids) for t in got[0].top_logprobs] == [3] * 14 and got[1].top_logprobs == []
    assert e.overlap.num_guessed_rows > 20 and copied.waited > 10
    assert copied.copies >= 4 * copied.waited  # tokens, logprobs and both halves of the alternatives
    assert e.check_invariants().num_in_use == 0


def test_a_request_that_stops_in_flight_keeps_its_blocks_until_the_step_lands(tiny_llama_dir: str) -> None:
    plain = _engine(tiny_llama_dir, overlap=False)
    prompt = [5, 9, 13, 17, 21]
    free = plain.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stop = free[6]
    first = free.index(stop)  # the stop token's first appearance ends the request
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    want = plain.generate([prompt], params)[0]
    assert want.token_ids == free[: first + 1] and want.finish_reason.value == "stop"

    e = _engine(tiny_llama_dir, overlap=True)
    other = e.add_request([7, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    rid = e.add_request(prompt, params)
    tokens: list[int] = []
    while True:
        outs = {o.request_id: o for o in e.step()}
        if rid in outs:
            tokens += outs[rid].new_token_ids
            if outs[rid].finished:
                break
    assert tokens == want.token_ids
    # the step in flight computes a row for it: its blocks are held, not free, until it lands
    assert e.overlap.current is not None and rid in e.scheduler.in_flight
    assert e.kv.num_held == 1 and e.scheduler.held_in_flight == [rid]
    e.step()
    assert e.kv.num_held == 0 and e.overlap.num_wasted_rows == 1
    e.abort(other)  # the other's step in flight lands at once: nothing stays held for it
    assert e.overlap.current is None and e.kv.num_held == 0
    assert e.check_invariants().num_in_use == 0


def test_no_step_is_guessed_while_a_request_waits_to_start_or_blocks_run_short(tiny_llama_dir: str) -> None:
    e = _engine(tiny_llama_dir, overlap=True, num_blocks=12)  # 48 slots for two requests of 30 tokens
    a = e.add_request(list(range(3, 13)), SamplingParams(max_tokens=20, ignore_eos=True))
    e.step()  # the prompt
    e.step()  # a decode, launched and landed with the next one in flight
    assert e.overlap.current is not None
    b = e.add_request(list(range(20, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    e.step()  # b waits: the flight lands alone and the scheduler starts b next
    assert e.overlap.current is None
    got = {a: [], b: []}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id] += o.new_token_ids
    plain = _engine(tiny_llama_dir, overlap=False, num_blocks=12)
    want = plain.generate([list(range(20, 30))], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    assert got[b] == want
    assert e.scheduler.num_preemptions > 0  # the pool ran short: the scheduler preempted, not the guess
    assert e.check_invariants().num_in_use == 0 and e.kv.num_held == 0
