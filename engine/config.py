"""Engine configuration: every field documented, units in names, validated on creation."""
from __future__ import annotations

import secrets

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from engine.checkpoints.quant_config import KV_CACHE_DTYPES, QUANTIZATIONS

if TYPE_CHECKING:
    from engine.parallel.tensor_parallel import TensorParallel

Role = Literal["both", "prefill", "decode"]
DType = Literal["float32", "bfloat16", "float16"]

SHORT_QUERY_MAX_LEN = 8
"""Paged attention groups whose longest query is at most this many tokens (decodes, and
speculative verification: a request's last token and its proposals) take the native kernel
when there is one, else `_all_pairs_attention` in 16-bit dtypes (engine/model/attention.py). Here,
torch-free, so the simulator's CPU fit prices the same split."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Blocks in the pool; None sizes the pool from `kv_cache_bytes`."""
    kv_cache_bytes: int | None = None
    """Pool size in bytes when `num_blocks` is None. None: on a GPU, sized from memory
    (`gpu_memory_utilization`, see engine/model/kv_sizing.py); on CPU 256 MiB."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory this engine may use in all (weights, activations, KV pool)."""
    enable_prefix_caching: bool = True
    protected_fraction: float = 0.5
    """Share of the pool that cached blocks hit again after they were stored (shared
    prefixes) may keep out of reach of one-off blocks (segmented LRU); 0 is plain LRU."""
    cluster_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    """Key of the block hashes; one cluster's workers and routers share it, nobody else knows
    it. By default a random one: a standalone engine's hashes never leave its process."""
    kv_cache_dtype: str = "auto"
    """"auto": the pool holds K and V in the model's dtype; "fp8": in e4m3, one byte each,
    divided by a per-layer scale for K and one for V (the checkpoint's `k_scale` / `v_scale`,
    else 1.0) and multiplied back as attention reads them (engine/model/kv_pool.py)."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0.0 <= self.protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1), got {self.protected_fraction}")


STEP_TOKENS = 2048
"""A step's token budget where none is set, on CPUs and on GPUs under `LARGE_GPU_BYTES`."""
LARGE_GPU_STEP_TOKENS = 8192
LARGE_GPU_BYTES = 70 * 2**30
"""From this much device memory (an H100, an H200) a step's budget is `LARGE_GPU_STEP_TOKENS`,
as vLLM's server sets it: an 8,192-token prompt is one chunk, whose causal attention is one
fused call (28 ms over Llama-3-8B's 32 layers on an H100) where 2,048-token chunks paid four
steps and their chunks' attention over the context."""


def step_tokens(device_total_bytes: int | None) -> int:
    """The default token budget of one step on a device of this much memory (None: a CPU)."""
    return LARGE_GPU_STEP_TOKENS if (device_total_bytes or 0) >= LARGE_GPU_BYTES else STEP_TOKENS


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Token budget of one step, shared by decode tokens and prefill chunks. None: by the
    device (`step_tokens`: 8,192 on GPUs of 70 GiB or more, else 2,048), set when the engine
    starts (`resolved`)."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    enable_chunked_prefill: bool = True
    """Off: a prompt is computed in one step or waits."""
    aging_interval_s: float = 10.0
    """Every this many seconds of waiting raises a request's priority by one class."""
    fair_burst_tokens: int = 32768
    """Within a class, a tenant with nothing queued may start this many tokens of work (times
    its weight) ahead of a backlogged tenant's queue, so a light tenant's short burst is not
    interleaved with a heavy tenant's backlog (`engine.core.fair_order`); 0: strict start-time
    fair queuing."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.fair_burst_tokens < 0:
            raise ValueError(f"fair_burst_tokens must be at least 0, got {self.fair_burst_tokens}")
        if self.aging_interval_s <= 0:
            raise ValueError(f"aging_interval_s must be positive, got {self.aging_interval_s}")

    def resolved(self, device_total_bytes: int | None) -> SchedulerConfig:
        """This config with its step budget set: its own, else the device's (`step_tokens`)."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=step_tokens(device_total_bytes))


SpecMethod = Literal["off", "ngram", "draft"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on a decode-capable engine (engine/spec/spec_decode.py)."""

    method: SpecMethod = "off"
    """ngram: prompt lookup (no model); draft: a smaller checkpoint (`draft_model_dir`) with
    the same tokenizer; off: one token per request per step."""
    num_speculative_tokens: int = 4
    """The most tokens proposed for one request in one step."""
    draft_model_dir: str | None = None
    """The draft checkpoint, for method draft."""
    ngram_max: int = 4
    ngram_min: int = 2
    """Prompt lookup matches the last n tokens, longest n first, down to `ngram_min`."""
    max_batched_tokens: int = 32
    """Load-aware: a step's decode tokens plus its proposals stay within this many tokens;
    as the batch grows each request gets fewer (at this many requests decoding, none)."""
    min_acceptance: float = 0.3
    """A request whose recent proposals are accepted less than this often stops proposing
    for a while (`backoff_steps`, doubling each time it fails again)."""
    backoff_steps: int = 16
    priced: bool = True
    """Proposals priced by the step's measured cost (engine/spec/spec_decode.py: made where their
    expected kept tokens pay for the rows and the step they add); False: every decoding
    request proposes its share of `max_batched_tokens`, as many as its acceptance says."""

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative method must be off, ngram or draft, got {self.method!r}")
        if self.method == "draft" and not self.draft_model_dir:
            raise ValueError("speculative method draft needs draft_model_dir (draft:DIR)")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.max_batched_tokens < 2:
            raise ValueError(f"speculative max_batched_tokens must be at least 2, got {self.max_batched_tokens}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.backoff_steps < 1:
            raise ValueError(f"backoff_steps must be at least 1, got {self.backoff_steps}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class StepFloor:
    """The least time one engine step takes: `base_s + token_s`·(tokens computed) `+ seq_s`·
    (requests scheduled); a step done sooner sleeps the rest. It makes a CPU worker stand for
    an accelerator of that speed whose compute is its own: on a machine of two cores, more
    such workers are more capacity, as more GPUs are. For measuring the control plane
    (autoscaling, the simulator's validation: benchmarks/sim/sim_validate.py), never for serving."""

    base_s: float = 0.0
    token_s: float = 0.0
    seq_s: float = 0.0

    def __post_init__(self) -> None:
        if not all(0.0 <= x < 60.0 for x in (self.base_s, self.token_s, self.seq_s)):
            raise ValueError(f"step floor terms must be seconds in [0, 60), got {self}")

    def seconds(self, num_tokens: int, num_seqs: int) -> float:
        return self.base_s + self.token_s * num_tokens + self.seq_s * num_seqs


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    """Local Hugging Face-format checkpoint directory, or a GGUF file (or a directory holding
    one), converted once into the cache (`engine.checkpoints.gguf_checkpoint`)."""
    dtype: DType = "float32"
    device: str = "cpu"
    quantization: str | None = None
    """"fp8": a 16/32-bit checkpoint's projections quantized to FP8 as they load (per-channel
    weight scales, per-token input scales; engine/model/fp8.py); None: as the checkpoint is (an FP8
    checkpoint is served in FP8 either way)."""
    role: Role = "both"
    """prefill: stop after the first token and hand blocks off; decode: accept remote KV."""
    max_model_len: int | None = None
    """Context limit in tokens; None uses the model's max_position_embeddings."""
    model_id: str | None = None
    """Name used in block hashes; None uses the model directory's name."""
    seed: int = 0
    """Seeds the sampler for requests without their own seed."""
    prepack_weights: bool = True
    """On CPU, lay linear weights out once for oneDNN (see engine/model/linear.py); False keeps
    plain tensors and `F.linear`. Ignored on other devices."""
    native_kernels: bool = True
    """On CPU, C kernels (engine/kernels/native.py, compiled at first use with the C compiler on
    PATH) run decode attention over the paged pool, add + RMSNorm, SwiGLU, rotary + KV
    store, and bfloat16 matmuls where the CPU has AVX-512 BF16; False, or no compiler,
    keeps the torch forms (engine/model/attention.py, oneDNN linears). On GPUs, decode attention
    runs the Triton kernel (engine/kernels/triton_attention.py) where Triton imports; False keeps
    the torch forms there too."""
    decode_graphs: bool = True
    """Steps of decodes alone run through persistent buffers (engine/model/decode_graphs.py): on
    GPUs with the Triton kernels, one CUDA graph per batch-size bucket (1, 2, 4, ... up to
    `max_num_seqs`), captured at start; on CPU the same buffers, eagerly. False: every step
    builds its tensors and runs eagerly (vLLM's `enforce_eager`)."""
    overlap: bool | None = None
    """Decode steps overlapped with the host's work (engine/model/overlap.py): the next step is
    launched, its input tokens still on the device, while the host lands the one before;
    a request that stops has one row computed for nothing. None: on GPUs, off on CPU (where
    nothing runs asynchronously). Off beside speculative decoding and a step floor."""
    detokenize: bool = True
    """Turn output tokens into text (and honour stop strings). Workers serving a router
    turn it off: the router detokenizes once, for every worker a request ran on."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    step_floor: StepFloor | None = None
    """Hold every step to at least this long (`StepFloor`); None: steps take what they take."""
    tensor_parallel: TensorParallel | None = None
    """This process's rank of a model split across processes (engine/parallel/tensor_parallel.py; its
    process group set up by the caller); None: the whole model in this process."""

    @property
    def overlaps(self) -> bool:
        """Decode steps overlapped with the host's work (`overlap`, by default on GPUs); never
        beside speculation (its proposals need the last token) or a step floor."""
        on = self.overlap if self.overlap is not None else self.device != "cpu"
        return on and not (self.speculative.enabled and self.role != "prefill") and self.step_floor is None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.tensor_parallel is not None and self.speculative.enabled:
            raise ValueError("speculative decoding does not run under tensor parallelism yet")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
