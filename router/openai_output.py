"""OpenAI's answer shapes, built in the router from the `Reply`s of `Generation.stream`:
one choice's whole answer or stream chunks (`Output`; tool calls: router/constraints.py),
several choices merged into one answer (`merged`, usage summed with the prompt counted once)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from proto import generate_pb2 as pb
from router.reasoning import ReasoningParser, ReasoningStream
from router.reply import Reply


@dataclass
class Output:
    """One request's answer as OpenAI writes it, built from the router's replies. A chat
    answer's text goes through the reasoning parser where there is one (`reasoning_content`
    beside the content); subclasses shape the content (tool calls: router/constraints.py)
    through `_message`, `_delta` and `_finish_reason`."""

    kind: Literal["completion", "chat"]
    request_id: str
    model: str
    include_logprobs: bool
    token_text: Any = None
    """Token id -> its text (for logprobs)."""
    return_token_ids: bool = False
    reasoning: ReasoningParser | None = None
    prompt_ids: list[int] | None = None
    """The prompt's token ids, where its log-probabilities or its echo are returned."""
    echo: str | None = None
    """A completion with echo: the prompt's text, returned before the output."""
    hide: bool = False
    """max_tokens 0 with echo: the one token drawn is not returned (nor counted)."""
    prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs: the choice lists each prompt token's (alternatives' too)."""
    num_top: int = 0
    """A completion's logprobs k: its top_logprobs is a list (of k alternatives a token) when k > 0."""
    index: int = 0
    """The choice's index: a request's prompts (completions), or its n choices."""
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[pb.TopLogprobs] = field(default_factory=list)
    prompt: pb.PromptLogprobs | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    _thinking: ReasoningStream | None = None
    _offset: int = 0
    """Characters of the completion's text so far (text_offset of its next token)."""

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def add(self, r: Reply) -> None:
        if r.prompt_logprobs is not None:
            self.prompt = r.prompt_logprobs
        if not self.hide:
            self.text.append(r.text)
            self.token_ids += r.token_ids
            self.logprobs += r.logprobs
            self.top += r.top_logprobs
        if (u := r.usage) is not None:  # the last reply: finish reason and usage
            self.finish_reason = r.finish_reason.value if r.finish_reason is not None else None
            completion = 0 if self.hide else u.completion_tokens
            self.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
                          "total_tokens": u.prompt_tokens + completion,
                          "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": self.index,
                                  "logprobs": self._logprobs(self.token_ids, self.logprobs, self.top, True),
                                  "finish_reason": self._finish_reason()}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_entries()
        if self.kind == "completion":
            choice["text"] = (self.echo or "") + text
        else:
            reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
            choice["message"] = self._message(content)
            if reasoning is not None:
                choice["message"]["reasoning_content"] = reasoning
        if self.return_token_ids:
            choice["token_ids"] = self.token_ids
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage}

    def chunk(self, r: Reply | None, first: bool = False) -> dict[str, Any] | None:
        """The stream chunk for `r` after `add(r)`: its text, or at the last reply the finish
        reason alone; None when it carries nothing to send. `r` None: the usage chunk."""
        out = {"id": self.request_id, "object": self.object + ("" if self.kind == "completion" else ".chunk"),
               "created": self.created, "model": self.model, "choices": []}
        if r is None:
            out["usage"] = self.usage
            return out
        last = r.last
        ids, text = ([], "") if self.hide else (list(r.token_ids), r.text)
        logprobs = self._logprobs(ids, list(r.logprobs), list(r.top_logprobs), first)
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs,
                                  "finish_reason": self._finish_reason() if last else None}
        if first and self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_entries()
        if self.kind == "completion":
            choice["text"] = (self.echo if self.echo is not None and first else "") + text
            says = bool(choice["text"])
        else:
            reasoning, content = self._think(r.text, last)
            delta = self._delta(content, first, last)
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice["delta"] = delta
            says = bool(delta)
        if not (says or last or first or ((logprobs is not None or self.return_token_ids) and ids)):
            return None
        if self.return_token_ids:
            choice["token_ids"] = ids
        out["choices"].append(choice)
        return out

    def _think(self, text: str, last: bool) -> tuple[str, str]:
        """A streamed delta's (reasoning, content)."""
        if self.reasoning is None:
            return "", text
        if self._thinking is None:
            self._thinking = ReasoningStream(self.reasoning)
        reasoning, content = self._thinking.feed(text)
        if last:
            more = self._thinking.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return reasoning, content

    def _finish_reason(self) -> str | None:
        return self.finish_reason

    def _message(self, content: str) -> dict[str, Any]:
        return {"role": "assistant", "content": content}

    def _delta(self, content: str, first: bool, last: bool) -> dict[str, Any]:
        if first:
            return {"role": "assistant", "content": content}
        return {"content": content} if content else {}

    def _logprobs(self, token_ids: list[int], logprobs: list[float], top: list[pb.TopLogprobs],
                  first: bool) -> dict[str, Any] | None:
        """OpenAI's logprobs of these tokens; a completion's, with echo on its first part, the
        prompt's before them (its first token has none)."""
        if not self.include_logprobs:
            return None
        texts = [self.token_text(t) for t in token_ids]
        if self.kind == "chat":
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": [
                {"token": self.token_text(a), "logprob": b, "bytes": list(self.token_text(a).encode())}
                for a, b in zip(x.token_ids, x.logprobs, strict=True)] if x is not None else []}
                for t, lp, x in zip(texts, logprobs, [*top, *[None] * len(texts)], strict=False)]}
        tops = [self._alternatives(x) for x in top] or [None] * len(texts)
        tokens, values = texts, list(logprobs[:len(texts)])
        if first and self.echo is not None and self.prompt_ids is not None:
            p, n = self.prompt, len(self.prompt_ids) - 1
            tokens = [self.token_text(t) for t in self.prompt_ids] + tokens
            values = [None, *(p.logprobs if p is not None else [None] * n)] + values
            tops = [None, *([self._alternatives(x) for x in p.top] if p is not None and any(x.token_ids for x in p.top)
                            else [None] * n)] + tops
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": tops if self.num_top else None, "text_offset": offsets}

    def _alternatives(self, x: pb.TopLogprobs) -> dict[str, float]:
        """A completion's top_logprobs entry: each alternative's text -> its log-probability."""
        return {self.token_text(t): lp for t, lp in zip(x.token_ids, x.logprobs, strict=True)}

    def _prompt_entries(self) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, then {token id: {logprob,
        rank, decoded_token}} for it and its position's alternatives."""
        p, ids = self.prompt, self.prompt_ids
        if p is None or ids is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for token, lp, rank, top in zip(ids[1:], p.logprobs, p.ranks, p.top, strict=False):
            entry = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": self.token_text(t)}
                     for i, (t, v) in enumerate(zip(top.token_ids, top.logprobs, strict=True))}
            entry[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": self.token_text(token)}
            out.append(entry)
        return out


def merged(outputs: list[Output], usage_of: list[Output] | None = None) -> dict[str, Any]:
    """One answer of several choices (several prompts, or n > 1), the usage of `usage_of`
    (default: these) summed."""
    bodies = [o.whole() for o in outputs]
    body = {**bodies[0], "choices": [b["choices"][0] for b in bodies]}
    usages = [o.usage for o in (usage_of or outputs) if o.usage is not None]
    if usages:
        body["usage"] = sum_usage(usages)
    return body


def best(parts: list[list[Output]], keep: int) -> list[Output]:
    """best_of: each part's `keep` choices of the highest summed log-probability, indexed
    anew in OpenAI's order (their logprobs shown only where asked for)."""
    out = []
    for i, part in enumerate(parts):
        for j, o in enumerate(sorted(part, key=lambda o: -sum(o.logprobs))[:keep]):
            o.index = i * keep + j
            out.append(o)
    return out


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(kind: Literal["completion", "chat"], request_id: str | None = None) -> str:
    """A response's id: the client's `request_id` where it sent one (as vLLM names it), else a new one."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + (request_id or uuid.uuid4().hex)

