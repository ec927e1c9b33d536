from __future__ import annotations

import json

import pytest

from engine.model.model_config import ModelConfig
from engine.model.tiny_model import model_config
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
    windowed = dict(model_config("qwen3", "tiny"), use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert ModelConfig.from_dict(windowed).layer_windows == (0, 64)


def test_transformers_v5_rope_parameters_are_read() -> None:
    raw = model_config("llama", "tiny")
    raw["rope_parameters"] = dict(raw.pop("rope_scaling"), rope_theta=raw.pop("rope_theta"))
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope.theta == 500000.0 and cfg.rope.rope_type == "llama3"


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "mla", "factor": 4.0}}, "rope_scaling"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": -1}, "sliding_window"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [16, 24, 24]}}, "rope_scaling"),
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


@pytest.mark.parametrize("scaling, max_pos, context", [
    ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "dynamic", "factor": 4.0}, 4096, 16384),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),  # Qwen2.5's
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}, 163840, 163840),  # DeepSeek's
    ({"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 4096}, 131072, 131072),  # Phi-3's
])
def test_a_scaled_rope_serves_the_context_it_extends_to(scaling, max_pos, context) -> None:
    raw = dict(model_config("llama", "tiny"), rope_scaling=scaling, max_position_embeddings=max_pos)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.max_position_embeddings == context
    assert cfg.rope.rope_type == scaling.get("rope_type", scaling.get("type"))


def test_a_partial_rotary_factor_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        ModelConfig.from_dict(dict(model_config("llama", "tiny"), partial_rotary_factor=0.5))


def test_the_mixtures_of_experts_are_read_field_by_field() -> None:
    mixtral = ModelConfig.from_dict(model_config("mixtral", "tiny"))
    assert mixtral.moe is not None and (mixtral.moe.num_experts, mixtral.moe.top_k) == (4, 2)
    assert mixtral.moe.norm_topk_prob and mixtral.moe.layers == (0, 1) and mixtral.moe.intermediate_size == 128
    assert mixtral.moe.checkpoint_names == ("block_sparse_moe", "w1", "w3", "w2")
    qwen2 = ModelConfig.from_dict(model_config("qwen2_moe", "tiny"))
    assert qwen2.moe is not None and qwen2.moe.layers == (1,) and qwen2.moe.shared_intermediate_size == 128
    assert qwen2.qkv_bias and not qwen2.moe.norm_topk_prob and qwen2.moe.intermediate_size == 64
    qwen3 = ModelConfig.from_dict(model_config("qwen3_moe", "tiny"))
    assert qwen3.moe is not None and qwen3.qk_norm and qwen3.moe.norm_topk_prob and not qwen3.moe.shared_intermediate_size
    every_other = dict(model_config("qwen3_moe", "tiny"), num_hidden_layers=4, decoder_sparse_step=2)
    assert ModelConfig.from_dict(every_other).moe.layers == (1, 3)  # type: ignore[union-attr]
    assert ModelConfig.from_dict(model_config("llama", "tiny")).moe is None


@pytest.mark.parametrize("change, field", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
])
def test_a_bad_mixture_is_refused_by_name(change, field) -> None:
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict(dict(model_config("qwen3_moe", "tiny"), **change))


def test_each_layer_gets_the_sliding_window_transformers_gives_it() -> None:
    base = model_config("llama", "tiny")  # 2 layers, 2048 positions
    windows = lambda **kw: ModelConfig.from_dict(dict(base, **kw)).layer_windows  # noqa: E731
    assert windows(architectures=["MistralForCausalLM"], sliding_window=16) == (16, 16)
    assert windows(architectures=["MistralForCausalLM"], sliding_window=4096) == (0, 0)  # past the context: none
    assert windows(architectures=["LlamaForCausalLM"], sliding_window=16) == (0, 0)
    assert windows(architectures=["Qwen2ForCausalLM"], sliding_window=16) == (0, 0)  # use_sliding_window off
    assert windows(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
                   max_window_layers=1) == (0, 16)
    assert windows(architectures=["Qwen2ForCausalLM"], sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]) == (16, 0)
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        windows(architectures=["Qwen2ForCausalLM"], sliding_window=16, layer_types=["chunked_attention"] * 2)


def test_gemma3_is_read_in_both_the_hub_and_the_transformers_5_shapes() -> None:
    tiny = ModelConfig.from_dict(model_config("gemma3", "tiny"))  # transformers 5: a rope per layer type
    assert tiny.norm_offset and tiny.sandwich_norms and tiny.qk_norm and tiny.hidden_act == "gelu_tanh"
    assert tiny.query_scale == 24**-0.5 and tiny.embed_scale == 64**0.5 and tiny.final_logit_softcap == 15.0
    assert tiny.layer_windows == (8, 0) and tiny.rope.theta == 1e6 and tiny.local_rope.theta == 1e4  # type: ignore[union-attr]
    hub = {k: v for k, v in model_config("gemma3", "tiny").items() if k not in ("rope_parameters", "layer_types")}
    hub.update(num_hidden_layers=12, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072)
    cfg = ModelConfig.from_dict(hub)  # Gemma 3 4B's shape
    assert cfg.layer_windows == (8,) * 5 + (0,) + (8,) * 5 + (0,)
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 8.0 and cfg.local_rope.rope_type == "default"  # type: ignore[union-attr]
    assert cfg.max_position_embeddings == 131072  # its context already scaled
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        ModelConfig.from_dict(dict(hub, attn_logit_softcapping=50.0))
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        ModelConfig.from_dict(dict(hub, hidden_activation="gelu"))


def test_phi3_reads_its_windows_and_longrope_and_refuses_a_partial_rotation() -> None:
    raw = dict(model_config("phi3", "tiny"), sliding_window=64, max_position_embeddings=4096,
               original_max_position_embeddings=4096)
    assert ModelConfig.from_dict(raw).layer_windows == (64, 64)  # Phi-3-mini-4k's window, on every layer
    longrope = dict(raw, sliding_window=None, max_position_embeddings=131072, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    cfg = ModelConfig.from_dict(longrope)  # Phi-3-mini-128k's shape: original_max_position_embeddings at the top
    assert cfg.rope.rope_type == "longrope" and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.max_position_embeddings == 131072 and cfg.layer_windows == (0, 0)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):  # Phi-4-mini's
        ModelConfig.from_dict(dict(raw, partial_rotary_factor=0.75))


def test_gemma2_caps_attention_and_alternates_local_and_global_layers() -> None:
    raw = dict(model_config("gemma2", "tiny"), num_hidden_layers=4)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.attn_softcap == 2.0 and cfg.final_logit_softcap == 15.0 and not cfg.qk_norm and cfg.local_rope is None
    assert cfg.layer_windows == (8, 0, 8, 0) and cfg.norm_offset and cfg.sandwich_norms
