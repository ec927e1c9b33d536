"""One request's state in the router: its tries on workers, its deadline, its progress, and
the failures that end a try (`WorkerFailed`: another try may go elsewhere) or the
request (`RequestFailed`)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from control import tracing
from engine.core.request import FinishReason, SamplingParams
from router.reply import Route


CUT_OFF = "the request was cut off inside the router; retry"
"""A request cancelled from below (a bug, not the client): UNAVAILABLE with this message."""


class RequestFailed(Exception):
    """Ends a Generate stream with `code`; `retry_after_s` becomes trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


class WorkerFailed(RequestFailed):
    """A worker failed under the request (not the request's fault): another try may go elsewhere."""

    def __init__(self, worker_id: str, code: grpc.StatusCode, message: str, down: bool,
                 retry_after_s: float | None = None, timed_out: bool = False) -> None:
        super().__init__(code, message, retry_after_s)
        self.worker_id = worker_id
        self.down = down
        """The worker itself is dead or unreachable (it gets no new requests for a while)."""
        self.timed_out = timed_out
        """It sent nothing in time; the call is still open (a busy worker may still answer)."""


BlockHashMemo = dict[tuple[str, int], list[bytes]]


@dataclass(frozen=True)
class Ask:
    """A request as a door hands it in (`Generation.stream`), in the router's one form: the
    gRPC door converts its message once (`router/frontend.py ask_from_pb`), the HTTP door builds it
    from the JSON body (router/openai_protocol.py); `Frontend.prepare` then checks and
    tokenizes it into `Prepared`."""

    prompt: str | Sequence[int]
    """Text (tokenized by the router), or token ids (a gRPC message's own list: copied once
    its length is checked)."""
    params: SamplingParams
    client_id: str = ""
    """The client's `request_id` ("" for none)."""
    tenant: str = ""
    priority: int = 0
    route: str = "generate"
    """How it came (`Prepared.route`)."""


@dataclass
class Prepared:
    request_id: str
    """The router's own id for the request, unique in the cluster: what workers, admission and
    logs know it by. Never a client's: a client's id could name another's request or a choice
    of one (`X#1`), on a worker that holds them in one namespace."""
    token_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    tenant_weight: float = 1.0
    """The tenant's weight (the router's config), for the workers' fair order."""
    route: str = "generate"
    """How it came: "generate" (gRPC), "chat" or "completion" (OpenAI HTTP); its expected
    output is learnt per route (router/output_lengths.py)."""
    block_hashes: BlockHashMemo = dataclasses.field(default_factory=dict, compare=False)
    """The prompt's block hashes per (model id, block size), computed once: at admission
    (cached prefix) and reused by the first try's routing."""
    client_id: str = ""
    """The id the client gave (its `request_id`; "" for none): only shown back to it, in its responses."""

    @property
    def shown_id(self) -> str:
        """The id the client's responses carry: its own, or the router's when it gave none."""
        return self.client_id or self.request_id

    def attempt(self, n: int, sent: list[int]) -> Attempt:
        """Try `n` (0 first): a later one re-prefills the prompt plus the tokens `sent` and asks for the rest."""
        if n == 0:
            return Attempt(self.request_id, self.token_ids, self.params, self.tenant, self.priority,
                           self.tenant_weight, self.block_hashes)
        return Attempt(f"{self.request_id}~{n}", self.token_ids + sent,
                       dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(sent),
                                           constraint_prefix=self.params.constraint_prefix + len(sent)
                                           if self.params.constraint is not None else 0,
                                           min_tokens=max(self.params.min_tokens - len(sent), 0),
                                           output_prefix=self.params.output_prefix + len(sent)),
                       self.tenant, self.priority, self.tenant_weight)


@dataclass(frozen=True)
class Attempt:
    """One try of a request on workers: after a failure, the prompt grows by the tokens already sent."""

    worker_request_id: str
    token_ids: list[int]
    params: SamplingParams
    tenant: str
    priority: int
    tenant_weight: float = 1.0
    block_hashes: BlockHashMemo = dataclasses.field(default_factory=dict, compare=False)
    """Its prompt's block hashes per (model id, block size), once computed."""


@dataclass
class Progress:
    """One request's counters and clock readings (perf_counter seconds)."""

    arrived: float
    admitted: float = 0.0
    routed: float = 0.0
    first_token: float = 0.0
    transfer_ms: float = 0.0
    """First token sent to the KV arriving on the decode worker (remote prefill)."""
    transfer_window_ms: float = 0.0
    num_cached_tokens: int = 0
    route: Route | None = None
    """Where the current try runs."""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    """Sent to the client so far."""
    finish_reason: FinishReason | None = None
    """The last reply's (None while unfinished)."""
    status: int = 0
    """The gRPC status code the request ended with (0: OK)."""
    span: Any = tracing.NO_SPAN
    """Its `router.generate` span (`control.tracing`; non-recording when tracing is off)."""
    prep: Prepared | None = None

    @property
    def num_sent(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Deadline:
    """The client's deadline on the router's clock (None: the client set none)."""

    at: float | None
    clock: Callable[[], float] = time.monotonic

    def remaining(self, cap_s: float) -> float:
        """Seconds a wait may take: `cap_s`, or less when the deadline comes first; raises once it passed."""
        if self.at is None:
            return cap_s
        left = self.at - self.clock()
        if left <= 0:
            raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return min(left, cap_s)
