"""Identifiers and the engine's error hierarchy (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

RequestId = NewType("RequestId", str)
BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)



def choice_id(request_id: str, index: int) -> RequestId:
    """The id of choice `index` of a request (0: the request's own; engine/core/forks.py)."""
    return RequestId(request_id if index == 0 else f"{request_id}#{index}")


def parent_of(request_id: str) -> tuple[str, int]:
    """(the request's id, the choice) of a choice's id; (the id, 0) for a request's own."""
    parent, sep, index = request_id.rpartition("#")
    return (parent, int(index)) if sep and index.isdigit() else (request_id, 0)

class EngineError(Exception):
    """Base class of errors raised by the engine."""


class UnsupportedModelError(EngineError):
    """The checkpoint uses an architecture or config field the engine cannot run."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses: the message says which field and why."""


class EngineStopped(EngineError, RuntimeError):
    """The engine's loop has stopped (shutdown, or it died): calls into it are refused."""


class InvariantError(EngineError, AssertionError):
    """Block accounting is broken: a bug, never a capacity shortage."""


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds at one moment (`LLMEngine.load()`), for heartbeats."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    """Evictable: free for new requests, still a prefix-cache hit until reused."""
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    """Prompt tokens of running and waiting requests not computed yet."""
    num_prompt_tokens: int
    """Cumulative prompt tokens of requests that got their first token here, and how many
    of them were prefix-cache hits."""
    num_cached_tokens: int
    num_preemptions: int = 0
    """Cumulative preemptions (by recompute)."""
    spec_num_drafts: int = 0
    """Speculative decoding, cumulative: verifications, tokens proposed, tokens accepted, and
    per proposal position (0-based) the verifications that accepted it."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
