from __future__ import annotations

import json

import pytest

from engine.model_config import ModelConfig
from engine.tiny_model import model_config
from engine.types import UnsupportedModelError


def test_llama3_rope_and_qwen2_bias_are_read() -> None:
    llama = ModelConfig.from_dict(model_config("llama", "tiny"))
    assert llama.rope.rope_type == "llama3" and llama.rope.factor == 8.0
    assert not llama.qkv_bias and not llama.tie_word_embeddings
    qwen = ModelConfig.from_dict(model_config("qwen2", "tiny"))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.head_dim == 16 and qwen.num_kv_heads == 2


def test_qwen3_heads_are_normalised_and_may_be_wider_than_hidden_over_heads() -> None:
    qwen3 = ModelConfig.from_dict(model_config("qwen3", "tiny"))
    assert qwen3.qk_norm and not qwen3.qkv_bias and not qwen3.o_bias and qwen3.tie_word_embeddings
    assert (qwen3.hidden_size, qwen3.num_heads, qwen3.head_dim) == (64, 4, 32)
    assert not ModelConfig.from_dict(model_config("qwen2", "tiny")).qk_norm
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        ModelConfig.from_dict(dict(model_config("qwen3", "tiny"), use_sliding_window=True, sliding_window=64))


def test_transformers_v5_rope_parameters_are_read() -> None:
    raw = model_config("llama", "tiny")
    raw["rope_parameters"] = dict(raw.pop("rope_scaling"), rope_theta=raw.pop("rope_theta"))
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope.theta == 500000.0 and cfg.rope.rope_type == "llama3"


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 512}, "sliding_window"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_unsupported_configs_name_the_field(change, field) -> None:
    raw = dict(model_config("llama", "tiny"), **change)
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(raw)


def test_missing_field_is_named(tmp_path) -> None:
    raw = model_config("llama", "tiny")
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        ModelConfig.from_dir(tmp_path)


def test_mistral_without_window_is_accepted() -> None:
    raw = dict(model_config("llama", "tiny"), architectures=["MistralForCausalLM"], sliding_window=None)
    assert ModelConfig.from_dict(raw).architecture == "MistralForCausalLM"
