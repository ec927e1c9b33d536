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

import torch

from engine.request import Request, RequestStatus, SamplingParams
from engine.types import RequestId


def choice_id(request_id: str, index: int) -> RequestId:
    """The id of choice `index` of a request (0: the request's own)."""
    return RequestId(request_id if index == 0 else f"{request_id}#{index}")


def parent_of(request_id: str) -> tuple[str, int]:
    """(the request's id, the choice) of a choice's id; (the id, 0) for a request's own."""
    parent, sep, index = request_id.rpartition("#")
    return (parent, int(index)) if sep and index.isdigit() else (request_id, 0)


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


def repeat_rows(logits: torch.Tensor, rows: list[int], counts: list[int]) -> torch.Tensor:
    """`logits` with each of `rows` repeated `counts` times more at the end (the children draw
    from their parent's row)."""
    extra = [logits[r:r + 1].expand(c, -1) for r, c in zip(rows, counts, strict=True)]
    return torch.cat([logits, *extra]) if extra else logits
