"""A mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE), the reference torch form.

    router: logits = x @ gate^T  ->  softmax in float32  ->  the top k experts per token
            (weights renormalised over those k where the model says so)
    experts: the batch's (token, expert) pairs sorted by expert, so each expert the batch
            touches runs once, on the rows routed to it (one SwiGLU: gate_up, silu * up,
            down), its output scaled by the routing weight and added into its tokens' rows
            (index_add, experts in ascending order, as transformers sums them)
    shared expert (Qwen2-MoE): a dense SwiGLU every token takes, scaled by sigmoid(x @ g)

No Python loop runs per token; one runs per expert the batch touches (at most
`num_experts`, and a decode batch of n tokens touches at most n * top_k). The weights are
stacked per layer: gate_up [experts, 2 * intermediate, hidden], down [experts, hidden,
intermediate]. A grouped-GEMM kernel over the experts a batch touches takes the same
arguments on GPUs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model_config import MoEConfig


@dataclass
class MoEWeights:
    router: torch.Tensor
    """[experts, hidden]."""
    gate_up: torch.Tensor
    """[experts, 2 * intermediate, hidden]: each expert's gate rows, then its up rows."""
    down: torch.Tensor
    """[experts, hidden, intermediate]."""
    shared_gate_up: torch.Tensor | None = None
    """[2 * shared intermediate, hidden] (Qwen2-MoE), or None."""
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    """[1, hidden]: the shared expert's sigmoid gate."""

    @classmethod
    def load(cls, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str,
             config: MoEConfig) -> MoEWeights:
        """`prefix`: the layer's ("model.layers.{i}."). The experts per expert, as checkpoints
        store them, or stacked already (`experts.gate_up_proj`, `experts.down_proj`: how
        transformers holds them, and so a converted GGUF)."""
        block, gate_name, up_name, down_name = config.checkpoint_names
        p = f"{prefix}{block}."
        experts = range(config.num_experts)
        if has(p + "experts.gate_up_proj"):
            gate_up, down = get(p + "experts.gate_up_proj"), get(p + "experts.down_proj")
        else:
            gate_up = torch.stack([torch.cat([get(f"{p}experts.{e}.{gate_name}.weight"),
                                              get(f"{p}experts.{e}.{up_name}.weight")]) for e in experts])
            down = torch.stack([get(f"{p}experts.{e}.{down_name}.weight") for e in experts])
        weights = cls(router=get(p + "gate.weight"), gate_up=gate_up, down=down)
        if config.shared_intermediate_size:
            s = p + "shared_expert."
            weights.shared_gate_up = torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")])
            weights.shared_down = get(s + "down_proj.weight")
            weights.shared_gate = get(p + "shared_expert_gate.weight")
        return weights

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.router, self.gate_up, self.down, self.shared_gate_up,
                                                          self.shared_down, self.shared_gate) if t is not None)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, hidden] -> (weights [tokens, top_k] in x's dtype, experts [tokens, top_k])."""
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def moe_forward(x: torch.Tensor, w: MoEWeights, config: MoEConfig) -> torch.Tensor:
    """x: [tokens, hidden] -> [tokens, hidden]."""
    weights, experts = route(x, w.router, config.top_k, config.norm_topk_prob)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=config.num_experts).tolist()
    tokens = order // config.top_k
    scale = weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[start:start + n]
        gate, up = F.linear(x[rows], w.gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w.down[e])
        out.index_add_(0, rows, y * scale[start:start + n, None])
        start += n
    add_shared_expert(out, x, w)
    return out


def add_shared_expert(out: torch.Tensor, x: torch.Tensor, w: MoEWeights) -> None:
    """out += the shared expert's output, gated by sigmoid(x @ g) (Qwen2-MoE; none: nothing)."""
    if w.shared_gate_up is not None and w.shared_down is not None and w.shared_gate is not None:
        gate, up = F.linear(x, w.shared_gate_up).chunk(2, dim=-1)
        out += torch.sigmoid(F.linear(x, w.shared_gate)) * F.linear(F.silu(gate) * up, w.shared_down)
