"""n choices from one prompt: computed once, forked at its first token.

A request with `n` > 1 computes its prompt as any other. In the step that draws its first
token (or, on a decode worker, when the prompt's KV and first tokens arrive), it forks into
n sequences: choice 0 is the request itself, choice i a new request `choice_id(id, i)` with
the same prompt, drawing as a request of seed `seed + i` would (unseeded: from the engine's
stream). The children share the prompt's full blocks (a holder more each, freed as any
request frees them) and copy the partial last block, which each writes its own tokens into
(`KVCacheManager.fork`; the device copy follows the step that wrote it, in stream order).
A child the pool has no block for is preempted at birth: it recomputes its prompt and first
token later, as a preempted request does, and so draws the same tokens.

A prefill worker does not fork: it draws every choice's first token (`first_tokens`) and the
decode worker forks with them, so the KV is pushed once.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Mapping, Sequence

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Logprob, Request, RequestStatus, SamplingParams
from engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.types import InvalidRequestError, RequestId, choice_id, parent_of


def check_id(request_id: str, n: int, in_use: Container[str]) -> None:
    """Raises InvalidRequestError unless `request_id` and the ids of its `n` choices are all
    free: a request may not take a choice's form of id (`X#1`, which another request's fork
    would overwrite), nor fork into ids other requests hold."""
    if parent_of(request_id)[1] != 0:
        raise InvalidRequestError(f"request id {request_id!r} has the form of a choice's id (ID#N); use another")
    taken = [rid for rid in (choice_id(request_id, i) for i in range(n)) if rid in in_use]
    if taken:
        raise InvalidRequestError(f"request id {taken[0]!r} is already in use")


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: one sequence, its own seed stream."""
    seed = None if params.seed is None else (params.seed + index) % (1 << 64)
    return dataclasses.replace(params, n=1, seed=seed)


def children(parent: Request) -> list[Request]:
    """Choices 1..n-1 of `parent`, in its state (nothing computed of theirs yet, no blocks)."""
    out = []
    for i in range(1, parent.params.n):
        out.append(Request(choice_id(parent.request_id, i), list(parent.prompt_token_ids),
                           choice_params(parent.params, i), arrival_time=parent.arrival_time,
                           priority=parent.priority, tenant=parent.tenant, tenant_weight=parent.tenant_weight,
                           eos_token_ids=parent.eos_token_ids, output_token_ids=list(parent.output_token_ids),
                           num_computed_tokens=parent.num_computed_tokens, num_cached_tokens=parent.num_cached_tokens,
                           choice_index=i, arrival_seq=parent.arrival_seq, fair_tag=parent.fair_tag,
                           status=RequestStatus.RUNNING))
    return out


def first_rows(requests: list[Request]) -> list[int]:
    """The rows of requests that draw their first token now and have n > 1 choices."""
    return [i for i, r in enumerate(requests) if r.params.n > 1 and not r.output_token_ids and r.choice_index == 0]


def repeat_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits` with `rows` repeated at the end, in order (the children draw from their parent's row)."""
    return torch.cat([logits, logits[rows]]) if rows else logits


class Forks:
    """Forks an engine's requests of n choices: in the step that draws their first token, or
    (a decode worker) as their KV and first tokens land. It touches the engine through what
    it is given: the scheduler and KV cache manager, how a block's KV is copied (every
    tensor-parallel rank's heads), and how a request starts (its constraint, its detokenizer)."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, copy_block: Callable[[int, int], None],
                 start: Callable[[Request], None], shadows: bool) -> None:
        """`shadows`: a prefill worker's choices are drawn, not run (`in_step`)."""
        self.scheduler, self.kv, self.copy_block, self.start, self.shadows = scheduler, kv, copy_block, start, shadows

    def in_step(self, out: SchedulerOutput, requests: list[Request], logits: torch.Tensor, rows: list[int]
                ) -> tuple[list[Request], torch.Tensor, list[Request]]:
        """Each request at `rows` forks into its n choices, which draw from its logits row. On a
        prefill worker the other choices are shadows, drawn and not run (returned last); else
        they join the step as running requests sharing the parent's blocks."""
        steps = {s.request.request_id: s for s in out.scheduled}
        drawn: list[Request] = []  # the children this step samples, in order
        parent_rows: list[int] = []  # and the row each draws from
        shadows: list[Request] = []
        for row in rows:
            parent = requests[row]
            for child in children(parent):
                if self.shadows:
                    shadows.append(child)
                else:
                    s = steps[parent.request_id]
                    copy = self.kv.fork(parent, child, parent.num_computed_tokens + s.num_new_tokens)
                    self._admit(child, copy, running=True)
                    if copy is False:
                        continue  # preempted: it draws when it recomputes
                    out.scheduled.append(ScheduledRequest(child, s.num_new_tokens))
                drawn.append(child)
                parent_rows.append(row)
        return [*requests, *drawn], repeat_rows(logits, parent_rows), shadows

    @staticmethod
    def drawn(requests: list[Request], shadows: list[Request],
              sampled: Mapping[RequestId, tuple[int, float | Logprob | None]]) -> None:
        """A prefill worker's requests of n choices keep their other choices' first tokens."""
        for r in requests:
            if r.choice_index == 0 and r.params.n > 1 and not r.output_token_ids:
                r.choice_tokens = [sampled[s.request_id] for s in shadows if parent_of(s.request_id)[0] == r.request_id]

    def landed(self, request: Request, first_token_id: int, choice_tokens: Sequence[int]) -> list[Request]:
        """A decode worker's request whose prompt's KV and first tokens arrived: it forks into
        its choices, each with its first token; those that have it (a choice without a block
        for its copy recomputes its prompt and first token, the same if seeded)."""
        if len(choice_tokens) != request.params.n - 1:
            raise InvalidRequestError(f"request {request.request_id} has {request.params.n} choices; "
                                      f"{len(choice_tokens) + 1} first tokens came")
        kids = children(request)
        copies = [self.kv.fork(request, child, request.num_prompt_tokens) for child in kids]
        self.scheduler.remote_kv_ready(request.request_id, first_token_id)
        got = [request]
        for r, token, copy in zip(kids, choice_tokens, copies, strict=True):
            self._admit(r, copy, running=False)
            if copy is not False:
                self.scheduler.landed(r, token)
                got.append(r)
        return got

    def _admit(self, child: Request, copy: tuple[int, int] | None | bool, running: bool) -> None:
        """A forked choice into the scheduler: with its blocks (running in this step, or left
        for `Scheduler.landed` to queue), or, without a block for its copy, preempted to
        recompute (it draws the same tokens then, if seeded)."""
        if isinstance(copy, tuple):
            self.copy_block(*copy)
        if copy is False:
            child.status, child.num_computed_tokens, child.output_token_ids = RequestStatus.PREEMPTED, 0, []
            self.scheduler.waiting.append(child)
        elif running:
            self.scheduler.running.append(child)
        self.scheduler.requests[child.request_id] = child
        self.start(child)
