"""The engine on CUDA against `transformers` on CUDA.

float32: greedy tokens identical, logits within 1e-3 (TF32 off).
bfloat16: last-position logits within 0.25 of the float32 reference, and greedy tokens
identical to transformers-bf16 for the first 4 new tokens (bf16 rounding can flip
later near-ties between two implementations).
"""
from __future__ import annotations

import pytest
import torch

from engine.request import SamplingParams
from tests.integration.reference import capture_logits, hf_greedy, hf_logits, random_prompts


def make_engine(model_dir: str, **kw):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=model_dir, device="cuda", dtype=kw.get("dtype", "float32"),
                                  cache=CacheConfig(block_size=4, num_blocks=512),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32)))


@pytest.fixture(autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_cuda_float32_greedy_matches_cpu_reference(tiny_model_dir: str) -> None:
    prompts = random_prompts([3, 17, 33], 512, seed=0)
    outs = make_engine(tiny_model_dir).generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, c in zip(prompts, outs, strict=True):
        assert c.token_ids == hf_greedy(tiny_model_dir, tuple(p), 12)


def test_cuda_bfloat16_tracks_reference(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    prompt = random_prompts([24], 512, seed=1)[0]
    engine = make_engine(tiny_model_dir, dtype="bfloat16")
    seen = capture_logits(engine)
    c = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    ref32 = hf_logits(tiny_model_dir, prompt)[-1]
    assert (seen[0][1][0].cpu() - ref32).abs().max().item() < 0.25
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
    gc = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=2)
    ref = hf.generate(torch.tensor([prompt], device="cuda"), generation_config=gc)[0, len(prompt):].tolist()
    assert c.token_ids[:4] == ref[:4]

