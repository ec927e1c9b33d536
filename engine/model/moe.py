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

FP8 experts (`Fp8Experts`: each projection's e4m3 values in the stacked weights, a float32
scale per output row beside them) quantize each expert's input rows as an FP8 `Linear` does
(engine/model/fp8.py) and scale the product. On GPUs the stacked weights are stored as e4m3
(one byte a value) and run through the grouped GEMM's FP8 form; this torch form widens an
expert's values to the input's dtype (exact) where it runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.fp8 import E4M3, Fp8Weight, fp8_product, quantize_weight
from engine.model.model_config import MoEConfig

Projection = Callable[[str], tuple[torch.Tensor, Fp8Weight | None]]
"""A projection's weight by name (this rank's share) and its FP8 scales where it is FP8."""


@dataclass
class Fp8Experts:
    """The scales of a mixture's FP8 projections (their e4m3 values are `MoEWeights`')."""

    gate_up: torch.Tensor
    """[experts, 2 * intermediate] float32."""
    down: torch.Tensor
    """[experts, hidden] float32."""
    inputs: str
    """dynamic (per token), static, or weights_only (as `Fp8Scheme.inputs`)."""
    gate_up_input: torch.Tensor | None = None
    """[experts] float32: each expert's static input scale (None: per token)."""
    down_input: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    """[2 * shared intermediate], and the shared expert's down scales [hidden] (Qwen2-MoE)."""
    shared_down: torch.Tensor | None = None
    shared_inputs: tuple[float | None, float | None] = (None, None)
    scale_ub: float | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in (self.gate_up, self.down, self.gate_up_input, self.down_input,
                                           self.shared_gate_up, self.shared_down) if t is not None)


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
    fp8: Fp8Experts | None = None
    """The FP8 projections' scales, where the experts are FP8."""

    @classmethod
    def load(cls, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str,
             config: MoEConfig, projection: Projection | None = None, inputs: str = "dynamic",
             scale_ub: float | None = None) -> MoEWeights:
        """`prefix`: the layer's ("model.layers.{i}."). The experts per expert, as checkpoints
        store them, or stacked already (`experts.gate_up_proj`, `experts.down_proj`: how
        transformers holds them, and so a converted GGUF). `projection`: where the model is
        FP8, each expert projection's weight and scales (engine/model/decoder.py); `inputs`, `scale_ub`:
        the scheme's."""
        block, gate_name, up_name, down_name = config.checkpoint_names
        p = f"{prefix}{block}."
        experts = range(config.num_experts)
        proj = projection or (lambda name: (get(name + ".weight"), None))
        if has(p + "experts.gate_up_proj"):
            gate_up, down = get(p + "experts.gate_up_proj"), get(p + "experts.down_proj")
            parts: list[list[Fp8Weight | None]] = []
            if projection is not None:  # `--quantization fp8` of stacked experts (FP8 checkpoints store them apart)
                gate_up, down, parts = _quantized_stacked(gate_up, down)
        else:
            loaded = [[proj(f"{p}experts.{e}.{n}") for n in (gate_name, up_name, down_name)] for e in experts]
            gate_up = torch.stack([torch.cat([g[0], u[0]]) for g, u, _ in loaded])
            down = torch.stack([d[0] for _, _, d in loaded])
            parts = [[q for _, q in row] for row in loaded]
        weights = cls(router=get(p + "gate.weight"), gate_up=gate_up, down=down)
        shared: list[Fp8Weight | None] = []
        if config.shared_intermediate_size:
            s = p + "shared_expert."
            (sg, qg), (su, qu), (sd, qd) = (proj(s + n) for n in ("gate_proj", "up_proj", "down_proj"))
            weights.shared_gate_up, weights.shared_down, shared = torch.cat([sg, su]), sd, [qg, qu, qd]
            weights.shared_gate = get(p + "shared_expert_gate.weight")
        scales = [q for row in parts for q in row] + shared
        if any(q is not None for q in scales):
            if not all(q is not None for q in scales):
                raise ValueError(f"of {p}'s expert projections some are FP8, some not")
            weights.fp8 = _fp8_experts(parts, shared, inputs, scale_ub)  # type: ignore[arg-type]
            if gate_up.is_cuda:  # one byte a value (they are e4m3 values: exact)
                weights.gate_up, weights.down = gate_up.to(E4M3), down.to(E4M3)
        return weights

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.router, self.gate_up, self.down, self.shared_gate_up,
                                                          self.shared_down, self.shared_gate) if t is not None
                   ) + (self.fp8.nbytes if self.fp8 is not None else 0)


def _quantized_stacked(gate_up: torch.Tensor, down: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, list[list[Fp8Weight | None]]]:
    """Stacked experts quantized per output row as they load (this rank's share of them):
    e4m3 values in the weights' dtype, and per expert its [gate; up] scales (as a gate and an
    up part) and its down scales."""
    def rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = quantize_weight(w.reshape(-1, w.shape[-1]))
        return q.values.to(w.dtype).view(w.shape), q.scale.view(w.shape[:-1])

    gate_up, gu_scale = rows(gate_up)
    down, d_scale = rows(down)
    half = gate_up.shape[1] // 2
    parts: list[list[Fp8Weight | None]] = [
        [Fp8Weight(gate_up[e, :half], gu_scale[e, :half]), Fp8Weight(gate_up[e, half:], gu_scale[e, half:]),
         Fp8Weight(down[e], d_scale[e])] for e in range(gate_up.shape[0])]
    return gate_up, down, parts


def _fp8_experts(parts: list[list[Fp8Weight]], shared: list[Fp8Weight], inputs: str,
                 scale_ub: float | None) -> Fp8Experts:
    """Stacked scales; a fused [gate; up]'s static input scale is the larger of the two."""
    static = inputs == "static"

    def fused_input(gate: Fp8Weight, up: Fp8Weight) -> float:
        return max(gate.input_scale or 0.0, up.input_scale or 0.0)

    fp8 = Fp8Experts(gate_up=torch.stack([torch.cat([g.scale, u.scale]) for g, u, _ in parts]),
                     down=torch.stack([d.scale for _, _, d in parts]), inputs=inputs, scale_ub=scale_ub)
    if static:  # beside the weights (the grouped GEMM gathers them per pair on the device)
        device = fp8.gate_up.device
        fp8.gate_up_input = torch.tensor([fused_input(g, u) for g, u, _ in parts], device=device)
        fp8.down_input = torch.tensor([d.input_scale or 0.0 for _, _, d in parts], device=device)
    if shared:
        g, u, d = shared
        fp8.shared_gate_up, fp8.shared_down = torch.cat([g.scale, u.scale]), d.scale
        fp8.shared_inputs = (fused_input(g, u), d.input_scale) if static else (None, None)
    return fp8


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
    q = w.fp8
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[start:start + n]
        if q is None:
            gate, up = F.linear(x[rows], w.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w.down[e])
        else:
            static = (float(q.gate_up_input[e]), float(q.down_input[e])) if q.gate_up_input is not None and \
                q.down_input is not None else (None, None)
            gate, up = _fp8_projection(x[rows], w.gate_up[e], q.gate_up[e], q, static[0]).chunk(2, -1)
            y = _fp8_projection(F.silu(gate) * up, w.down[e], q.down[e], q, static[1])
        out.index_add_(0, rows, y * scale[start:start + n, None])
        start += n
    add_shared_expert(out, x, w)
    return out


def add_shared_expert(out: torch.Tensor, x: torch.Tensor, w: MoEWeights) -> None:
    """out += the shared expert's output, gated by sigmoid(x @ g) (Qwen2-MoE; none: nothing)."""
    if w.shared_gate_up is not None and w.shared_down is not None and w.shared_gate is not None:
        q = w.fp8
        if q is not None and q.shared_gate_up is not None and q.shared_down is not None:
            gate, up = _fp8_projection(x, w.shared_gate_up, q.shared_gate_up, q, q.shared_inputs[0]).chunk(2, dim=-1)
            y = _fp8_projection(F.silu(gate) * up, w.shared_down, q.shared_down, q, q.shared_inputs[1])
        else:
            gate, up = F.linear(x, w.shared_gate_up).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w.shared_down)
        out += torch.sigmoid(F.linear(x, w.shared_gate)) * y


def _fp8_projection(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, q: Fp8Experts,
                    static: float | None) -> torch.Tensor:
    """An FP8 expert projection in the torch form: `values` its e4m3 values (widened to x's
    dtype here, exact), `scale` its scale per output row. With 16-bit inputs (weights_only) the
    weight is dequantized first, as an FP8 Linear's is at load (the raw e4m3 product, up to
    448 times the output, could overflow float16)."""
    if q.inputs == "weights_only":
        return F.linear(x, (values.float() * scale[:, None]).to(x.dtype))
    return fp8_product(x, lambda v: F.linear(v, values.to(v.dtype)), scale, q.inputs, static, q.scale_ub)
