"""A checkpoint's tensors as one rank of a model holds them: `LlamaForCausalLM.load` asks for
each by name and gets this rank's share (engine/parallel/tensor_parallel.py), in the model's dtype.

Projections come as `Linear`s, fused where the model runs them as one (q/k/v, gate/up), and
FP8 where the checkpoint stores them so or `--quantization fp8` quantizes them
(engine/checkpoints/quant_config.py): their e4m3 values with each output row's scale, quantized from the
whole weight before it is split, so a split model has the whole one's scales.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.fp8 import Fp8Weight, channel_scale, quantize_weight
from engine.model.linear import Linear
from engine.model.model_config import ModelConfig
from engine.model.moe import MoEWeights
from engine.types import UnsupportedModelError
from engine.checkpoints.weights import CheckpointReader

if TYPE_CHECKING:
    from engine.kernels.gpu_kernels import Kernels
    from engine.parallel.tensor_parallel import TensorParallel


class ModelReader:
    def __init__(self, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: str, prepack: bool,
                 kernels: Kernels | None, tp: TensorParallel | None) -> None:
        """`config`: the whole model's; `kernels`: the ones the model runs with (its Linears are
        laid out for them)."""
        self.ckpt = CheckpointReader(model_dir)
        self.config, self.dtype, self.device, self.prepack, self.kernels, self.tp = \
            config, dtype, device, prepack, kernels, tp
        self.fp8 = config.fp8

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def share(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of the checkpoint tensor `name`'s value `t`."""
        return t if self.tp is None else self.tp.shard(name, t, self.config)

    def get(self, name: str) -> torch.Tensor:
        return self.share(name, self.ckpt.get(name, self.dtype, self.device))

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.ckpt.has(name) else None

    def norm(self, name: str) -> torch.Tensor:
        """A norm's weight; Gemma's w is applied as 1 + w, added here in float32 as it adds it."""
        if not self.config.norm_offset:
            return self.get(name)
        return (self.ckpt.get(name, torch.float32, self.device) + 1.0).to(self.dtype)

    def projection(self, name: str) -> tuple[torch.Tensor, Fp8Weight | None]:
        """A projection's weight (this rank's share) and, where it is FP8, its scales: the
        checkpoint's, or made here from the whole weight (`--quantization fp8`)."""
        key, fp8, ckpt = name + ".weight", self.fp8, self.ckpt
        stored_fp8 = fp8 is not None and ckpt.is_fp8(key)
        if fp8 is None or not (stored_fp8 or fp8.at_load and fp8.covers(name)):
            return self.get(key), None
        if stored_fp8:
            values = ckpt.get(key, self.dtype, self.device)  # e4m3 values: exact in any of our dtypes
            q = Fp8Weight(values, channel_scale(ckpt.get(name + ".weight_scale", torch.float32, self.device),
                                                values.shape[0]))
            if fp8.inputs == "static":
                q.input_scale = float(ckpt.get(name + ".input_scale", torch.float32, self.device).max())
        else:
            q = quantize_weight(ckpt.get(key, torch.float32, self.device))
            q.values = q.values.to(self.dtype)
        full = q.values.shape
        q.values = self.share(key, q.values)
        if self.tp is not None:  # the scales of the rows this rank holds
            q.scale = self.share(key, q.scale[:, None].expand(full))[:, 0].contiguous()
        return q.values, q

    def linear(self, names: list[str], swiglu: bool = False, stored: str | None = None) -> Linear:
        """One Linear over the projections `names`, or over `stored` where the checkpoint holds
        them fused already (Phi-3's qkv_proj and gate_up_proj, in the same order). FP8 ones keep
        each row's scale; a static input scale is the largest of theirs, as vLLM fuses them."""
        if stored is not None and self.ckpt.has(stored + ".weight"):
            names = [stored]
        biases = [self.opt(n + ".bias") for n in names]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        parts = [self.projection(n) for n in names]
        weight = torch.cat([w for w, _ in parts])
        scales = [q for _, q in parts if q is not None]
        if not scales:
            return Linear(weight, bias, self.prepack, self.kernels, swiglu)
        if len(scales) != len(parts):
            raise UnsupportedModelError(f"of the projections {names} some are FP8, some not")
        statics = [q.input_scale for q in scales if q.input_scale is not None]
        q = Fp8Weight(weight, torch.cat([q.scale for q in scales]), max(statics) if statics else None)
        assert self.fp8 is not None
        return Linear(weight, bias, self.prepack, self.kernels, swiglu, q, self.fp8.inputs, self.fp8.scale_ub)

    def experts(self, layer: str) -> MoEWeights:
        """The mixture of experts of the layer `layer` ("model.layers.{i}.")."""
        moe, fp8 = self.config.moe, self.fp8
        assert moe is not None
        if self.ckpt.is_fp8(f"{layer}{moe.checkpoint_names[0]}.gate.weight"):
            raise UnsupportedModelError("an FP8 router (the experts' gate) is not supported: FP8 checkpoints "
                                        "leave it in the model's dtype")
        if fp8 is None:
            return MoEWeights.load(self.get, self.has, layer, moe)
        return MoEWeights.load(self.get, self.has, layer, moe, self.projection, fp8.inputs, fp8.scale_ub)

    def kv_scales(self) -> torch.Tensor:
        """[num_layers, 2]: each layer's `self_attn.k_scale` and `v_scale` (1.0 where absent)."""
        def scale(name: str) -> float:
            return float(self.ckpt.get(name, torch.float32, "cpu").max()) if self.ckpt.has(name) else 1.0

        layers = (f"model.layers.{i}.self_attn." for i in range(self.config.num_layers))
        return torch.tensor([[scale(p + "k_scale"), scale(p + "v_scale")] for p in layers])
