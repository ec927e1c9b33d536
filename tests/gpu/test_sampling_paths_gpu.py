"""Engine paths that have run on CPU only until a GPU is lent, on CUDA against the CPU engine
(float32, the tiny Llama: tokens exact, log-probabilities within 1e-4): the sampling
controls (penalties, logit bias, min_tokens), top alternatives, prompt log-probabilities
made a slice of rows at a time, and a request forked into n choices (its last block copied
in the device pool), all through the GPU's default path (decode buffers, CUDA graphs,
overlap where the request allows it)."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from tests.integration.reference import random_prompts

TOLERANCE = 1e-4


def engine(model_dir: str, device: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device=device, dtype="float32",
                                  cache=CacheConfig(block_size=16, num_blocks=512),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256)))


def both(model_dir: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):  # type: ignore[no-untyped-def]
    cpu, gpu = engine(model_dir, "cpu"), engine(model_dir, "cuda")
    want, got = cpu.generate(prompts, params), gpu.generate(prompts, params)
    assert gpu.check_invariants().num_in_use == 0
    return want, got


def test_sampling_controls_and_top_alternatives_on_cuda_equal_the_cpu_engine(tiny_llama_dir: str) -> None:
    prompts = random_prompts([7, 30, 61], 512, seed=21)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3,
                             repetition_penalty=1.2, logit_bias=((5, -100.0), (9, 3.0)), min_tokens=8,
                             logprobs=True, top_logprobs=5),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=5, min_p=0.05, logprobs=True),
              SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=3)]
    want, got = both(tiny_llama_dir, prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=TOLERANCE)
        assert [t.token_ids for t in g.top_logprobs] == [t.token_ids for t in w.top_logprobs]
    assert 5 not in got[0].token_ids


def test_prompt_logprobs_made_in_slices_on_cuda_equal_the_cpu_engine(tiny_llama_dir: str) -> None:
    """A 600-token prompt: its logits are made 256 rows at a time (engine/model/prompt_logprobs.py)."""
    prompts = random_prompts([600, 20], 512, seed=22)
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=4)
    want, got = both(tiny_llama_dir, prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        assert [p.rank for p in g.prompt_logprobs] == [p.rank for p in w.prompt_logprobs]
        assert [p.logprob for p in g.prompt_logprobs] == pytest.approx([p.logprob for p in w.prompt_logprobs],
                                                                       abs=TOLERANCE)


def test_n_choices_forked_on_cuda_equal_the_cpu_engine(tiny_llama_dir: str) -> None:
    """A 37-token prompt (its last block partly filled, so each choice's copy is a real copy)."""
    prompts = random_prompts([37], 512, seed=23)
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=4, temperature=0.9, seed=7, logprobs=True)
    want, got = both(tiny_llama_dir, prompts, params)
    assert len(got) == 4 and [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len({tuple(g.token_ids) for g in got}) > 1  # the choices differ: each drew as seed + i
