"""What the router sends back for a request, in its own form.

    worker events (pb, another process) --(RequestFlow: the finish reason read once into
    `FinishReason`)--> Responses.tokens / final (router/frontend.py) --> Reply
        --(gRPC door: `reply_to_pb`, once)--> GenerateResponse
        --(HTTP door: read as it is, router/openai_output.py)--> OpenAI JSON

A finish reason is the engine's `FinishReason` from the worker's message to the door. The
workers' log-probability messages (`pb.TopLogprobs`, `pb.PromptLogprobs`) ride along as the
worker sent them: nothing in the router reads them but the doors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import FinishReason
from proto import generate_pb2 as pb
from proto.convert import finish_to_pb


@dataclass(frozen=True)
class Route:
    """Where a try of the request runs."""

    decode_worker: str
    prefill_worker: str = ""
    """"" when the decode worker prefills it itself."""
    local_prefill: bool = False


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from a prefix cache."""
    completion_tokens: int


@dataclass(frozen=True)
class Timing:
    """A request's times (ms), as `Timing` in proto/generate.proto states them."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    transfer_window_ms: float
    ttft_ms: float


@dataclass
class Reply:
    """New tokens of one choice (cut at a stop string), or a choice's last reply, which alone
    carries `usage` and `timing`."""

    request_id: str
    """The id the client sees (`Prepared.shown_id`)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[pb.TopLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    choice: int = 0
    prompt_logprobs: pb.PromptLogprobs | None = None
    """On a request's first reply, with `SamplingParams.prompt_logprobs`."""
    usage: Usage | None = None
    timing: Timing | None = None
    route: Route | None = None
    """On the first reply with tokens (where the request runs) and the last (where it ended)."""

    @property
    def last(self) -> bool:
        return self.usage is not None


def reply_to_pb(r: Reply) -> pb.GenerateResponse:
    """The gRPC door's response for a router `Reply` (the one conversion on the way out)."""
    u, t, route = r.usage, r.timing, r.route
    return pb.GenerateResponse(
        request_id=r.request_id, token_ids=r.token_ids, text=r.text, logprobs=r.logprobs,
        finish_reason=finish_to_pb(r.finish_reason), top_logprobs=r.top_logprobs, prompt_logprobs=r.prompt_logprobs,
        choice=r.choice,
        usage=None if u is None else pb.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                                              completion_tokens=u.completion_tokens),
        timing=None if t is None else pb.Timing(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms,
                                                transfer_ms=t.transfer_ms, transfer_window_ms=t.transfer_window_ms,
                                                ttft_ms=t.ttft_ms),
        route=None if route is None else pb.Route(decode_worker=route.decode_worker,
                                                  prefill_worker=route.prefill_worker,
                                                  local_prefill=route.local_prefill))
