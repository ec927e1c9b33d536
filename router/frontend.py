"""The router's text side: an `Ask` in, `Prepared` out; tokens in, `Reply`s out.

The only place a request is tokenized and its output detokenized (workers send token
ids only, whichever worker computed them, so a retried request's text stays one
stream). Checks that need the model use the facts the workers report (`ModelFacts`):
vocabulary, context length, and the KV blocks the largest decode worker holds.
"""
from __future__ import annotations

import functools
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from tokenizers import Tokenizer

from control.heartbeat import ModelFacts
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import FinishReason
from engine.structured.grammars import Grammars
from engine.types import InvalidRequestError
from proto import generate_pb2 as pb
from proto.convert import sampling_from_pb
from router.attempt import Ask, Prepared, Progress, RequestFailed
from router.chat_template import ChatTemplate, ChatTemplateError
from router.policy import blocks_for
from router.reply import Reply, Timing, Usage


MAX_ID_CHARS = 128
"""request_id and tenant: at most this many printable characters."""
MIN_PRIORITY, MAX_PRIORITY = -8, 8
"""Priorities (lower is more important) outside this range are refused, so a caller cannot
open a queue of its own with each new value; waiting requests age toward the front."""
MAX_TEXT_CHARS_PER_TOKEN = 32
"""A text prompt longer than this many characters per token of context is refused before tokenizing."""


NOT_SERVING = "no decode worker is serving yet; retry after 1.0 s"


def serving_facts(facts: ModelFacts | None) -> ModelFacts:
    """The model's facts, or the one refusal (UNAVAILABLE, retry in 1 s) while no decode worker serves."""
    if facts is None:
        raise RequestFailed(grpc.StatusCode.UNAVAILABLE, NOT_SERVING, 1.0)
    return facts


def check_vocabulary(token_ids: list[int], vocab_size: int, what: str = "token ids") -> None:
    """Raises InvalidRequestError naming the first ids outside [0, vocab_size)."""
    if bad := [t for t in token_ids if not 0 <= t < vocab_size]:
        raise InvalidRequestError(f"{what} {bad[:5]} are outside the model's vocabulary [0, {vocab_size})")


OFF_LOOP_CHARS = 16384
"""Text (a prompt, a conversation) longer than this is rendered and tokenized off the event loop."""
OFF_LOOP_CONSTRAINT_CHARS = 1024
"""A constraint longer than this is checked off the event loop (a schema's check grows with it)."""


def ask_from_pb(request: pb.GenerateRequest) -> Ask:
    """The gRPC door's message in the router's form, its sampling converted once (the engine's
    limits checked); raises RequestFailed (INVALID_ARGUMENT)."""
    try:
        params = sampling_from_pb(request.sampling)
    except InvalidRequestError as e:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    prompt = request.text if request.WhichOneof("prompt") == "text" else request.token_ids.ids
    return Ask(prompt, params, request.request_id, request.tenant, request.priority)


def slow_to_prepare(ask: Ask) -> bool:
    """Whether preparing the request (tokenizing, checking its constraint) may take long
    enough to stall the event loop's other streams."""
    constraint = ask.params.constraint
    return (isinstance(ask.prompt, str) and len(ask.prompt) > OFF_LOOP_CHARS) or \
        (constraint is not None and len(constraint.value) > OFF_LOOP_CONSTRAINT_CHARS)


class Frontend:
    def __init__(self, tokenizer_dir: str | None, chat_template_file: str | None = None) -> None:
        tok = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
        self.tokenizer = Tokenizer.from_file(str(tok)) if tok is not None and tok.is_file() else None
        self.chat_template = ChatTemplate.load(tokenizer_dir, chat_template_file)
        self.grammars = Grammars(None, 0, [])
        """Constraints are compiled here first (syntax, schema, limits; no masks), so a bad one
        is refused before any work (its verdict kept: the same one again costs nothing); the
        workers compile them again against the tokenizer."""

    def chat_token_ids(self, messages: list[dict[str, Any]], max_model_len: int, add_generation_prompt: bool = True,
                       template_kwargs: dict[str, Any] | None = None, continue_final: bool = False) -> list[int]:
        """A conversation's prompt tokens: the model's chat template rendered, then tokenized
        without adding special tokens (the template holds them). Raises InvalidRequestError."""
        if self.chat_template is None or self.tokenizer is None:
            raise InvalidRequestError("this model has no chat template: use the completions endpoint, or start the "
                                      "router with --chat-template FILE")
        num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if num_chars > MAX_TEXT_CHARS_PER_TOKEN * max_model_len:
            raise InvalidRequestError(f"messages hold {num_chars} characters; the model's context is {max_model_len} "
                                      "tokens")
        try:
            text = self.chat_template.render(messages, add_generation_prompt, template_kwargs, continue_final)
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e)) from None
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, through the tokenizer's batch form: it lets go of the GIL while
        it works (the one-text form holds it, so off the event loop it would still stall the
        loop: ~3 s for 4 MB of text here)."""
        assert self.tokenizer is not None
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def _special(self) -> dict[int, str]:
        """The tokenizer's special tokens: id -> text (what skip_special_tokens leaves out)."""
        if self.tokenizer is None:
            return {}
        return {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def special_tokens(self) -> frozenset[str]:
        return frozenset(self._special.values())

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self._special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        return self._encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def prepare(self, ask: Ask, facts: ModelFacts | None, max_decode_blocks: int) -> Prepared:
        """Checks and tokenizes; raises RequestFailed with the status the client gets."""
        facts = serving_facts(facts)
        params = ask.params
        try:
            _check_fields(ask, facts)
            if params.constraint is not None:
                self.grammars.check(params.constraint)
            token_ids = self._tokenize(ask.prompt)
            check_vocabulary(token_ids, facts.vocab_size)
            check_vocabulary([t for t, _ in params.logit_bias], facts.vocab_size, "logit_bias token ids")
        except InvalidRequestError as e:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if len(token_ids) >= facts.max_model_len:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt has {len(token_ids)} tokens; the model's context is {facts.max_model_len} "
                                "tokens, so the prompt must be shorter than that")
        need = blocks_for(len(token_ids), facts.block_size, facts.kv_window)
        if need > max_decode_blocks:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt needs {need} KV blocks; the largest decode worker holds {max_decode_blocks}")
        if params.stop and self.tokenizer is None:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a model with a tokenizer")
        return Prepared(uuid.uuid4().hex, token_ids, params, ask.priority, ask.tenant, route=ask.route,
                        client_id=ask.client_id)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send the prompt as token_ids")
            ids = self._encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty: send text or token_ids with at least one token")
        return ids

    def detokenizer(self, prep: Prepared) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prep.token_ids, prep.params.stop, prep.params.skip_special_tokens,
                                      self.special_token_ids, prep.params.include_stop_str_in_output)


def _check_fields(ask: Ask, facts: ModelFacts) -> None:
    """Limits on the fields the model does not check itself (each error says what to change)."""
    for name, value in (("request_id", ask.client_id), ("tenant", ask.tenant)):
        if len(value) > MAX_ID_CHARS or not value.isprintable():
            raise InvalidRequestError(f"{name} must be at most {MAX_ID_CHARS} printable characters "
                                      f"(got {len(value)} characters)")
    if not MIN_PRIORITY <= ask.priority <= MAX_PRIORITY:
        raise InvalidRequestError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}] (lower is more important), "
                                  f"got {ask.priority}")
    if isinstance(ask.prompt, str) and len(ask.prompt) > MAX_TEXT_CHARS_PER_TOKEN * facts.max_model_len:
        raise InvalidRequestError(f"prompt text has {len(ask.prompt)} characters; the model's context is "
                                  f"{facts.max_model_len} tokens")
    if not isinstance(ask.prompt, str) and len(ask.prompt) >= facts.max_model_len:  # before the ids are copied
        raise InvalidRequestError(f"prompt has {len(ask.prompt)} tokens; the model's context is "
                                  f"{facts.max_model_len} tokens, so the prompt must be shorter than that")


def runs_to_the_end(prep: Prepared) -> bool:
    """Nothing can stop it before `output_tokens`: EOS ignored, no stop strings or stop tokens
    (a benchmark's request): its output is known, not expected."""
    p = prep.params
    return p.ignore_eos and not p.stop and not p.stop_token_ids and p.constraint is None


def output_tokens(prep: Prepared, max_model_len: int) -> int:
    """The most tokens a request can generate: its max_tokens, within the context."""
    return max(min(prep.params.max_tokens, max_model_len - len(prep.token_ids)), 0)


class ItlWindow:
    """The router's recent inter-token latencies (what clients see between tokens), for the
    autoscaler; each gap also goes to `on_gap` (the metrics' histogram)."""

    def __init__(self, size: int = 2048, on_gap: Callable[[float, int], None] | None = None) -> None:
        self.samples: deque[float] = deque(maxlen=size)
        self.on_gap = on_gap

    def observe(self, gap_s: float, num_tokens: int) -> None:
        """A response carried `num_tokens` new tokens `gap_s` after the previous one."""
        self.samples.append(gap_s / num_tokens)
        if self.on_gap is not None:
            self.on_gap(gap_s, num_tokens)

    def p50_ms(self) -> float | None:
        return statistics.median(self.samples) * 1e3 if self.samples else None


class Responses:
    """One request's output side: detokenizes each token once (stop strings too) and builds responses."""

    def __init__(self, prep: Prepared, progress: Progress, detok: IncrementalDetokenizer | None,
                 itl: ItlWindow | None = None) -> None:
        self.prep, self.progress, self.detok, self.itl = prep, progress, detok, itl
        self._last_at = 0.0

    def tokens(self, token_ids: list[int], logprobs: list[float], reason: FinishReason | None,
               top: Sequence[pb.TopLogprobs] = (), prompt: pb.PromptLogprobs | None = None) -> tuple[Reply, bool]:
        """A reply with these new tokens (cut at a stop string), their alternatives `top`, and
        on the first the prompt's log-probabilities; True when it is the last."""
        progress = self.progress
        now = time.perf_counter()
        if progress.num_sent == 0 and token_ids:
            progress.first_token = now
        elif token_ids and self.itl is not None and self._last_at:
            self.itl.observe(now - self._last_at, len(token_ids))
        if token_ids:
            self._last_at = now
        text, sent = "", list(token_ids)
        if self.detok is not None:
            # the stop token that ends the output (EOS, a stop token id) is never text, special or not
            shown = len(token_ids) - (reason is FinishReason.STOP and bool(token_ids)
                                      and self.detok.ends_output(token_ids[-1], self.prep.params.stop_token_ids))
            text, kept, stopped = self.detok.extend(token_ids, shown)
            if stopped:
                sent, reason = sent[:kept], FinishReason.STOP
        progress.token_ids += sent
        done = reason is not None
        if done and self.detok is not None:
            text += self.detok.flush()
        params = self.prep.params
        first = progress.num_sent == len(sent)
        reply = Reply(self.prep.shown_id, sent, text, logprobs[:len(sent)] if params.logprobs else [],
                      list(top)[:len(sent)] if params.top_logprobs else [], reason,
                      prompt_logprobs=prompt if prompt is not None and params.prompt_logprobs is not None and first
                      else None, route=progress.route if sent and first else None)
        return reply, done

    def final(self, reason: FinishReason | None) -> Reply:
        prep, progress = self.prep, self.progress
        return Reply(prep.shown_id, finish_reason=reason, route=progress.route, timing=self.timing(),
                     usage=Usage(len(prep.token_ids), progress.num_cached_tokens, progress.num_sent))

    def timing(self) -> Timing:
        progress, ms = self.progress, 1e3
        return Timing(queue_ms=(progress.admitted - progress.arrived) * ms,
                      prefill_ms=(progress.first_token - progress.routed) * ms, transfer_ms=progress.transfer_ms,
                      transfer_window_ms=progress.transfer_window_ms,
                      ttft_ms=(progress.first_token - progress.arrived) * ms)
