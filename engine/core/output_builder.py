"""A step's `RequestOutput`s: each request's new tokens, detokenized incrementally with its
stop strings (a stop string among several accepted tokens ends the request there, the tokens
after it dropped), its first token counted into the engine's prompt and cache-hit totals,
and, for a request that goes on, the role's turn (`Role.after_token`: a prefill worker hands
the request off at its first token)."""
from __future__ import annotations

from tokenizers import Tokenizer

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason, Request
from engine.core.roles import Role
from engine.core.scheduler import Scheduler
from engine.types import RequestId


class OutputBuilder:
    def __init__(self, tokenizer: Tokenizer | None, detokenize: bool) -> None:
        self.tokenizer = tokenizer if detokenize else None
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self.num_prompt_tokens = 0
        """Cumulative prompt tokens of requests that got their first token here."""
        self.num_cached_tokens = 0
        """Of those, the ones served from the prefix cache."""

    def start(self, request: Request) -> None:
        """A new request: its detokenizer, where there is a tokenizer to detokenize with."""
        if self.tokenizer is not None:
            self._detok[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.stop,
                keep_stop=request.params.include_stop_str_in_output)

    def forget(self, request_id: RequestId) -> None:
        self._detok.pop(request_id, None)

    def turn(self, request: Request, scheduler: Scheduler, role: Role, num_new: int = 1) -> None:
        """What a step does for a request that got `num_new` tokens, text aside (the simulator's
        engine does just this): its first token counts its prompt and cache hits into the totals
        (once a prompt: choice 0), and, if it goes on, the role takes its turn."""
        if len(request.output_token_ids) == num_new and request.choice_index == 0:
            self.num_prompt_tokens += request.num_prompt_tokens
            self.num_cached_tokens += request.num_cached_tokens
        if not request.is_finished:
            role.after_token(request, request.output_token_ids[-1], scheduler, scheduler.kv)

    def output(self, request: Request, scheduler: Scheduler, role: Role, num_new: int = 1) -> RequestOutput:
        """The request's `num_new` last tokens (more than one: accepted proposals), detokenized."""
        rid = request.request_id
        tokens = request.output_token_ids[-num_new:]
        text, stopped = "", False
        detok = self._detok.get(rid)
        if detok is not None:
            text, kept, stopped = detok.extend(tokens)
            if (drop := len(tokens) - kept) > 0:  # a stop string among accepted tokens: the rest go
                del request.output_token_ids[-drop:]
                del request.output_logprobs[len(request.output_logprobs) - drop:]
                del request.output_top_logprobs[len(request.output_top_logprobs) - drop:]
                tokens = tokens[:kept]
        if stopped:
            scheduler.finish(request, FinishReason.STOP)
        self.turn(request, scheduler, role, len(tokens))
        if request.is_finished and detok is not None and not stopped:
            text += detok.flush()
        out = RequestOutput(
            request_id=rid,
            new_token_ids=tokens,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            new_logprobs=request.output_logprobs[-len(tokens):] if request.params.logprobs else [],
            new_top_logprobs=request.output_top_logprobs[-len(tokens):] if request.params.top_logprobs else [],
            prompt_logprobs=list(request.prompt_logprobs) if request.params.prompt_logprobs is not None and
            len(request.output_token_ids) == len(tokens) else None,
            choice_tokens=request.choice_tokens if len(request.output_token_ids) == len(tokens) else [],
            choice_index=request.choice_index,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            num_prefill_chunks=request.num_prefill_chunks,
        )
        if request.is_finished:
            self.forget(rid)
        return out
