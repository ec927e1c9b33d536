"""A tensor-parallel worker's ranks: rank 0 leads (its engine schedules, samples, owns every
request and the block accounting), the others follow its steps.

    rank 0: LLMEngine --each step's plan (index lists, engine/model_runner.StepPlan)-->
                      `Leader.send`: msgpack over a broadcast in the ranks' process group
    rank r: `follow` --recv--> the same forward on its share of the model and its KV pool
                              (the same block ids: rank 0's accounting holds for every rank)

What the leader sends is the scheduled batch, never activations, as one of four typed
messages (`Op`, msgspec Structs: a follower decodes each against its type): a pool of a
given size (`PoolOp`, at start), a step's plan (`ForwardOp`), a block copy (`CopyOp`, a
request forked into choices), the end (`StopOp`). The one answer comes at the pool: each follower's pool in memory the worker can map (`gather`: a
shared-memory segment on CPU, from the allocator its `TensorRanks` gave it), so kvfabric
pushes and receives every rank's heads straight from and into the rank's own pool. A
follower keeps no requests; its pool's blocks are written by the forwards it runs in the
order they come. Followers join each step's collectives (two all-reduces a layer, the
logits' all-gather), so a rank that dies stalls the others within the step: the worker
process that owns them ends. Decode steps run eagerly under tensor parallelism (no decode
buffers or CUDA graphs yet).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec
import torch

from engine.config import EngineConfig
from engine.parallel.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


class PoolOp(msgspec.Struct, tag="pool"):
    """A pool of `num_blocks` (the ranks' block ids are rank 0's); `export`: each rank answers
    with how another process maps it (`Channel.gather`)."""

    num_blocks: int
    export: bool


class ForwardOp(msgspec.Struct, tag="forward"):
    """A step's plan as index lists (engine/model/model_runner.py `StepPlan`)."""

    lists: list[list[int]]
    groups: list[list[int]]
    prompt_index: list[int] | None = None


class CopyOp(msgspec.Struct, tag="copy"):
    """Block `src` copied into block `dst` (a prompt forked into choices)."""

    src: int
    dst: int


class StopOp(msgspec.Struct, tag="stop"):
    """The leader is done: the follower returns."""


Op = PoolOp | ForwardOp | CopyOp | StopOp
_decode_op = msgspec.msgpack.Decoder(Op).decode
_encode_op = msgspec.msgpack.Encoder().encode


class Channel:
    """Messages from rank 0 to every rank of the group: a length, then the msgpack bytes."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def send(self, op: Op) -> None:
        import torch.distributed as dist

        payload = _encode_op(op)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.long), 0, group=self.tp.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.tp.group)

    def recv(self) -> Op:
        """The leader's next message (msgspec.ValidationError: not one of `Op`)."""
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.long)
        dist.broadcast(size, 0, group=self.tp.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, 0, group=self.tp.group)
        return _decode_op(payload.numpy().tobytes())

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's map, in rank order (a collective: each rank calls it once)."""
        import torch.distributed as dist

        payload = msgpack.packb(mine)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.tp.world)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.long), group=self.tp.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.tp.world)]
        dist.all_gather(parts, padded, group=self.tp.group)
        return [msgpack.unpackb(p[:int(s.item())].numpy().tobytes()) for p, s in zip(parts, sizes, strict=True)]


def follow(config: EngineConfig, allocator: Callable[[], Any] | None = None) -> int:
    """A follower rank's life: its share of the model, then the leader's steps until it says
    stop. `allocator` makes each pool's allocator (one with an `export()`, a map another
    process maps the pool by: the worker's kvfabric); None: a pool of its own, exported as {}.
    Returns the number of forwards run."""
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir
    from engine.model.kv_pool import KVLayout, KVPool, kv_dtype
    from engine.model.decoder import DTYPES, LlamaForCausalLM
    from engine.model.model_config import ModelConfig
    from engine.model.model_runner import batch_tensors
    from engine.kernels.gpu_kernels import select_kernels

    tp = config.tensor_parallel
    assert tp is not None and tp.rank > 0, "follow() runs the ranks after the first"
    model_dir = resolve_model_dir(config.model_dir)
    full = ModelConfig.from_dir(model_dir, config.quantization)
    dtype = DTYPES[config.dtype]
    model = LlamaForCausalLM.load(str(model_dir), full, dtype, config.device, config.prepack_weights,
                                  select_kernels(config.device, config.native_kernels), tp)
    local = model.config
    layout = KVLayout(full.num_layers, config.cache.block_size, local.num_kv_heads, full.head_dim,
                      kv_dtype(config.cache.kv_cache_dtype, dtype))
    channel, pool, steps, memory = Channel(tp), None, 0, None
    while True:
        op = channel.recv()
        if isinstance(op, StopOp):
            return steps
        if isinstance(op, PoolOp):
            pool = None
            if memory is not None:
                memory.close()
            memory = allocator() if allocator is not None and op.export else None
            pool = KVPool(layout, op.num_blocks, config.device, memory, model.kv_scales)
            if op.export:
                channel.gather(memory.export() if memory is not None else {})
        elif isinstance(op, ForwardOp):
            assert pool is not None, "a step before the pool"
            ids, pos, meta, logits = batch_tensors(op.lists, [tuple(g) for g in op.groups], layout.block_size,
                                                   config.device)
            index = op.prompt_index
            prompt = (torch.tensor(index, dtype=torch.long, device=config.device), _drop) if index else None
            model.forward(ids, pos, pool, meta, logits, prompt)
            steps += 1
        else:
            assert pool is not None
            pool.tensor[op.dst].copy_(pool.tensor[op.src])


def _drop(offset: int, logits: torch.Tensor) -> None:
    """A follower's prompt logits: made (their all-gather is every rank's), not kept."""
