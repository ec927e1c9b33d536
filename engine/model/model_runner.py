"""Turns a SchedulerOutput into tensors, runs the model, returns logits to sample.

SchedulerOutput (CPU, Python) -> ForwardBatch (device tensors) -> logits [num_rows, vocab];
a step of decodes alone goes through `DecodeGraphs` instead (persistent buffers, CUDA graphs).
A request is sampled when this step computes its last known token: one row, or, when it
verifies k proposed tokens (computed after it in the same chunk), 1 + k rows in a row.
Decodes form one attention group, speculating requests another, each prefill chunk its own.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.attention import AttentionMetadata, CausalGroup, PagedGroup
from engine.model.decode_graphs import DecodeGraphs
from engine.model.kv_pool import KVPool
from engine.model.decoder import LlamaForCausalLM
from engine.model.prompt_logprobs import PromptRows
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.parallel.tp_followers import ForwardOp


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    sampled_requests: list[Request]
    prompt_rows: PromptRows | None = None
    """Prompt positions whose log-probabilities some request wants."""


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    p = request.num_prompt_tokens
    if start >= p:
        return request.output_token_ids[start - p : end - p]
    return (request.prompt_token_ids + request.output_token_ids[: max(0, end - p)])[start:end]


def _input_tokens(s: ScheduledRequest) -> list[int]:
    r, start = s.request, s.request.num_computed_tokens
    known = _token_slice(r, start, start + s.num_new_tokens - s.num_spec_tokens)
    return known + r.spec_token_ids[: s.num_spec_tokens]


@dataclass
class StepPlan:
    """A step's model inputs as index lists: what `batch` turns into tensors, and what a
    tensor-parallel leader sends its followers (`wire`) so they run the same forward."""

    lists: list[list[int]]
    """input ids, positions, slot blocks, slot offsets, logits index, then each group's lists."""
    groups: list[tuple[int, ...]]
    """Per attention group: () for a first chunk's causal group, else a paged group's
    (batch, max_query_len, max_blocks, longest context, in order)."""
    sampled: list[Request]
    prompt_rows: PromptRows | None = None

    def wire(self) -> ForwardOp:
        rows = self.prompt_rows
        return ForwardOp(self.lists, [list(g) for g in self.groups], rows.index if rows is not None else None)


def batch_tensors(lists: list[list[int]], groups: list[tuple[int, ...]], block_size: int, device: str
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input ids, positions, attention metadata, logits index) of a step's index lists: one
    copy to the device, then views."""
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long, device=device)
    views = iter(flat.split([len(x) for x in lists]))
    ids, pos, blocks, offsets, logits = (next(views) for _ in range(5))
    made: list[CausalGroup | PagedGroup] = []
    for g in groups:
        if not g:
            made.append(CausalGroup(next(views)))
            continue
        batch, max_q, max_blocks, longest, in_order = g
        token_index, padded_index, table, rows, ctx_lens = (next(views) for _ in range(5))
        made.append(PagedGroup(token_index=token_index, padded_index=padded_index, batch=batch, max_query_len=max_q,
                               block_table=table.view(batch, max_blocks), num_keys=max_blocks * block_size, rows=rows,
                               ctx_lens=ctx_lens, in_order=bool(in_order), max_context_len=longest))
    return ids, pos, AttentionMetadata(slot_blocks=blocks, slot_offsets=offsets, groups=made), logits


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: str, decode: DecodeGraphs | None = None,
                 followers: Callable[[ForwardOp], None] | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.layout.block_size
        self.decode = decode
        """Pure decode steps through persistent buffers and, on GPUs, CUDA graphs (engine/model/decode_graphs.py)."""
        self.followers = followers
        """A tensor-parallel leader's: tells the other ranks each step's plan (engine/parallel/tp_followers.py)."""

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        if self.decode is not None and self.decode.takes(out.scheduled):
            return self.decode.run(out.scheduled)
        plan = self.plan(out)
        if self.followers is not None:
            self.followers(plan.wire())
        batch = self.batch(plan)
        rows = batch.prompt_rows
        prompt = (torch.tensor(rows.index, dtype=torch.long, device=self.device), rows.take) if rows else None
        logits = self.model.forward(
            batch.input_ids, batch.positions, self.pool, batch.meta, batch.logits_index, prompt
        )
        return batch.sampled_requests, logits

    def prepare(self, out: SchedulerOutput) -> ForwardBatch:
        return self.batch(self.plan(out))

    def batch(self, plan: StepPlan) -> ForwardBatch:
        ids, pos, meta, logits = batch_tensors(plan.lists, plan.groups, self.block_size, self.device)
        return ForwardBatch(ids, pos, meta, logits, plan.sampled, plan.prompt_rows)

    def plan(self, out: SchedulerOutput) -> StepPlan:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        logits_index: list[int] = []
        sampled: list[Request] = []
        decode: list[tuple[ScheduledRequest, int]] = []
        spec: list[tuple[ScheduledRequest, int]] = []
        prefill: list[tuple[ScheduledRequest, int]] = []
        bs = self.block_size
        prompt_rows = PromptRows()
        for s in out.scheduled:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            if r.params.prompt_logprobs is not None and start < r.num_prompt_tokens - 1:
                prompt_rows.add(r, start, n, len(input_ids))
            (spec if s.num_spec_tokens else decode if n == 1 else prefill).append((s, len(input_ids)))
            input_ids += _input_tokens(s)
            positions += range(start, start + n)
            slot_blocks += (r.block_ids[p // bs] for p in range(start, start + n))
            slot_offsets += (p % bs for p in range(start, start + n))
            if start + n - s.num_spec_tokens == r.num_tokens:
                logits_index += range(len(input_ids) - 1 - s.num_spec_tokens, len(input_ids))
                sampled.append(r)
        groups = [self._group(g, len(input_ids)) for g in [decode, spec, *([m] for m in prefill)] if g]
        lists = [input_ids, positions, slot_blocks, slot_offsets, logits_index, *(x for g in groups for x in g[0])]
        return StepPlan(lists, [recipe for _, recipe in groups], sampled, prompt_rows if prompt_rows.index else None)

    def _group(self, members: list[tuple[ScheduledRequest, int]], num_tokens: int) -> tuple[
        list[list[int]], tuple[int, ...]
    ]:
        """A group's index lists and its recipe (`StepPlan.groups`)."""
        if len(members) == 1 and members[0][0].request.num_computed_tokens == 0:
            (s, offset), = members
            return [list(range(offset, offset + s.num_new_tokens))], ()
        bs = self.block_size
        max_q = max(s.num_new_tokens for s, _ in members)
        ctx_lens = [s.request.num_computed_tokens + s.num_new_tokens for s, _ in members]
        longest = max(ctx_lens)
        max_blocks = -(-longest // bs)
        token_index: list[int] = []
        padded_index: list[int] = []
        rows: list[int] = []
        key_counts: list[int] = []
        table: list[int] = []
        for j, (s, offset) in enumerate(members):
            n, start = s.num_new_tokens, s.request.num_computed_tokens
            token_index += range(offset, offset + n)
            padded_index += range(j * max_q, j * max_q + n)
            rows += [j] * n
            key_counts += range(start + 1, start + n + 1)  # each token sees up to itself
            used = s.request.block_ids[: -(-ctx_lens[j] // bs)]
            table += used
            table += [0] * (max_blocks - len(used))
        in_order = max_q == 1 and token_index == list(range(num_tokens))
        return [token_index, padded_index, table, rows, key_counts], (len(members), max_q, max_blocks, longest,
                                                                      int(in_order))
