"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3 and their mixtures of experts,
Mixtral, Gemma 3's text model) over the paged KV pool.

Reads as single-device code: batch layout and attention metadata come in as
arguments. Tokens of all requests are packed into one [num_tokens] dimension.
At load time q/k/v and gate/up projections are fused into one matmul each, and every
projection becomes a `Linear` (weights packed once on CPU: for the native bfloat16
matmul or for oneDNN). With native kernels (engine/kernels/native.py) each block's output is
added to the residual stream and normalised in one pass, q and k are rotated in place
and k, v stored into the pool in one pass, SwiGLU is one pass, and decode attention
reads the paged pool directly. A bfloat16 step that is one decode batch runs all layers
in one native call (`NativeKernels.decode_layers`: the same kernels in the same order,
without the Python in between).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.attention import ATTENTION_WORKSPACE_BYTES, AttentionMetadata, PagedGroup, paged_attention
from engine.model.kv_pool import KVPool
from engine.model.linear import Linear
from engine.model.model_config import ModelConfig
from engine.checkpoints.model_reader import ModelReader
from engine.model.moe import MoEWeights, moe_forward
from engine.kernels.native import NativeLayer
from engine.kernels.native import NativeKernels

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.kernels.gpu_kernels import Kernels
    from engine.parallel.tensor_parallel import TensorParallel
from engine.model.rope import RotaryTable, apply_rotary

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The model dtypes by their config names (`EngineConfig.dtype`)."""
PROMPT_LOGIT_ROWS = 256
"""Prompt positions whose logits are made at once for prompt log-probabilities (256 x a 128K
vocabulary is 128 MiB of float32)."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None
    """[gate; up], `swiglu`: returns the MLP's activation silu(gate) * up (None: a mixture of experts)."""
    down: Linear | None
    moe: MoEWeights | None = None
    """The layer's mixture of experts in place of the MLP (engine/model/moe.py), or None."""
    attn_out_norm: torch.Tensor | None = None
    """Gemma: the attention's output normalised before the residual add (its post_attention_layernorm)."""
    mlp_out_norm: torch.Tensor | None = None
    """Gemma: the MLP's output likewise (post_feedforward_layernorm)."""
    q_norm: torch.Tensor | None = None
    """[head_dim]: each query head RMS-normalised before rope (Qwen3); None: not."""
    k_norm: torch.Tensor | None = None
    """[head_dim]: each key head likewise."""


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
        self.scale = config.query_scale or config.head_dim**-0.5
        self.rotary = RotaryTable(config.rope, config.head_dim, config.max_position_embeddings, device)
        self.local_rotary = None if config.local_rope is None else RotaryTable(
            config.local_rope, config.head_dim, config.max_position_embeddings, device)
        """The sliding-window layers' rope, where it is their own (Gemma 3)."""
        self.embed_scale = torch.tensor(config.embed_scale, dtype=dtype).item()
        """The embeddings' scale rounded to the dtype first, as transformers rounds it."""
        self.layers: list[LayerWeights] = []
        self.kernels: Kernels | None = None
        """Native C kernels on CPU, Triton ones on GPUs (engine/kernels/gpu_kernels.py); None: the torch forms."""
        self.native_layers: ctypes.Array | None = None
        """The layers' weight pointers for `NativeKernels.decode_layers`, where it can run them."""
        self.tp: TensorParallel | None = None
        """This process's rank of a tensor-parallel model; None: the whole model is here."""
        self.kv_scales = torch.ones(config.num_layers, 2)
        """[num_layers, 2]: what an FP8 KV pool divides K and V by (the checkpoint's `k_scale` and
        `v_scale` where it has them, as compressed-tensors' FP8 KV writes them; else 1.0)."""

    @classmethod
    def load(
        cls, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: str, prepack: bool = True,
        kernels: Kernels | None = None, tp: TensorParallel | None = None,
    ) -> LlamaForCausalLM:
        """`tp`: this process's rank of a tensor-parallel model (engine/parallel/tensor_parallel.py): it
        loads its share of each tensor and runs with its local heads (`model.config`)."""
        model = cls(tp.local_config(config) if tp is not None else config, dtype, device)
        model.tp = tp
        model.kernels = kernels if kernels is not None and kernels.supports(dtype, device) else None
        r = ModelReader(model_dir, config, dtype, device, prepack, model.kernels, tp)
        model.embed = r.get("model.embed_tokens.weight")
        model.norm = r.norm("model.norm.weight")
        model.tied = config.tie_word_embeddings or not r.has("lm_head.weight")
        model.lm_head = Linear(model.embed, None, prepack, model.kernels) if model.tied else r.linear(["lm_head"])
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            moe = config.moe is not None and i in config.moe.layers
            model.layers.append(LayerWeights(
                input_norm=r.norm(p + "input_layernorm.weight"),
                qkv=r.linear([a + f"{n}_proj" for n in "qkv"], stored=a + "qkv_proj"),
                o=r.linear([a + "o_proj"]),
                post_norm=r.norm(p + ("pre_feedforward_layernorm" if config.sandwich_norms
                                      else "post_attention_layernorm") + ".weight"),
                gate_up=None if moe else r.linear([m + "gate_proj", m + "up_proj"],
                                                  swiglu=config.hidden_act == "silu", stored=m + "gate_up_proj"),
                down=None if moe else r.linear([m + "down_proj"]),
                moe=r.experts(p) if moe else None,
                q_norm=r.norm(a + "q_norm.weight") if config.qk_norm else None,
                k_norm=r.norm(a + "k_norm.weight") if config.qk_norm else None,
                attn_out_norm=r.norm(p + "post_attention_layernorm.weight") if config.sandwich_norms else None,
                mlp_out_norm=r.norm(p + "post_feedforward_layernorm.weight") if config.sandwich_norms else None,
            ))
        order = model.linears()
        for first, then in zip(order, order[1:]):
            first.runs_before(then)
        model.native_layers = model._native_layers()
        model.kv_scales = r.kv_scales()
        return model

    def use_kernels(self, kernels: Kernels | None) -> None:
        """Run with `kernels` (None: the torch forms) from now on; GPU kernels only (the native
        ones lay weights out at load). For comparing the two on the same weights."""
        if isinstance(self.kernels, NativeKernels) or isinstance(kernels, NativeKernels):
            raise ValueError("the native CPU kernels are chosen at load time")
        self.kernels = kernels
        for x in self.linears():
            x.kernels = kernels

    def linears(self) -> list[Linear]:
        """Every projection, in the order forward() calls them (the lm_head last)."""
        return [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down) if x is not None
                ] + [self.lm_head]

    def _native_layers(self) -> ctypes.Array | None:
        if self.kernels is None or self.dtype != torch.bfloat16 or not self.config.llama_layers or self.tp:
            return None  # (decode_layers runs Llama's layer, and only it, whole)
        if any(x.tiles is None for x in self.linears()[:-1]):  # decode_layers runs the native matmul only
            return None
        if any(x.fp8 is not None for x in self.linears()):  # and no FP8 scales
            return None
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        assert all(x.gate_up is not None and x.down is not None for x in self.layers)
        return (NativeLayer * len(self.layers))(*(NativeLayer(
            input_norm=ptr(x.input_norm), qkv=ptr(x.qkv.tiles), qkv_bias=ptr(x.qkv.bias), o=ptr(x.o.tiles),
            o_bias=ptr(x.o.bias), post_norm=ptr(x.post_norm), gate_up=ptr(x.gate_up.tiles),
            gate_up_bias=ptr(x.gate_up.bias), down=ptr(x.down.tiles), down_bias=ptr(x.down.bias),
        ) for x in self.layers))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the checkpoint's weights as loaded (tied embeddings counted once)."""
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        total = size(self.embed) + size(self.norm) + (0 if self.tied else self.lm_head.nbytes)
        for layer in self.layers:
            total += size(layer.input_norm) + size(layer.post_norm)
            total += sum(size(t) for t in (layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm)
                         if t is not None)
            total += sum(x.nbytes for x in (layer.qkv, layer.o, layer.gate_up, layer.down, layer.moe) if x is not None)
        return total

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
        prompt_rows: tuple[torch.Tensor, Callable[[int, torch.Tensor], None]] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_index: [num_logits] into the tokens.
        `prompt_rows` (index, take): more tokens whose logits are wanted (prompt log-probabilities),
        handed to `take(offset into index, logits)` PROMPT_LOGIT_ROWS at a time, never all at once.

        Returns float32 logits [num_logits, vocab_size].
        """
        cos, sin = self.rotary.lookup(positions, self.dtype)
        local = (cos, sin) if self.local_rotary is None else self.local_rotary.lookup(positions, self.dtype)
        # [num_tokens, hidden], a copy: the residual stream, added to in place
        h = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids, self.config.vocab_size)
        if self.embed_scale != 1.0:
            h *= self.embed_scale
        group = meta.groups[0] if len(meta.groups) == 1 else None
        if self.native_layers is not None and isinstance(group, PagedGroup) and group.in_order and not pool.fp8:
            assert self.kernels is not None
            cfg, gate_up = self.config, self.layers[0].gate_up
            assert gate_up is not None
            delta = self.kernels.decode_layers(
                self.native_layers, h, cos, sin, pool.tensor, meta.slot_blocks, meta.slot_offsets, group.block_table,
                group.rows, group.ctx_lens, (cfg.num_heads, cfg.num_kv_heads, gate_up.out_features // 2),
                cfg.rms_norm_eps, self.scale, self.lm_head.tiles)
        else:
            delta = None  # the last block's output, not yet added to h
            for i, layer in enumerate(self.layers):
                c, s = local if self.config.layer_windows[i] else (cos, sin)
                delta = self._attention(i, layer, self._add_norm(h, delta, layer.input_norm), c, s, pool, meta)
                if layer.attn_out_norm is not None:
                    delta = self._add_norm(delta, None, layer.attn_out_norm)
                delta = self._mlp(layer, self._add_norm(h, delta, layer.post_norm))
                if layer.mlp_out_norm is not None:
                    delta = self._add_norm(delta, None, layer.mlp_out_norm)
        if prompt_rows is not None:
            index, take = prompt_rows
            for a in range(0, index.numel(), PROMPT_LOGIT_ROWS):
                rows = index[a:a + PROMPT_LOGIT_ROWS]
                take(a, self._logits(h[rows], delta[rows]))
        return self._logits(h[logits_index], delta[logits_index])

    def _logits(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """float32 logits of these tokens' last hidden states (the residual and the last block's output)."""
        x = self._add_norm(h, delta, self.norm)  # [num_logits, hidden]
        logits = self.lm_head(x) if self.tp is None else self.tp.gather_logits(self.lm_head(x), self.config.vocab_size)
        logits = logits.float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """h += delta (in place), then RMSNorm(h): one native pass where there are kernels."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(h, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, self.config.rms_norm_eps)

    def _attention(
        self, i: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        pool: KVPool, meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.config
        n, d = x.shape[0], cfg.head_dim
        h, kvh = cfg.num_heads, cfg.num_kv_heads
        qkv = layer.qkv(x)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[:, : (h + kvh) * d].view(n, h + kvh, d)
        v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
        if layer.q_norm is not None and layer.k_norm is not None:  # in place: the rotation reads qkv
            qk[:, :h] = rms_norm(qk[:, :h], layer.q_norm, cfg.rms_norm_eps)
            qk[:, h:] = rms_norm(qk[:, h:], layer.k_norm, cfg.rms_norm_eps)
        if self.kernels is not None and not pool.fp8:  # q and k rotated in place, k and v stored: one pass
            self.kernels.rotary_store(qkv, h, kvh, cos, sin, pool.tensor, i, meta.slot_blocks, meta.slot_offsets)
        else:
            qk = apply_rotary(qk, cos, sin)  # q and k in one pass
            pool.write(i, meta.slot_blocks, meta.slot_offsets, qk[:, h:], v)
        q, k = qk[:, :h], qk[:, h:]  # [num_tokens, heads | kv_heads, head_dim]
        workspace = ATTENTION_WORKSPACE_BYTES if q.is_cuda else None
        o = paged_attention(q, k, v, i, pool, meta, self.scale, self.kernels, workspace,
                            cfg.layer_windows[i], cfg.attn_softcap)  # [num_tokens, heads, head_dim]
        return self._summed(layer.o(o.reshape(n, h * d)))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: each rank's part, summed (the whole, untouched)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if layer.moe is not None:
            assert self.config.moe is not None
            # grouped GEMMs on GPUs (engine/kernels/triton_moe.py), FP8 experts too
            if self.kernels is not None:
                return self._summed(self.kernels.moe(x, layer.moe, self.config.moe))
            return self._summed(moe_forward(x, layer.moe, self.config.moe))
        assert layer.gate_up is not None and layer.down is not None
        if self.config.hidden_act == "gelu_tanh":  # GeGLU (Gemma): gate_up is the plain product
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            return self._summed(layer.down(torch.nn.functional.gelu(gate, approximate="tanh") * up))
        return self._summed(layer.down(layer.gate_up(x)))  # gate_up returns silu(gate) * up
