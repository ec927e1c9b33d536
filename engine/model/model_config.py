"""Reads a Hugging Face config.json into the fields our Llama-family model needs.

Supported: LlamaForCausalLM (Llama 2/3), MistralForCausalLM (a sliding window on every
layer), Qwen2ForCausalLM (q/k/v bias),
Qwen3ForCausalLM (an RMSNorm over each head of q and of k before rope; head_dim need not
be hidden_size / heads); the mixtures of experts MixtralForCausalLM, Qwen2MoeForCausalLM (a
gated shared expert beside the routed ones) and Qwen3MoeForCausalLM (`MoEConfig`);
Gemma3ForCausalLM, Gemma 3's text model (norms of weight 1 + w, around each block too,
GeGLU, a scaled embedding, its own query scale, local layers with their own rope base
in a sliding window, final logit soft-capping); Gemma2ForCausalLM (the same, less the
q/k norms and the local rope, plus soft-capped attention scores); Phi3ForCausalLM (Phi-3, Phi-4: q/k/v and
gate/up fused in the checkpoint, longrope).
Rope types default, linear, dynamic, yarn, longrope and llama3 (engine/model/rope.py).
Anything else is refused with an error that names the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpoints.quant_config import QUANTIZATIONS, Fp8Scheme
from engine.types import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "Phi3ForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    """One of ROPE_TYPES, as transformers defines them (engine/model/rope.py)."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    """yarn, longrope: cos and sin are scaled by it (the config's, else derived from `factor`)."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    """yarn: the ramp between extrapolated and interpolated frequencies."""
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors within the original context, and past it."""
    base_max_position_embeddings: int = 0
    """dynamic: the config's max_position_embeddings, past which the base grows."""


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP of the layers in `layers`: a router picks
    `top_k` of `num_experts` SwiGLU experts per token by softmax probability (renormalised
    over those picked when `norm_topk_prob`), whose outputs are summed by those weights."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    """The layers whose MLP is the mixture (the others keep the dense MLP)."""
    shared_intermediate_size: int = 0
    """Qwen2-MoE: a dense expert every token takes, scaled by a sigmoid gate (0: none)."""
    checkpoint_names: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")
    """The block's name in a layer, and its experts' gate, up and down projections (Mixtral:
    block_sparse_moe, w1, w3, w2)."""


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
    moe: MoEConfig | None = None
    layer_windows: tuple[int, ...] = ()
    """Per layer, the keys a token attends to, its own last (a sliding window); 0: all (a
    window as long as the context is none)."""
    norm_offset: bool = False
    """Gemma: a norm's weight w is applied as 1 + w (the model adds the 1 at load)."""
    sandwich_norms: bool = False
    """Gemma: the attention's and the MLP's outputs are normalised before the residual add
    (post_attention_layernorm, post_feedforward_layernorm; pre_feedforward_layernorm before the MLP)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU)."""
    embed_scale: float = 1.0
    """The embeddings are multiplied by it (Gemma: sqrt(hidden_size), rounded to the dtype)."""
    query_scale: float | None = None
    """Attention's score scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    final_logit_softcap: float | None = None
    """Logits become cap * tanh(logits / cap) (Gemma)."""
    local_rope: RopeConfig | None = None
    """The rope of the sliding-window layers, where it is not `rope` (Gemma 3's local base)."""
    attn_softcap: float = 0.0
    """Attention scores s become attn_softcap * tanh(s / attn_softcap) (Gemma 2); 0: not."""
    fp8: Fp8Scheme | None = None
    """The projections' FP8 scheme (engine/checkpoints/quant_config.py): the checkpoint's, or
    `--quantization fp8`'s; None: they are in the model's dtype."""

    @property
    def kv_window(self) -> int:
        """Keys behind a query that any layer reads, where every layer has a sliding window (the
        blocks before it go back to the pool as it passes); 0: some layer reads the whole context."""
        return max(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    @property
    def llama_layers(self) -> bool:
        """Every layer is Llama's own: none of the parts above that other families add (what the
        native one-call decode, `NativeKernels.decode_layers`, runs)."""
        return not (self.qk_norm or self.moe is not None or any(self.layer_windows) or self.norm_offset
                    or self.sandwich_norms or self.hidden_act != "silu" or self.embed_scale != 1.0
                    or self.query_scale is not None or self.final_logit_softcap is not None
                    or self.local_rope is not None or self.attn_softcap)

    @classmethod
    def from_dir(cls, model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
        """`quantization`: "fp8" quantizes a 16/32-bit checkpoint's projections at load (an FP8
        checkpoint is served as it is)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{path} not found: a model directory needs config.json")
        raw = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        config = cls.from_dict(raw, gen)
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if quantization == "fp8" and config.fp8 is None:
            config = dataclasses.replace(config, fp8=Fp8Scheme.loading())
        return config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        arch = _architecture(raw)
        num_heads = _req(raw, "num_attention_heads")
        hidden = _req(raw, "hidden_size")
        _check_supported_fields(raw, arch)
        gemma = arch in GEMMA_ARCHITECTURES
        rope, context, local_rope = _gemma3_ropes(raw) if arch == "Gemma3ForCausalLM" else (*_rope(raw), None)
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        attention_bias = bool(raw.get("attention_bias", False))
        num_layers = _req(raw, "num_hidden_layers")
        return cls(
            architecture=arch,
            vocab_size=_req(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            max_position_embeddings=context,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM" else is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            moe=_moe(raw, arch, num_layers),
            layer_windows=tuple(w if w < context else 0 for w in _layer_windows(raw, arch, num_layers)),
            norm_offset=gemma, sandwich_norms=gemma, hidden_act="gelu_tanh" if gemma else "silu",
            embed_scale=hidden**0.5 if gemma else 1.0,
            query_scale=float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or hidden // num_heads) ** -0.5
            if gemma else None,
            final_logit_softcap=raw.get("final_logit_softcapping") if gemma else None,
            local_rope=local_rope,
            attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0) if arch == "Gemma2ForCausalLM" else 0.0,
            fp8=Fp8Scheme.of(raw["quantization_config"]) if raw.get("quantization_config") else None,
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config field 'architectures' is {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _layer_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), as transformers reads the config: its
    `layer_types` where it has them, else the architecture's rule (Mistral and Mixtral: every
    layer, when `sliding_window` is set; Qwen2 and Qwen3: layers from `max_window_layers` on,
    when `use_sliding_window`; Qwen2-MoE: the even layers below it; Qwen3-MoE: every layer)."""
    window = int(raw.get("sliding_window") or 0)
    if window < 0:
        raise UnsupportedModelError(f"config field 'sliding_window' is {window}")
    if arch == "LlamaForCausalLM" or not window:
        return (0,) * num_layers
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise UnsupportedModelError(f"config field 'layer_types' is {types!r}: one of full_attention or "
                                        f"sliding_attention per layer ({num_layers})")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return (window,) * num_layers
    if arch == "Gemma2ForCausalLM":  # the even layers local, the odd global
        return tuple(window if (i + 1) % 2 else 0 for i in range(num_layers))
    if arch == "Gemma3ForCausalLM":  # every `sliding_window_pattern`-th layer global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if not raw.get("use_sliding_window", False):
        return (0,) * num_layers
    below = int(raw.get("max_window_layers", num_layers))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return tuple(window if i >= below else 0 for i in range(num_layers))
    if arch == "Qwen2MoeForCausalLM":
        return tuple(window if (i + 1) % 2 and i < below else 0 for i in range(num_layers))
    return (window,) * num_layers


def _moe(raw: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if num_experts < 1:
        raise UnsupportedModelError("config field 'num_experts' (or 'num_local_experts') must be at least 1")
    top_k = int(_req(raw, "num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(f"config field 'num_experts_per_tok' is {top_k}; it must be 1 to {num_experts}")
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts, top_k, _req(raw, "intermediate_size"), True, tuple(range(num_layers)),
                         checkpoint_names=("block_sparse_moe", "w1", "w3", "w2"))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoEConfig(num_experts, top_k, _req(raw, "moe_intermediate_size"), bool(raw.get("norm_topk_prob", False)),
                     layers, shared)


def _req(raw: dict[str, Any], name: str) -> Any:
    if name not in raw:
        raise UnsupportedModelError(f"config field '{name}' is missing")
    return raw[name]


def _check_supported_fields(raw: dict[str, Any], arch: str) -> None:
    if arch in GEMMA_ARCHITECTURES:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"config field 'hidden_activation' is {act!r}; Gemma's is 'gelu_pytorch_tanh'")
        if arch == "Gemma3ForCausalLM" and raw.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError("config field 'attn_logit_softcapping' is set; attention soft-capping is "
                                        "not supported")
    else:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"config field 'hidden_act' is {act!r}; only 'silu' is supported")
    if raw.get("pretraining_tp", 1) != 1:
        raise UnsupportedModelError("config field 'pretraining_tp' must be 1")
    if (raw.get("num_attention_heads") or 0) % (raw.get("num_key_value_heads") or 1):
        raise UnsupportedModelError("config field 'num_key_value_heads' must divide num_attention_heads")


def _rope(raw: dict[str, Any]) -> tuple[RopeConfig, int]:
    """The rope and the context it serves: the config's max_position_embeddings, times the
    factor for linear, dynamic and yarn scaling (their configs keep the pretraining length
    there; llama3 and longrope configs already state the extended one), as vLLM reads it."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)
    max_pos = int(_req(raw, "max_position_embeddings"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"config field 'rope_scaling' has type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModelError("config field 'partial_rotary_factor' must be 1 (rope over the whole head)")
    if rope_type == "default":
        return RopeConfig(theta=theta), max_pos
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or max_pos)
    if rope_type == "llama3":
        return RopeConfig(theta=theta, rope_type="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=original), max_pos
    if rope_type in ("linear", "dynamic"):
        factor = float(_rope_req(params, "factor"))
        return RopeConfig(theta=theta, rope_type=rope_type, factor=factor,
                          base_max_position_embeddings=max_pos), int(max_pos * factor)
    if rope_type == "yarn":
        factor = float(factor) if factor is not None else max_pos / original
        attention = params.get("attention_factor")
        if attention is None:
            mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim
                         else _yarn_mscale(factor, 1.0))
        return RopeConfig(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                          attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
                          beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True))
                          ), max(max_pos, int(original * factor))
    # longrope (Phi-3's "su")
    factor = float(factor) if factor is not None else max_pos / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                      attention_factor=float(attention),
                      short_factor=tuple(float(x) for x in _rope_req(params, "short_factor")),
                      long_factor=tuple(float(x) for x in _rope_req(params, "long_factor"))), max_pos


def _gemma3_ropes(raw: dict[str, Any]) -> tuple[RopeConfig, int, RopeConfig]:
    """Gemma 3's two ropes: the global layers' (with its scaling) and the local layers'
    (`rope_local_base_freq`, or transformers 5's rope_parameters per layer type). Its
    max_position_embeddings already states the scaled context (128K for the linear factor 8)."""
    params = raw.get("rope_parameters") or {}
    context = int(_req(raw, "max_position_embeddings"))
    if "full_attention" in params:
        rope, _ = _rope({**raw, "rope_parameters": params["full_attention"]})
        local, _ = _rope({**raw, "rope_parameters": params.get("sliding_attention") or {"rope_theta": 10000.0}})
        return rope, context, local
    rope, _ = _rope(raw)
    return rope, context, RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))


def _rope_req(params: dict[str, Any], name: str) -> Any:
    if name not in params:
        raise UnsupportedModelError(f"config field 'rope_scaling' has no {name!r}")
    return params[name]


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
