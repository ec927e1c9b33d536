"""Our engine against Hugging Face `transformers` on the same tiny checkpoints.

float32: logits within LOGITS_ATOL_FP32 (1e-4); greedy tokens identical.
bfloat16 (CPU; its attention takes other code paths than float32): logits within
LOGITS_ATOL_BF16 (0.05, on logits of magnitude up to about 1.6) of the float32
reference, and no further from it than 1.5x what transformers' own bfloat16 is.
Each test runs for every tiny architecture (engine/model/tiny_model.py): Llama (llama3 rope,
untied), Qwen2 (q/k/v bias, tied), Qwen3 (per-head q/k norm, wide heads) and the mixtures
of experts Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE.
"""
from __future__ import annotations

import pytest
import torch

from engine.model.model_config import ModelConfig
from engine.core.request import SamplingParams
from tests.integration.reference import (
    LOGITS_ATOL_BF16, LOGITS_ATOL_FP32, capture_logits, hf_greedy, hf_logits, make_engine, random_prompts,
)

# Lengths cross block boundaries (block_size 4) and chunk boundaries.
LENGTHS = [1, 3, 4, 5, 15, 16, 17, 33, 47]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(model_dir: str, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    return random_prompts(lengths, 512, seed)


def _assert_matches_hf(model_dir, prompts, completions) -> None:
    for p, c in zip(prompts, completions, strict=True):
        assert c.token_ids == hf_greedy(model_dir, tuple(p), NEW_TOKENS), f"prompt of {len(p)} tokens"


def _all_position_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Run a prompt through the engine's scheduler and model chunk by chunk, keeping every logit."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
    chunks = []
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        batch = engine.runner.prepare(out)
        n = batch.input_ids.shape[0]
        logits = engine.model.forward(batch.input_ids, batch.positions, engine.kv_pool, batch.meta, torch.arange(n))
        chunks.append(logits)
        done = out.scheduled[0].request.num_computed_tokens + n == len(prompt)
        engine.scheduler.update_after_step(out, {rid: (int(logits[-1].argmax()), None)} if done else {})
    return torch.cat(chunks)


def test_prefill_logits_match_in_chunks(tiny_model_dir: str) -> None:
    prompt = _prompts(tiny_model_dir, [37])[0]
    engine = make_engine(tiny_model_dir, budget=8)  # five chunks
    ours = _all_position_logits(engine, prompt)
    ref = hf_logits(tiny_model_dir, prompt)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < LOGITS_ATOL_FP32


def test_decode_logits_match(tiny_model_dir: str) -> None:
    prompts = _prompts(tiny_model_dir, [6, 19])
    engine = make_engine(tiny_model_dir)
    seen = capture_logits(engine)
    completions = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for p, c in zip(prompts, completions, strict=True):
        full = p + c.token_ids
        ref = hf_logits(tiny_model_dir, full)
        for ids, logits in seen:
            for row, (rid, num_tokens) in enumerate(ids):
                if rid == c.request_id:
                    diff = (logits[row] - ref[num_tokens - 1]).abs().max().item()
                    assert diff < LOGITS_ATOL_FP32, f"position {num_tokens - 1}"


@pytest.mark.parametrize("chunked, budget", [(True, 16), (False, 256)], ids=["chunked", "unchunked"])
def test_concurrent_greedy_matches_generate(tiny_model_dir: str, chunked: bool, budget: int) -> None:
    prompts = _prompts(tiny_model_dir)
    engine = make_engine(tiny_model_dir, budget=budget, chunked=chunked)
    completions = engine.generate(prompts, GREEDY)
    _assert_matches_hf(tiny_model_dir, prompts, completions)
    assert engine.check_invariants().num_in_use == (engine.kv.null_block is not None)  # a window's null block


def test_prefix_cache_hits_give_the_same_tokens(tiny_model_dir: str) -> None:
    stem = _prompts(tiny_model_dir, [18], seed=7)[0]
    tails = _prompts(tiny_model_dir, [1, 5, 9], seed=8)
    prompts = [stem + t for t in tails]
    engine = make_engine(tiny_model_dir, budget=32)
    cold = engine.generate(prompts[:1], GREEDY)
    warm = engine.generate(prompts, GREEDY)
    assert cold[0].num_cached_tokens == 0
    assert [c.num_cached_tokens for c in warm] == [16, 16, 16]  # four full blocks of the stem
    _assert_matches_hf(tiny_model_dir, prompts, warm)
    no_cache = make_engine(tiny_model_dir, budget=32, caching=False).generate(prompts, GREEDY)
    assert [c.token_ids for c in no_cache] == [c.token_ids for c in warm]
    assert [c.num_cached_tokens for c in no_cache] == [0, 0, 0]


def test_preemption_by_a_tiny_pool_gives_the_same_tokens(tiny_model_dir: str) -> None:
    prompts = _prompts(tiny_model_dir, [15, 17, 21, 9, 30, 12])
    if ModelConfig.from_dir(tiny_model_dir).kv_window:  # a request holds a window's blocks and a step's
        engine = make_engine(tiny_model_dir, num_blocks=10, budget=8)
    else:
        engine = make_engine(tiny_model_dir, num_blocks=16, budget=32)  # 64 slots for ~270 tokens
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out

    engine.scheduler.schedule = counting_schedule
    completions = engine.generate(prompts, GREEDY)
    assert len(preempted) >= 2
    _assert_matches_hf(tiny_model_dir, prompts, completions)
    assert engine.check_invariants().num_in_use == (engine.kv.null_block is not None)  # a window's null block


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama_dir: str) -> None:
    prompt = _prompts(tiny_llama_dir, [10])[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_llama_dir, seed=1).generate([prompt], params)[0].token_ids
    others = _prompts(tiny_llama_dir, [4, 25], seed=3)
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = make_engine(tiny_llama_dir, seed=2).generate(
        [others[0], prompt, others[1]], [unseeded, params, unseeded])[1].token_ids
    assert alone == batched
    reseeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=99, ignore_eos=True)
    assert make_engine(tiny_llama_dir).generate([prompt], reseeded)[0].token_ids != alone


def test_bfloat16_tracks_the_float32_reference_as_closely_as_transformers_does(tiny_model_dir: str) -> None:
    """First chunks (causal SDPA), chunks over earlier context and prefix-cache tails
    (SDPA with a mask), and batched decodes (all-pairs form), all in bfloat16."""
    prompts = _prompts(tiny_model_dir, [6, 19, 37], seed=5)
    engine = make_engine(tiny_model_dir, dtype="bfloat16", budget=16)
    seen = capture_logits(engine)
    cold = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    warm = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [c.num_cached_tokens for c in warm] == [4, 16, 36]
    ours = hf_err = 0.0
    for run in (cold, warm):
        for p, c in zip(prompts, run, strict=True):
            full = p + c.token_ids
            ref = hf_logits(tiny_model_dir, full)
            hf_err = max(hf_err, (hf_logits(tiny_model_dir, full, torch.bfloat16) - ref).abs().max().item())
            rows = [(logits[row], n) for ids, logits in seen for row, (rid, n) in enumerate(ids) if rid == c.request_id]
            assert len(rows) == 8
            ours = max(ours, *((lg - ref[n - 1]).abs().max().item() for lg, n in rows))
    if ModelConfig.from_dir(tiny_model_dir).moe is None:  # (a router's softmax over bfloat16 logits moves the
        # experts' weights: transformers' own bfloat16 is 0.07-0.18 off on the tiny mixtures, so there only the bound below)
        assert ours < LOGITS_ATOL_BF16, f"ours {ours:.4f} vs transformers bfloat16 {hf_err:.4f}"
    assert ours <= 1.5 * hf_err, f"ours {ours:.4f} vs transformers bfloat16 {hf_err:.4f}"


ROPE_SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=8.0),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=32,
                     short_factor=[1.0 + 0.05 * i for i in range(8)], long_factor=[1.5 + 0.4 * i for i in range(8)]),
}
"""Each scaled from a pretraining length of 32 positions, so a short test crosses it."""


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_scaled_rope_matches_transformers_past_the_pretraining_length(tiny_llama_dir: str, tmp_path, scaling: str) -> None:
    """A 20-token prompt decoded to 60 tokens: past position 32, where dynamic's base starts
    to grow and longrope turns to its long divisors (transformers decodes one token at a time
    here, as the engine rotates every position; engine/model/rope.py), and yarn's and longrope's
    attention factor scales every position."""
    import json
    import shutil

    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / scaling)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_scaling")
    config.update(rope_scaling=ROPE_SCALINGS[scaling], rope_theta=10000.0,
                  max_position_embeddings=32 if scaling in ("linear", "dynamic") else 128)
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = _prompts(str(model_dir), [20, 9])
    completions = make_engine(str(model_dir), budget=8).generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    for p, c in zip(prompts, completions, strict=True):
        assert c.token_ids == hf_greedy(str(model_dir), tuple(p), 40), f"prompt of {len(p)} tokens"
    # every position's logits, computed in chunks of 8 over the cache, against one forward pass: of
    # all 60 tokens where the rotation is static; of the first 32 for dynamic and longrope (one
    # forward of 60 rotates all 60 for a length of 60 in transformers)
    prompt = (prompts[0] + completions[0].token_ids)[: 60 if scaling in ("linear", "yarn") else 32]
    ours = _all_position_logits(make_engine(str(model_dir), budget=8), prompt)
    assert (ours - hf_logits(str(model_dir), prompt)).abs().max().item() < LOGITS_ATOL_FP32
