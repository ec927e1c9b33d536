"""Reads a Hugging Face config.json into the fields our Llama-family model needs.

Supported: LlamaForCausalLM (Llama 2/3, rope_scaling type llama3), MistralForCausalLM
(without a sliding window shorter than the context), Qwen2ForCausalLM (q/k/v bias),
Qwen3ForCausalLM (an RMSNorm over each head of q and of k before rope; head_dim need not
be hidden_size / heads). Anything else is refused with an error that names the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.types import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    """default or llama3."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """Each head of q and of k is RMS-normalised (its own weight, [head_dim]) before rope (Qwen3)."""
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{path} not found: a model directory needs config.json")
        raw = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        arch = _architecture(raw)
        num_heads = _req(raw, "num_attention_heads")
        hidden = _req(raw, "hidden_size")
        _check_supported_fields(raw, arch)
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=_req(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(raw, "intermediate_size"),
            num_layers=_req(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            max_position_embeddings=_req(raw, "max_position_embeddings"),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config field 'architectures' is {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _req(raw: dict[str, Any], name: str) -> Any:
    if name not in raw:
        raise UnsupportedModelError(f"config field '{name}' is missing")
    return raw[name]


def _check_supported_fields(raw: dict[str, Any], arch: str) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config field 'hidden_act' is {act!r}; only 'silu' is supported")
    window = raw.get("sliding_window")
    use_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
    if window is not None and use_window and window < raw.get("max_position_embeddings", math.inf):
        raise UnsupportedModelError(
            f"config field 'sliding_window' is {window}; sliding-window attention is not supported"
        )
    if raw.get("pretraining_tp", 1) != 1:
        raise UnsupportedModelError("config field 'pretraining_tp' must be 1")
    if (raw.get("num_attention_heads") or 0) % (raw.get("num_key_value_heads") or 1):
        raise UnsupportedModelError("config field 'num_key_value_heads' must divide num_attention_heads")


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"config field 'rope_scaling' has type {rope_type!r}; supported: default, llama3"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
