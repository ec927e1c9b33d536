"""What an engine step costs on hardware we do not have: a roofline over the step's real
composition (pure, torch-free).

    a step's ScheduledRequests -> chunks [(new tokens, tokens computed before)] -> Roofline.step_s

A step reads every weight once and every scheduled request's KV once, and does 2 FLOPs per
weight per token plus attention's QK^T and PV over each token's context. Its time is the
larger of the compute time (FLOPs over the GPU's peak times `compute_efficiency`) and the
memory time (bytes over HBM bandwidth times `bandwidth_efficiency`), plus a fixed per-step
overhead (scheduling, kernel launches, sampling), plus, with tensor parallelism, two
all-reduces of the step's activations per layer over NVLink. Prefill-heavy steps land on the
compute roof, decode batches on the memory roof: the asymmetry disaggregation exists for.
KV transfer is its bytes over NVLink (same node) or the NIC (another node) plus a latency.

Stated numbers (every one can be overridden): H100 SXM 989 TFLOP/s dense bf16, 3.35 TB/s HBM,
80 GB, NVLink 450 GB/s per direction, a 400 Gb/s NIC (50 GB/s); efficiencies 0.6 (compute)
and 0.8 (bandwidth), 1.5 ms per step: what vLLM-class engines reach on H100s at good batch
sizes, not the datasheet.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    linear_bytes: int = 0
    """Bytes per weight of the layers' projections (1: FP8, `--quantization fp8`; 0: dtype_bytes);
    the embeddings and the LM head stay in the dtype, as the engine leaves them."""
    kv_dtype_bytes: int = 0
    """Bytes per KV element (1: `--kv-cache-dtype fp8`; 0: dtype_bytes)."""

    @property
    def layer_params(self) -> int:
        """Weights one layer multiplies by: q, k, v, o projections and the gated MLP."""
        q_o = 2 * self.hidden * self.num_heads * self.head_dim
        k_v = 2 * self.hidden * self.num_kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Every weight a token's forward multiplies by (the layers and the LM head)."""
        return self.num_layers * self.layer_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """All weights in memory (the embedding table too, unless tied to the head)."""
        embed = 0 if self.tied_embeddings else self.vocab * self.hidden
        layers = self.num_layers * self.layer_params * (self.linear_bytes or self.dtype_bytes)
        return layers + (self.vocab * self.hidden + embed) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def in_fp8(self, weights: bool, kv: bool) -> ModelShape:
        """The model with its projections' weights and/or its KV at one byte."""
        return dataclasses.replace(self, linear_bytes=1 if weights else self.linear_bytes,
                                   kv_dtype_bytes=1 if kv else self.kv_dtype_bytes)


LLAMA3_8B = ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256)
MODELS = {m.name: m for m in (LLAMA3_8B, LLAMA3_70B)}


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float = 50e9
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.0015
    link_latency_s: float = 20e-6
    host_bytes_per_s: float = 50e9
    """Host memory to the GPU (PCIe 5 x16): a fetch from the node's KV store."""
    ssd_bytes_per_s: float = 6e9
    """A node's NVMe reads (one PCIe 4 SSD): what the node's KV store spilled is read back
    before a fetch pushes it."""


H100_SXM = GPU("h100-sxm", peak_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=80e9, nvlink_bytes_per_s=450e9)
GPUS = {g.name: g for g in (H100_SXM,)}


class _StepConstants(NamedTuple):
    """What `Roofline.step_s` multiplies by, computed once per Roofline."""
    linear_flops_per_token: int
    head_flops_per_sample: int
    attention_flops: int
    """Per new token and token of context it attends to (QK^T and PV, all layers)."""
    kv_bytes_per_token: int
    weight_bytes: int
    flops_per_s: float
    linear_flops_per_s: float
    """The projections' rate: FP8 weights run on FP8 tensor cores, twice bfloat16's on Hopper."""
    bytes_per_s: float
    overhead_s: float


@dataclass(frozen=True)
class Roofline:
    model: ModelShape
    gpu: GPU
    tp: int = 1
    """Tensor-parallel degree: one worker spans this many GPUs."""
    rpc_s: float = 0.0005
    """From a request's arrival to its first step's start: the router's hops to the workers."""
    delivery_s: tuple[tuple[float, ...], ...] = ()
    """Streams' delivery patterns, one replayed per stream (none stated for the GPU model)."""
    hops_s: tuple[float, ...] = ()
    """Router hops sampled per request in place of `rpc_s` (none stated for the GPU model)."""
    hop_token_s: float = 0.0
    """What the hops add per prompt token (none stated for the GPU model)."""
    push_token_s: float = 0.0
    """Prefill worker time per pushed KV token: none on GPUs, where the copy engines or
    NCCL move it beside the compute (stated, not measured)."""

    def step_s(self, chunks: Sequence[tuple[int, int]], num_sampled: int | None = None) -> float:
        """One step: `chunks` holds (new tokens, tokens already computed) per scheduled request;
        `num_sampled` requests get logits (default: every chunk)."""
        if not chunks:
            return 0.0
        k = self._constants
        tokens = kv_tokens = 0
        attention = 0.0
        for n, ctx in chunks:  # the simulator's hottest loop: one pass, constants hoisted
            tokens += n
            kv_tokens += ctx + n
            attention += k.attention_flops * n * (ctx + (n + 1) / 2)
        sampled = len(chunks) if num_sampled is None else num_sampled
        compute_s = (k.linear_flops_per_token * tokens / k.linear_flops_per_s
                     + (k.head_flops_per_sample * sampled + attention) / k.flops_per_s)
        memory_s = (k.weight_bytes + kv_tokens * k.kv_bytes_per_token) / k.bytes_per_s
        return k.overhead_s + max(compute_s, memory_s) + self.allreduce_s(tokens)

    @cached_property
    def _constants(self) -> _StepConstants:
        m, g = self.model, self.gpu
        flops = self.tp * g.peak_flops * g.compute_efficiency
        return _StepConstants(2 * m.num_layers * m.layer_params, 2 * m.vocab * m.hidden,
                              4 * m.num_layers * m.num_heads * m.head_dim, m.kv_bytes_per_token, m.weight_bytes,
                              flops, flops * (2 if m.linear_bytes == 1 else 1),
                              self.tp * g.hbm_bytes_per_s * g.bandwidth_efficiency, g.step_overhead_s)

    def allreduce_s(self, tokens: int) -> float:
        """Two ring all-reduces of the step's activations per layer (attention and MLP outputs)."""
        if self.tp == 1:
            return 0.0
        m = self.model
        bytes_per = 2 * (self.tp - 1) / self.tp * tokens * m.hidden * m.dtype_bytes
        return 2 * m.num_layers * (bytes_per / self.gpu.nvlink_bytes_per_s + self.gpu.link_latency_s)

    def for_worker(self) -> Callable[[Sequence[tuple[int, int]], int | None], float]:
        """A worker's step costs the same whatever it ran before."""
        return self.step_s

    def transfer_s(self, num_tokens: int, same_node: bool) -> float:
        """Moving `num_tokens` tokens of KV from a prefill worker to a decode worker."""
        bw = self.gpu.nvlink_bytes_per_s if same_node else self.gpu.nic_bytes_per_s
        return self.gpu.link_latency_s + num_tokens * self.model.kv_bytes_per_token / bw

    def store_s(self, num_tokens: int) -> float:
        """Fetching `num_tokens` tokens of KV from the node's KV store (host memory) into the pool."""
        return self.rpc_s + num_tokens * self.model.kv_bytes_per_token / self.gpu.host_bytes_per_s

    def disk_s(self, num_tokens: int) -> float:
        """Reading `num_tokens` tokens of KV back from the node store's spill file (SSD)."""
        return num_tokens * self.model.kv_bytes_per_token / self.gpu.ssd_bytes_per_s

    def kv_capacity_tokens(self, memory_utilization: float = 0.9) -> int:
        """Tokens of KV one worker holds: its GPUs' memory share less the weights."""
        free = self.tp * self.gpu.memory_bytes * memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}")
        return int(free // self.model.kv_bytes_per_token)
