"""Turns a SchedulerOutput into tensors, runs the model, returns logits to sample.

SchedulerOutput (CPU, Python) -> ForwardBatch (device tensors) -> logits [num_sampled, vocab].
A request is sampled when this step computes its last known token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, CausalGroup, PagedGroup
from engine.kv_pool import KVPool
from engine.model import LlamaForCausalLM
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    sampled_requests: list[Request]


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    p = request.num_prompt_tokens
    if start >= p:
        return request.output_token_ids[start - p : end - p]
    return (request.prompt_token_ids + request.output_token_ids[: max(0, end - p)])[start:end]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, device: str) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.block_size = pool.layout.block_size

    def execute(self, out: SchedulerOutput) -> tuple[list[Request], torch.Tensor]:
        batch = self.prepare(out)
        logits = self.model.forward(
            batch.input_ids, batch.positions, self.pool, batch.meta, batch.logits_index
        )
        return batch.sampled_requests, logits

    def prepare(self, out: SchedulerOutput) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        logits_index: list[int] = []
        sampled: list[Request] = []
        decode: list[tuple[ScheduledRequest, int]] = []
        prefill: list[tuple[ScheduledRequest, int]] = []
        bs = self.block_size
        for s in out.scheduled:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            (decode if n == 1 else prefill).append((s, len(input_ids)))
            input_ids += _token_slice(r, start, start + n)
            pos = range(start, start + n)
            positions += pos
            slot_blocks += [r.block_ids[p // bs] for p in pos]
            slot_offsets += [p % bs for p in pos]
            if start + n == r.num_tokens:
                logits_index.append(len(input_ids) - 1)
                sampled.append(r)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_blocks=t(slot_blocks),
            slot_offsets=t(slot_offsets),
            groups=[self._group(g, len(input_ids)) for g in [decode, *([m] for m in prefill)] if g],
        )
        return ForwardBatch(t(input_ids), t(positions), meta, t(logits_index), sampled)

    def _group(self, members: list[tuple[ScheduledRequest, int]], num_tokens: int) -> CausalGroup | PagedGroup:
        dev = self.device
        if len(members) == 1 and members[0][0].request.num_computed_tokens == 0:
            (s, offset), = members
            return CausalGroup(torch.arange(offset, offset + s.num_new_tokens, device=dev))
        bs = self.block_size
        max_q = max(s.num_new_tokens for s, _ in members)
        ctx_lens = [s.request.num_computed_tokens + s.num_new_tokens for s, _ in members]
        max_blocks = -(-max(ctx_lens) // bs)
        token_index: list[int] = []
        padded_index: list[int] = []
        rows: list[int] = []
        key_counts: list[int] = []
        table: list[list[int]] = []
        for j, (s, offset) in enumerate(members):
            n, start = s.num_new_tokens, s.request.num_computed_tokens
            token_index += range(offset, offset + n)
            padded_index += range(j * max_q, j * max_q + n)
            rows += [j] * n
            key_counts += range(start + 1, start + n + 1)  # each token sees up to itself
            used = s.request.block_ids[: -(-ctx_lens[j] // bs)]
            table.append(used + [0] * (max_blocks - len(used)))
        return PagedGroup(
            token_index=torch.tensor(token_index, device=dev),
            padded_index=torch.tensor(padded_index, device=dev),
            batch=len(members),
            max_query_len=max_q,
            block_table=torch.tensor(table, dtype=torch.long, device=dev),
            num_keys=max_blocks * bs,
            rows=torch.tensor(rows, device=dev),
            ctx_lens=torch.tensor(key_counts, device=dev),
            in_order=max_q == 1 and token_index == list(range(num_tokens)),
        )
