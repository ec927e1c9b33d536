"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV pool.

Reads as single-device code: batch layout and attention metadata come in as
arguments. Tokens of all requests are packed into one [num_tokens] dimension.
At load time q/k/v and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.kv_pool import KVPool
from engine.model_config import ModelConfig
from engine.rope import RotaryTable, apply_rotary
from engine.weights import CheckpointReader


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises in float32, as Hugging Face does, then scales in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaForCausalLM:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.scale = config.head_dim**-0.5
        self.rotary = RotaryTable(config.rope, config.head_dim, config.max_position_embeddings, device)
        self.layers: list[LayerWeights] = []

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
        model = cls(config, dtype, device)
        ckpt = CheckpointReader(model_dir)
        get = lambda name: ckpt.get(name, dtype, device)  # noqa: E731
        opt = lambda name: get(name) if ckpt.has(name) else None  # noqa: E731
        model.embed = get("model.embed_tokens.weight")
        model.norm = get("model.norm.weight")
        if config.tie_word_embeddings or not ckpt.has("lm_head.weight"):
            model.lm_head = model.embed
        else:
            model.lm_head = get("lm_head.weight")
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv_b = [opt(a + f"{n}_proj.bias") for n in "qkv"]
            gu_b = [opt(m + f"{n}_proj.bias") for n in ("gate", "up")]
            model.layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"]),
                qkv_bias=torch.cat(qkv_b) if all(b is not None for b in qkv_b) else None,
                o=get(a + "o_proj.weight"),
                o_bias=opt(a + "o_proj.bias"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
                gate_up_bias=torch.cat(gu_b) if all(b is not None for b in gu_b) else None,
                down=get(m + "down_proj.weight"),
                down_bias=opt(m + "down_proj.bias"),
            ))
        return model

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_index: [num_logits] into the tokens.

        Returns float32 logits [num_logits, vocab_size].
        """
        cfg = self.config
        cos, sin = self.rotary.lookup(positions, self.dtype)
        h = self.embed[input_ids]  # [num_tokens, hidden]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, rms_norm(h, layer.input_norm, cfg.rms_norm_eps), cos, sin, pool, meta)
            h = h + self._mlp(layer, rms_norm(h, layer.post_norm, cfg.rms_norm_eps))
        h = rms_norm(h[logits_index], self.norm, cfg.rms_norm_eps)  # [num_logits, hidden]
        return F.linear(h, self.lm_head).float()

    def _attention(
        self, i: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        pool: KVPool, meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.config
        n, d = x.shape[0], cfg.head_dim
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q, k, v = qkv.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
        q = apply_rotary(q.view(n, cfg.num_heads, d), cos, sin)  # [num_tokens, heads, head_dim]
        k = apply_rotary(k.view(n, cfg.num_kv_heads, d), cos, sin)  # [num_tokens, kv_heads, head_dim]
        v = v.view(n, cfg.num_kv_heads, d)
        o = paged_attention(q, k, v, i, pool, meta, self.scale)  # [num_tokens, heads, head_dim]
        return F.linear(o.reshape(n, cfg.num_heads * d), layer.o, layer.o_bias)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down, layer.down_bias)
