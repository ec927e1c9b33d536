"""The request: carries its own tokens, counters, block table and status (torch-free).

One accounting scheme for every role: `num_tokens` (prompt + output) and
`num_computed_tokens` (tokens whose KV is in the pool). Prefix-cache hits, chunked
prefill and KV imported from a prefill worker all just advance `num_computed_tokens`.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.types import BlockHash, BlockId, InvalidRequestError, RequestId


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """Decode role: blocks reserved, KV arriving from a prefill worker."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    """A stop token, EOS or stop string."""
    LENGTH = "length"
    """max_tokens or the model's context length."""
    ABORT = "abort"
    PREFILL_DONE = "prefill_done"
    """Prefill role: first token produced, blocks handed to the transfer layer."""


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16
"""Choices (`n`) one request may ask for."""
MAX_TOP_LOGPROBS = 20
"""Alternatives a request may ask for per token (vLLM's default max_logprobs; OpenAI's chat limit)."""
MAX_LOGIT_BIAS = 1024
"""Entries of a request's logit_bias (OpenAI's own limit is on the order of hundreds)."""


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 65536


@dataclass(frozen=True)
class Constraint:
    """What the output must match (engine/structured/grammars.py compiles it): a JSON schema (its JSON
    text), any JSON object (`value` empty), a regex, a choice among strings (a JSON list of
    them), or a grammar (Lark, or GBNF when it has `::=`)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                                      f"got {self.kind!r}")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(f"the {self.kind} constraint has {len(self.value)} characters; at most "
                                      f"{MAX_CONSTRAINT_CHARS} are accepted")
        if self.kind not in ("json_object",) and not self.value:
            raise InvalidRequestError(f"the {self.kind} constraint is empty")


class TopLogprobs(NamedTuple):
    """One position's likeliest tokens, best first, and their log-probabilities."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class Logprob(NamedTuple):
    """A sampled token's log-probability with the position's alternatives (top_logprobs)."""

    logprob: float
    top: TopLogprobs


class PromptLogprob(NamedTuple):
    """A prompt token's log-probability given the tokens before it, its rank among the
    vocabulary (1: the likeliest), and the position's alternatives."""

    logprob: float
    rank: int
    top: TopLogprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    seed: int | None = None
    """Per-request seed: the same tokens whatever else is in the batch."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; the output text is cut before the first one found."""
    include_stop_str_in_output: bool = False
    """The stop string that ends the text is kept in it (the text is cut after it; vLLM's)."""
    ignore_eos: bool = False
    logprobs: bool = False
    """Return the log-probability of each chosen token (from the raw logits)."""
    top_logprobs: int = 0
    """With logprobs: also the this many likeliest tokens at each position, and theirs."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability (after the first), its rank, and this many
    likeliest alternatives; None: none. Such a prompt is computed whole: no prefix-cache hit."""
    constraint: Constraint | None = None
    """Structured output: every token must keep the output within it, and the request ends
    (stop) once it is complete."""
    constraint_prefix: int = 0
    """The last this many prompt tokens were already generated under `constraint` (a retry
    that re-prefills the tokens sent so far continues the constraint from there)."""
    skip_special_tokens: bool = True
    """The output text leaves special tokens out (False: keeps them, but for the stop token
    that ends it: a tool-call parser reads markers that are special tokens)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted once per time the output already holds the token (OpenAI's)."""
    repetition_penalty: float = 1.0
    """A token of the prompt or the output has its logit divided by it where positive, else
    multiplied (transformers' and vLLM's); 1: off."""
    min_p: float = 0.0
    """Random sampling keeps the tokens whose probability is at least min_p times the
    likeliest one's (after temperature); 0: off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to the logits before anything else (OpenAI's, each in [-100, 100])."""
    min_tokens: int = 0
    """The output is at least this long: EOS and the stop tokens are not drawn before."""
    output_prefix: int = 0
    """The prompt's last this many tokens are this output's, sent on an earlier try (a router
    retry re-prefills them): the frequency and presence penalties count them as output."""
    n: int = 1
    """Choices: the prompt is computed once, and at its first token the request forks into n
    sequences sharing its blocks (engine/core/forks.py); choice i draws as a request of seed
    `seed + i` would (unseeded: from the engine's stream)."""

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} "
                                      f"characters each, got {len(self.stop)} (longest {max(map(len, self.stop))})")
        if self.constraint_prefix < 0 or (self.constraint_prefix and self.constraint is None):
            raise InvalidRequestError(f"constraint_prefix must be >= 0 and needs a constraint, got "
                                      f"{self.constraint_prefix}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (math.isfinite(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10] (1 is off), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias holds {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        if any(not (math.isfinite(b) and -100 <= b <= 100) or t < 0 for t, b in self.logit_bias):
            raise InvalidRequestError("logit_bias maps token ids (0 or more) to biases in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}] and needs logprobs, got "
                                      f"{self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.output_prefix < 0:
            raise InvalidRequestError(f"output_prefix must be >= 0, got {self.output_prefix}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def controls_logits(self) -> bool:
        """Some control changes the logits before sampling (engine/model/logits_controls.py)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalizes

    @property
    def penalizes(self) -> bool:
        """A penalty reads the tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def reads_history(self) -> bool:
        """Its logits depend on the tokens before each position (a penalty, min_tokens): no
        proposals verified several positions at once, no step launched ahead of its token."""
        return self.penalizes or self.min_tokens > 0


@dataclass(eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    """Lower is more important (as in vLLM)."""
    tenant: str = ""
    tenant_weight: float = 1.0
    """The tenant's weight in the engine's fair order (`engine.core.fair_order`)."""
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """With top_logprobs: each output token's alternatives."""
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    """With prompt_logprobs: each prompt token's from the second on, in order (filled as the
    prompt's chunks are computed; a recompute after preemption leaves them be)."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first schedule."""
    block_ids: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0
    """Leading blocks of `block_ids` not to register in the prefix cache: registered already,
    or never computed here (a sliding window's null entries)."""
    num_slid_blocks: int = 0
    """Leading entries of `block_ids` that are the null block: every layer's sliding window
    has passed them, so their blocks went back to the pool (`KVCacheManager.slide`)."""
    choice_index: int = 0
    """Of a request with n choices, which this one is (0: the request itself; the others are
    forked from it at its first token, with ids `choice_id(request_id, i)`)."""
    choice_tokens: list[tuple[int, float | Logprob | None]] = field(default_factory=list)
    """On a prefill worker, a request of n choices: the others' first tokens (and logprobs),
    drawn with its own; they travel with it to the decode worker, which forks with them."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_prefill_chunks: int = 0
    """Steps that computed part of its prompt (chunked prefill; a preemption's recompute counts too)."""
    arrival_seq: int = 0
    """Tie-break between equal arrival times (set by the scheduler)."""
    fair_tag: float = 0.0
    """Its start tag in the engine's fair order among tenants (set by the scheduler)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Tokens proposed to follow its tokens, verified in the next step (engine/spec/spec_decode.py);
    never part of `num_tokens`, their KV rolled back unless accepted."""
    spec_acceptance: float | None = None
    """Its proposals' recent acceptance (exponential average; None: none verified yet, the
    policy's prior stands for it) and the speculative policy's back-off: failures in a row,
    and the step it may propose again."""
    spec_failures: int = 0
    spec_paused_until: int = 0
    matcher: object | None = None
    """Its constraint's state (an llguidance matcher, engine/structured/grammars.py), built from the
    constraint and its tokens wherever it runs, never carried across processes."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("prompt is empty: send at least one token")
        if not (math.isfinite(self.tenant_weight) and self.tenant_weight > 0):
            raise InvalidRequestError(f"tenant_weight must be a finite number > 0, got {self.tenant_weight}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int, logprob: float | Logprob | None = None) -> None:
        self.output_token_ids.append(token_id)
        if isinstance(logprob, Logprob):
            self.output_logprobs.append(logprob.logprob)
            self.output_top_logprobs.append(logprob.top)
        elif logprob is not None:
            self.output_logprobs.append(logprob)

    def stop_reason_for_last_token(self, max_model_len: int) -> FinishReason | None:
        """Token-level stop check after appending an output token."""
        last = self.output_token_ids[-1]
        if last in self.params.stop_token_ids:
            return FinishReason.STOP
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
