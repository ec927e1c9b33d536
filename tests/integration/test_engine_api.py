"""LLMEngine behaviour seen from a caller: stops, text, logprobs, aborts, bad input, loading."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.request import FinishReason, SamplingParams
from engine.types import InvalidRequestError
from tests.integration.reference import capture_logits, hf_greedy, hf_logits, make_engine, random_prompts


def test_stop_token_and_eos(tiny_llama_dir: str) -> None:
    prompt = random_prompts([8], 512, seed=1)[0]
    ref = hf_greedy(tiny_llama_dir, tuple(prompt), 12)
    engine = make_engine(tiny_llama_dir)
    c = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(ref[3],)))[0]
    cut = ref.index(ref[3]) + 1
    assert c.token_ids == ref[:cut] and c.finish_reason is FinishReason.STOP
    c = engine.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert c.token_ids == ref[:5] and c.finish_reason is FinishReason.LENGTH


def test_text_streams_incrementally_and_stop_string_cuts(tiny_llama_dir: str) -> None:
    engine = make_engine(tiny_llama_dir)
    full = engine.generate(["the quick brown fox"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert full.text == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[5:8]
    c = engine.generate(["the quick brown fox"], SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))[0]
    assert c.finish_reason is FinishReason.STOP
    assert c.text == full.text[: full.text.index(stop)]


def test_logprobs_are_those_of_the_reference(tiny_qwen2_dir: str) -> None:
    prompt = random_prompts([9], 512, seed=2)[0]
    c = make_engine(tiny_qwen2_dir).generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True))[0]
    ref = torch.log_softmax(hf_logits(tiny_qwen2_dir, prompt + c.token_ids), dim=-1)
    expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
    assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_abort_mid_generation_frees_everything(tiny_llama_dir: str) -> None:
    engine = make_engine(tiny_llama_dir, budget=8)
    a = engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request(list(range(40, 45)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.check_invariants().num_in_use > 0
    assert engine.abort(a) and engine.abort(b) and not engine.abort(a)
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.check_invariants().num_in_use == 0


def test_bad_input_is_refused_with_a_clear_message(tiny_llama_dir: str) -> None:
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request([3, 600])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([])
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(list(range(3, 500)) * 5)
    assert engine.check_invariants().num_in_use == 0 and not engine.has_unfinished()


def test_sharded_checkpoint_loads_the_same(tiny_llama_dir: str, tmp_path) -> None:
    weights = load_file(f"{tiny_llama_dir}/model.safetensors")
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(tmp_path / file))
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        (tmp_path / f).write_text(open(f"{tiny_llama_dir}/{f}").read())
    prompt = random_prompts([11], 512, seed=3)[0]
    c = make_engine(str(tmp_path)).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert c.token_ids == hf_greedy(tiny_llama_dir, tuple(prompt), 8)


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 0.15), ("float16", 0.02)])
def test_half_precision_logits_track_float32(tiny_llama_dir: str, dtype: str, atol: float) -> None:
    """Half precision on CPU against the float32 reference; tolerance stated per dtype."""
    prompt = random_prompts([20], 512, seed=6)[0]
    engine = make_engine(tiny_llama_dir, dtype=dtype)
    seen = capture_logits(engine)
    engine.generate([prompt], SamplingParams(max_tokens=1))
    ref = hf_logits(tiny_llama_dir, prompt)[-1]
    assert (seen[0][1][0] - ref).abs().max().item() < atol
