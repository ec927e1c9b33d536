"""FP8 (e4m3) schemes of a checkpoint's `quantization_config`, and `--quantization fp8`:
what a model's FP8 projections are, read without torch (engine/model/fp8.py runs them).

Schemes (`Fp8Scheme.of`, from config.json's `quantization_config`):
- `fp8` (AutoFP8, vLLM's `Fp8Config`): per-tensor weight scales (`weight_scale`), input
  `dynamic` or `static` (`input_scale`), `ignored_layers` / `modules_to_not_convert` left
  in the model's dtype. Its block-wise form (`weight_block_size`, `weight_scale_inv`: the
  DeepSeek and Qwen3 FP8 releases) is refused by name;
- `fbgemm_fp8` (Meta's Llama 3.1 FP8): per-channel weight scales, dynamic per-token input
  whose scale is capped at `activation_scale_ub`;
- `compressed-tensors` with `format` `float-quantized` (llm-compressor's FP8 and FP8-dynamic):
  weights `tensor` or `channel`, input `tensor` (static or dynamic), `token` (dynamic) or
  none (weights only); a dynamic per-tensor input is quantized per token (as fine or finer).
  Integer, grouped and block strategies are refused by name.
`--quantization fp8` (`Fp8Scheme.at_load`) quantizes a 16- or 32-bit checkpoint's
projections as it loads them: per-channel weight scales, dynamic per-token input; the
embeddings and the LM head stay as they are, as vLLM leaves them. A mixture's experts in FP8
run the torch form (engine/model/moe.py); its router stays in the model's dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.types import UnsupportedModelError

QUANTIZATIONS = ("fp8",)
"""What `--quantization` takes."""
KV_CACHE_DTYPES = ("auto", "fp8")
"""What `--kv-cache-dtype` takes."""
INPUTS = ("dynamic", "static", "weights_only")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's projections are FP8."""

    method: str
    """The checkpoint's quant_method, or "fp8" quantized at load (`at_load`)."""
    weights: str
    """"tensor" or "channel": one scale per weight, or per output row."""
    inputs: str
    """One of INPUTS."""
    ignore: tuple[str, ...] = ()
    """Modules left in the model's dtype: names, name suffixes, or "re:" patterns."""
    at_load: bool = False
    """The checkpoint is 16/32-bit; its projections are quantized as they load."""
    scale_ub: float | None = None
    """fbgemm_fp8: the largest dynamic input scale's amax (`activation_scale_ub`)."""

    @classmethod
    def loading(cls) -> Fp8Scheme:
        """`--quantization fp8` of a 16- or 32-bit checkpoint."""
        return cls("fp8", "channel", "dynamic", ("lm_head",), at_load=True)

    @classmethod
    def of(cls, quant: Any) -> Fp8Scheme:
        """The scheme of a config.json's `quantization_config`; UnsupportedModelError naming
        what is not FP8 as we serve it."""
        if not isinstance(quant, dict):
            raise UnsupportedModelError(f"config field 'quantization_config' is {quant!r}, not a map")
        method = str(quant.get("quant_method", "?"))
        if method == "fp8":
            if quant.get("weight_block_size"):
                raise UnsupportedModelError(
                    f"quantization_config: block-wise FP8 (weight_block_size {quant['weight_block_size']}, "
                    "weight_scale_inv) is not supported; use a per-tensor or per-channel FP8 build, or "
                    "--quantization fp8 on the 16-bit checkpoint")
            inputs = str(quant.get("activation_scheme", "dynamic"))
            if inputs not in ("dynamic", "static"):
                raise UnsupportedModelError(f"quantization_config: activation_scheme {inputs!r} (dynamic or static)")
            ignore = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or ()
            return cls(method, "tensor", inputs, tuple(ignore))
        if method == "fbgemm_fp8":
            ub = quant.get("activation_scale_ub")
            return cls(method, "channel", "dynamic", tuple(quant.get("modules_to_not_convert") or ()),
                       scale_ub=float(ub) if ub is not None else None)
        if method == "compressed-tensors":
            return cls._compressed(quant)
        raise UnsupportedModelError(f"config field 'quantization_config' is set ({method}): of quantized checkpoints "
                                    "only FP8 ones load (fp8, fbgemm_fp8, compressed-tensors float-quantized); "
                                    "a GGUF file of the model does too")

    @classmethod
    def _compressed(cls, quant: dict) -> Fp8Scheme:
        fmt = quant.get("format")
        if fmt != "float-quantized":
            raise UnsupportedModelError(f"quantization_config: compressed-tensors format {fmt!r} is not supported "
                                        "(float-quantized FP8 is)")
        groups = list((quant.get("config_groups") or {}).values())
        if not groups:
            raise UnsupportedModelError("quantization_config: compressed-tensors without config_groups")
        schemes = {cls._group(g) for g in groups}
        if len(schemes) > 1:
            raise UnsupportedModelError(f"quantization_config: config groups with different schemes {sorted(schemes)}")
        weights, inputs = schemes.pop()
        return cls("compressed-tensors", weights, inputs, tuple(quant.get("ignore") or ()))

    @staticmethod
    def _group(group: dict) -> tuple[str, str]:
        targets = group.get("targets") or []
        if targets != ["Linear"]:
            raise UnsupportedModelError(f"quantization_config: a config group targets {targets!r} (only ['Linear'])")
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UnsupportedModelError(f"quantization_config: {w.get('type')} {w.get('num_bits')}-bit weights are not "
                                        "supported (float 8-bit are)")
        if w.get("strategy") not in ("tensor", "channel") or w.get("dynamic"):
            raise UnsupportedModelError(f"quantization_config: weight strategy {w.get('strategy')!r} is not supported "
                                        "(tensor or channel)")
        a = group.get("input_activations")
        if a is None:
            return w["strategy"], "weights_only"
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise UnsupportedModelError(f"quantization_config: {a.get('type')} {a.get('num_bits')}-bit inputs are not "
                                        "supported (float 8-bit are)")
        strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
        if strategy == "token" and dynamic or strategy == "tensor":
            return w["strategy"], "dynamic" if dynamic else "static"
        raise UnsupportedModelError(f"quantization_config: input strategy {strategy!r} (dynamic {dynamic}) is not "
                                    "supported (token dynamic, or tensor)")

    def covers(self, module: str) -> bool:
        """Whether the projection `module` (its name without `.weight`) is FP8."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True


KV_ID_MARKS = ("+kv-fp8", "+fp8")
"""What `kv_model_id` appends, last first."""


def served_name(kv_id: str) -> str:
    """The model's name for clients: its KV's name without the marks of how it is quantized
    (a client asks for the model, not for its bytes; vLLM keeps the name under --quantization)."""
    for mark in KV_ID_MARKS:
        kv_id = kv_id.removesuffix(mark)
    return kv_id


def kv_model_id(model_id: str, scheme: Fp8Scheme | None, kv_cache_dtype: str = "auto") -> str:
    """The name a model's KV is known by (block hashes, kvfabric's layout, the KV store): a
    checkpoint quantized at load computes other KV than the checkpoint as it is, and FP8 KV
    is not the 16-bit KV, so each is named apart ("+fp8", "+kv-fp8")."""
    return (model_id + ("+fp8" if scheme is not None and scheme.at_load else "")
            + ("+kv-fp8" if kv_cache_dtype == "fp8" else ""))
