"""FP8 KV (`kv_cache_dtype="fp8"`) on CPU: attention reads K and V as e4m3 (divided by the
layer's scales, rounded, multiplied back), which transformers does too once its keys (after
rope) and values are rounded the same way: the same log-probabilities within float32's
1e-4 and the same greedy tokens. A pool of the same bytes holds twice a bfloat16 pool's
tokens. (P/D over FP8 KV: test_disaggregated_kv.py; the KV tier: test_kv_tier.py.)"""
from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import CacheConfig, EngineConfig
from engine.model.fp8 import to_e4m3
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from tests.integration.reference import hf_model, make_engine, random_prompts

K_SCALE, V_SCALE = 0.02, 0.03
"""Written as every layer's `self_attn.k_scale` / `v_scale` (compressed-tensors' names)."""


@pytest.fixture(scope="module")
def scaled_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with KV scales in its checkpoint (transformers ignores the extra tensors)."""
    out = tmp_path_factory.mktemp("kv-scales")
    for f in Path(tiny_llama_dir).iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(str(out / "model.safetensors"))
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(K_SCALE)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(V_SCALE)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (to_e4m3(x.float() / scale).float() * scale).to(x.dtype)


@contextlib.contextmanager
def transformers_with_fp8_kv(model_dir: str, k_scale: float, v_scale: float) -> Iterator[torch.nn.Module]:
    """transformers' Llama with each layer's keys rounded after rope and its values after
    their projection, as an FP8 pool holds them (so its cache holds them rounded too)."""
    import transformers.models.llama.modeling_llama as llama

    model = hf_model(model_dir)
    rope = llama.apply_rotary_pos_emb

    def rope_then_round(q, k, cos, sin, *args, **kwargs):  # type: ignore[no-untyped-def]
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, rounded(k, k_scale)

    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: rounded(out, v_scale))
             for layer in model.model.layers]
    llama.apply_rotary_pos_emb = rope_then_round
    try:
        yield model
    finally:
        llama.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("scales", ["one", "checkpoint"])
def test_fp8_kv_gives_the_log_probabilities_of_attention_over_kv_rounded_to_e4m3(
        tiny_llama_dir: str, scaled_dir: str, scales: str) -> None:
    model_dir, ks, vs = (tiny_llama_dir, 1.0, 1.0) if scales == "one" else (scaled_dir, K_SCALE, V_SCALE)
    engine = make_engine(model_dir, kv_cache_dtype="fp8")
    assert engine.kv_pool.fp8 and engine.kv_pool.tensor.dtype == torch.float8_e4m3fn
    assert torch.equal(engine.kv_pool.scales, torch.tensor([[ks, vs]] * engine.model_config.num_layers))
    assert engine.model_id.endswith("+kv-fp8")  # no block of it is a 16-bit pool's
    prompts = random_prompts([5, 23, 41], 512, seed=2)  # 23, 41: prefilled in chunks over pooled KV
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True, prompt_logprobs=0)
    out = engine.generate(prompts, params)
    with transformers_with_fp8_kv(model_dir, ks, vs) as model, torch.inference_mode():
        for prompt, got in zip(prompts, out):
            ids = torch.tensor([prompt])
            want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                  eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
            assert got.token_ids == want
            full = torch.tensor([prompt + want[:-1]])
            logprobs = torch.log_softmax(model(full).logits[0].float(), dim=-1)
            expected = [float(logprobs[i, t]) for i, t in enumerate((prompt + want)[1:])]
            ours = [e.logprob for e in got.prompt_logprobs] + list(got.logprobs)
            assert max(abs(a - b) for a, b in zip(ours, expected)) < 1e-4
        # and without the rounding transformers is elsewhere: the test sees the e4m3
    plain = make_engine(model_dir).generate(prompts, params)
    assert max(abs(a - b) for p, q in zip(plain, out) for a, b in zip(p.logprobs, q.logprobs)) > 1e-3


def test_a_pool_of_the_same_bytes_holds_twice_the_tokens(tiny_llama_dir: str) -> None:
    def blocks(dtype: str, kv: str) -> int:
        cache = CacheConfig(block_size=16, kv_cache_bytes=8 << 20, kv_cache_dtype=kv)
        return LLMEngine(EngineConfig(model_dir=tiny_llama_dir, dtype=dtype, cache=cache)).kv_pool.num_blocks

    assert blocks("bfloat16", "fp8") == 2 * blocks("bfloat16", "auto")
    assert blocks("float32", "fp8") == 4 * blocks("float32", "auto")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")
