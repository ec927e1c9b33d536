"""Hugging Face `transformers` as the slow reference, with results memoised per session."""
from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine

LOGITS_ATOL_FP32 = 1e-4
"""Largest allowed |ours - transformers| on float32 logits (values are O(1..10))."""
LOGITS_ATOL_BF16 = 0.05
"""Largest allowed |ours in bfloat16 - transformers in float32| on the tiny models' logits."""


@functools.cache
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32):
    """The checkpoint in transformers. A model whose attention scores are soft-capped (Gemma 2)
    is loaded with the eager attention, the one that caps them: some transformers releases
    (5.17 on the GPU machine) loaded Gemma 2 with SDPA, which cannot, and left the cap out."""
    config = AutoConfig.from_pretrained(model_dir)
    capped = getattr(config, "attn_logit_softcapping", None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 **({"attn_implementation": "eager"} if capped else {})).eval()
    model.generation_config.eos_token_id = None  # (else `generate` stops at the config's EOS: ours ignore it)
    return model


@functools.cache
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, EOS disabled (our ignore_eos)."""
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=2)
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # (the mask given: else a prompt token equal to the pad id, Gemma's BOS, is masked)
        out = hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt):].tolist()


def hf_logits(model_dir: str, token_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits of one forward pass."""
    with torch.inference_mode():
        return hf_model(model_dir, dtype)(torch.tensor([token_ids])).logits[0].float()


def engine_config(model_dir: str, *, block_size: int = 4, num_blocks: int = 512, budget: int = 64,
                  chunked: bool = True, caching: bool = True, max_seqs: int = 64, role: str = "both",
                  dtype: str = "float32", seed: int = 0, device: str = "cpu",
                  kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir, dtype=dtype, role=role, seed=seed, device=device,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                                  max_num_seqs=max_seqs))


def make_engine(model_dir: str, *, block_size: int = 4, num_blocks: int = 512, budget: int = 64,
                chunked: bool = True, caching: bool = True, max_seqs: int = 64, role: str = "both",
                dtype: str = "float32", seed: int = 0, device: str = "cpu", kv_cache_dtype: str = "auto",
                **kw) -> LLMEngine:
    return LLMEngine(engine_config(model_dir, block_size=block_size, num_blocks=num_blocks, budget=budget,
                                   chunked=chunked, caching=caching, max_seqs=max_seqs, role=role, dtype=dtype,
                                   seed=seed, device=device, kv_cache_dtype=kv_cache_dtype), **kw)


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def capture_logits(engine: LLMEngine) -> list[tuple[list, torch.Tensor]]:
    """Record (sampled requests as (id, num_tokens), logits) for every step the engine runs
    (the overlapped decode, which runs decode steps past `execute`, is turned off)."""
    seen: list[tuple[list, torch.Tensor]] = []
    engine.overlap.enabled = False
    execute = engine.runner.execute

    def recording(out):
        requests, logits = execute(out)
        seen.append(([(r.request_id, r.num_tokens) for r in requests], logits.clone()))
        return requests, logits

    engine.runner.execute = recording
    return seen
