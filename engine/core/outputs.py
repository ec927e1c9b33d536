"""What an engine step gives back and what its roles exchange (torch-free): a request's new
tokens (`RequestOutput`), an offline run's result (`Completion`), a decode worker's block
reservation for KV computed elsewhere (`RemoteBlocks`), and the prefill role's hand-off hook."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.core.request import FinishReason, Logprob, PromptLogprob, Request, TopLogprobs
from engine.types import BlockId, RequestId


@dataclass
class RequestOutput:
    """What one step produced for one request (only what changed)."""

    request_id: RequestId
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """With top_logprobs: each new token's alternatives."""
    prompt_logprobs: list[PromptLogprob] | None = None
    """With prompt_logprobs, on the request's first output: its prompt tokens' (from the second)."""
    choice_index: int = 0
    """Which of its request's n choices (engine/core/forks.py)."""
    choice_tokens: list[tuple[int, float | Logprob | None]] = field(default_factory=list)
    """A prefill worker's first output of a request of n choices: the other choices' first
    tokens (engine/core/forks.py), which the decode worker forks with."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    """Times the request was preempted so far (recomputed)."""
    num_prefill_chunks: int = 0
    """Steps that computed part of its prompt so far."""


@dataclass
class Completion:
    request_id: RequestId
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass(frozen=True)
class RemoteBlocks:
    """Decode role: where a prompt's KV must be written."""

    request_id: RequestId
    block_ids: list[BlockId]
    num_cached_tokens: int
    """Leading prompt tokens already cached here."""
    num_skip_blocks: int
    """Leading blocks not to send: cached here, or wholly before the first decode query's
    sliding window (null entries)."""


class KVHandoff(Protocol):
    """Prefill role: receives computed blocks; blocks stay in use until released."""

    def on_blocks_computed(self, request: Request) -> None:
        """After each step that advanced the request (chunk boundary)."""
        ...

    def on_prefill_finished(self, request: Request, block_ids: list[BlockId], first_token_id: int) -> None:
        ...
