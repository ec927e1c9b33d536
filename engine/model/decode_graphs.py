"""Decode steps through persistent buffers: one CUDA graph per batch-size bucket on GPUs, the
same buffers run eagerly on CPU.

A step whose every request decodes one token (no proposals to verify, each sampled) does not
build index lists and tensors per step (engine/model/model_runner.py `prepare`): its inputs go
into buffers made once, sized for the largest bucket (`max_num_seqs` requests):

    host (pinned on GPUs, two in turn)  device (fixed addresses, captured by the graphs)
    small [6, max_seqs] int64  --->  token ids, positions, slot blocks, slot offsets, ctx lens,
                                     token sources
    table [max_seqs, width] int64 -> block table, `width` = blocks of the longest context

one non-blocking copy each (the table's used columns only; what lies past a row's context is
never read). A row's input token is its request's own, or, with a source j >= 0, row j of
the previous step's sampled tokens, still on the device (`sampled`): the overlapped decode
(engine/model/overlap.py) launches a step before the host has seen the tokens of the one before.
On GPUs a batch of n runs the graph of the smallest bucket >= n, captured at
start (largest first, sharing one memory pool); rows n.. of the bucket are padding: slot
block -1 (the rotary kernel stores nothing), context 0 (attention writes zeros), and their
logits are dropped. A batch over the largest bucket, a step with prefill chunks or
proposals, or a GPU without the Triton kernels runs eagerly (`ModelRunner.prepare`). The
graphs read the block table at its full width, so the Triton attention's splits are fixed
per bucket (engine/kernels/gpu_kernels.py) and the longest context fits any replay.

On CPU the same buffers are filled the same way and the model runs on their first n rows
(no graph to replay, so nothing is padded), with the table cut to the columns in use: the
path every CPU test takes, so the GPU's differs only by the padding and the replay.
`Graph` is what a bucket is captured into: `CudaGraph` on GPUs; the tests capture into
`EagerGraph` (replay calls the function) to run the padded buckets on CPU as well.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from engine.model.attention import AttentionMetadata, PagedGroup
from engine.config import EngineConfig
from engine.kernels.gpu_kernels import GpuKernels
from engine.model.kv_pool import KVPool
from engine.model.decoder import LlamaForCausalLM
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

_IDS, _POSITIONS, _BLOCKS, _OFFSETS, _CTX, _SRC = range(6)
_ROWS = 6

Row = tuple[Request, int, int]
"""A step's row: the request, the position it computes, and where its input token is: -1,
the request's own tokens; else the row of the previous step's sampled tokens (`sampled`) that
holds it, a token not yet on the host (engine/model/overlap.py)."""


class Graph(Protocol):
    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph, its memory from a pool every bucket shares."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Replays by calling the captured function: the bucketed path, run on CPU."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        assert self.fn is not None
        self.fn()


def decode_buffers(config: EngineConfig, model: LlamaForCausalLM, pool: KVPool, max_model_len: int) -> DecodeGraphs | None:
    """An engine's decode buffers: on CPU, and on GPUs whose kernels let a graph read the
    block table in place (the Triton attention; the torch forms gather by it); none for a
    prefill worker, which never decodes, or with `config.decode_graphs` off."""
    if not config.decode_graphs or config.role == "prefill":
        return None
    if config.device != "cpu" and not isinstance(model.kernels, GpuKernels):
        return None
    return DecodeGraphs(model, pool, config.device, config.scheduler.max_num_seqs, max_model_len)


def capture_graphs(decode: DecodeGraphs | None, device: str, graphs: Callable[[], Graph] | None) -> None:
    """Each decode bucket into a graph: `graphs` (a test's), else CUDA graphs sharing one
    memory pool wherever there are decode buffers on a GPU."""
    if decode is None or (graphs is None and device == "cpu"):
        return
    if graphs is None:
        pool = torch.cuda.graph_pool_handle()
        graphs = lambda: CudaGraph(pool)  # noqa: E731
    decode.capture(graphs)


def buckets_for(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below `max_num_seqs`, then `max_num_seqs` itself."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return [*out, max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: str, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.layout.block_size
        self.max_seqs = max_num_seqs
        self.width = -(-max_model_len // self.block_size)
        self.buckets = buckets_for(max_num_seqs)
        pinned = torch.device(device).type == "cuda"
        self._host = [_HostBuffers(max_num_seqs, self.width, pinned) for _ in range(2 if pinned else 1)]
        """Pinned host buffers on GPUs, two in turn: a step's inputs are written into one while
        the copy of the previous step's, still queued behind the step before it, reads the other."""
        self._turn = 0
        self.small = self._host[0].small.to(device) if pinned else self._host[0].small
        self.table = self._host[0].table.to(device) if pinned else self._host[0].table
        self.sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        """The last step's sampled tokens, on the device (`remember`): a row whose source is j
        takes its input token from here."""
        self.index = torch.arange(max_num_seqs, device=device)
        self.graphs: dict[int, Graph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0

    # -- start -----------------------------------------------------------------------
    def capture(self, make_graph: Callable[[], Graph]) -> None:
        """Captures every bucket, largest first, each warmed by one eager run (Triton compiles
        there, never inside a capture)."""
        began = time.perf_counter()
        self._host[0].pad(0, self.max_seqs)
        self._upload(self._host[0], self.max_seqs, self.width)
        for b in reversed(self.buckets):
            self._forward(b, self.width)  # warm
            graph = make_graph()
            graph.capture(lambda b=b: self._capture(b))
            self.graphs[b] = graph
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - began
        logger.info("captured decode graphs for %d batch sizes (%s) in %.1f s", len(self.buckets),
                    ",".join(map(str, self.buckets)), self.capture_s)

    # -- a step ----------------------------------------------------------------------
    def takes(self, scheduled: list[ScheduledRequest]) -> bool:
        """Every request decodes one known token, sampled, and the batch fits the buffers."""
        if not 0 < len(scheduled) <= self.max_seqs:
            return False
        return all(s.num_new_tokens == 1 and not s.num_spec_tokens
                   and s.request.num_computed_tokens + 1 == s.request.num_tokens for s in scheduled)

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[list[Request], torch.Tensor]:
        """The step's float32 logits [n, vocab], a row per scheduled request in order."""
        rows = [(s.request, s.request.num_computed_tokens, -1) for s in scheduled]
        return [s.request for s in scheduled], self.launch(rows)

    def launch(self, rows: list[Row]) -> torch.Tensor:
        """Runs the rows (a graph replay on GPUs: nothing waits for the device); their logits."""
        n = len(rows)
        host = self._host[self._turn]
        self._turn = (self._turn + 1) % len(self._host)
        cols = host.fill(rows, self.block_size)
        bucket = next((b for b in self.buckets if b >= n), None) if self.graphs else None
        if bucket is None:  # eager: the model on the first n rows
            self._upload(host, n, cols)
            return self._forward(n, cols)
        host.pad(n, bucket)
        self._upload(host, bucket, cols)
        self.graphs[bucket].replay()
        return self.logits[bucket][:n]

    def remember(self, tokens: torch.Tensor) -> None:
        """This step's sampled tokens [n], where the next step's rows can take them."""
        self.sampled[: tokens.numel()].copy_(tokens, non_blocking=True)

    def _upload(self, host: _HostBuffers, rows: int, cols: int) -> None:
        """The small buffer whole (6 x max_num_seqs values: one contiguous copy); the table's
        rows and columns in use (a strided copy, which torch stages through a contiguous one)."""
        if self.small is host.small:
            return
        self.small.copy_(host.small, non_blocking=True)
        self.table[:rows, :cols].copy_(host.table[:rows, :cols], non_blocking=True)

    def _capture(self, bucket: int) -> None:
        """A bucket's step at the table's full width; its logits, at a fixed address, are the graph's output."""
        self.logits[bucket] = self._forward(bucket, self.width)

    def _forward(self, rows: int, cols: int) -> torch.Tensor:
        """float32 logits of the model over the buffers' first `rows` rows and `cols` table columns."""
        small, index = self.small[:, :rows], self.index[:rows]
        table = self.table[:rows, :cols]
        src = small[_SRC]
        ids = torch.where(src >= 0, self.sampled.gather(0, src.clamp(min=0)), small[_IDS])
        group = PagedGroup(token_index=index, padded_index=index, batch=rows, max_query_len=1,
                           block_table=table if table.is_contiguous() else table.contiguous(),
                           num_keys=cols * self.block_size, rows=index, ctx_lens=small[_CTX], in_order=True)
        meta = AttentionMetadata(slot_blocks=small[_BLOCKS], slot_offsets=small[_OFFSETS], groups=[group])
        return self.model.forward(ids, small[_POSITIONS], self.pool, meta, index)


class _HostBuffers:
    """A step's inputs on the host: `small` [6, max_seqs] (token ids, positions, slot blocks,
    slot offsets, context lengths, token sources) and the block table [max_seqs, width]."""

    def __init__(self, max_seqs: int, width: int, pinned: bool) -> None:
        self.small = torch.zeros(_ROWS, max_seqs, dtype=torch.long, pin_memory=pinned)
        self.table = torch.zeros(max_seqs, width, dtype=torch.long, pin_memory=pinned)
        self.small[_SRC] = -1
        self._np_small = self.small.numpy()
        self._np_table = self.table.numpy()
        self._row_owner: list[tuple[str, int, int]] = [("", -1, 0)] * max_seqs
        """Per table row: (request id, its preemptions, columns written): a request that
        keeps its row from step to step gets only its new blocks written."""

    def fill(self, rows: list[Row], block_size: int) -> int:
        """The rows' inputs; returns the table columns in use."""
        small, table, bs = self._np_small, self._np_table, block_size
        cols = 1
        for i, (r, p, src) in enumerate(rows):
            if src < 0:
                small[_IDS, i] = r.prompt_token_ids[p] if p < r.num_prompt_tokens else \
                    r.output_token_ids[p - r.num_prompt_tokens]
            small[_SRC, i] = src
            small[_POSITIONS, i] = p
            small[_BLOCKS, i] = r.block_ids[p // bs]
            small[_OFFSETS, i] = p % bs
            small[_CTX, i] = p + 1
            used = p // bs + 1
            rid, preempted, written = self._row_owner[i]
            if rid != r.request_id or preempted != r.num_preemptions or written > used:
                written = 0
            if written < used:
                table[i, written:used] = r.block_ids[written:used]
                self._row_owner[i] = (r.request_id, r.num_preemptions, used)
            cols = max(cols, used)
        return cols

    def pad(self, start: int, end: int) -> None:
        """Rows start..end of a bucket: no slot to store into, no keys to attend."""
        small = self._np_small
        small[_IDS, start:end] = 0
        small[_POSITIONS, start:end] = 0
        small[_BLOCKS, start:end] = -1
        small[_OFFSETS, start:end] = 0
        small[_CTX, start:end] = 0
        small[_SRC, start:end] = -1
