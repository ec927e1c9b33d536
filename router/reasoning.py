"""A thinking model's reasoning split from its answer (`reasoning_content` beside `content`).

Two families write their thinking between <think> and </think> (torch-free, pure):

    qwen3        Qwen3, QwQ: the answer may open with <think>; only then is what precedes
                 </think> reasoning (with `chat_template_kwargs: {"enable_thinking": false}`
                 the template closes an empty think block in the prompt, and the whole answer
                 is content)
    deepseek_r1  DeepSeek-R1 and its distillations: the template opens <think> in the prompt,
                 so the answer is reasoning up to </think> (all of it, if it never closes)

`split` reads a whole answer; `ReasoningStream` splits one as it streams, holding back only a
tail that may be the start of a tag. The content after </think> starts at its first non-blank
character. `parser_for_template` picks the family from a chat template that writes <think>.
"""
from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
        self.name = name
        self.opens_in_prompt = name == "deepseek_r1"
        """The answer starts inside the think block (its <think> is in the prompt)."""

    special_tokens = (START, END)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer; reasoning None when it has none."""
        head = text.lstrip()
        if head.startswith(START):
            body = head[len(START):]
        elif self.opens_in_prompt:
            body = text
        else:
            return None, text
        reasoning, end, content = body.partition(END)
        return reasoning or None, content.lstrip() if end else ""


class ReasoningStream:
    """Splits an answer into (reasoning, content) deltas as its text arrives."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text = ""
        self._state = "start"
        """start (a think block may open), reasoning, after (</think> read), content."""
        self._at = 0
        """Characters of the text handled."""

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        reasoning = ""
        if self._state == "start":
            head = self._text.lstrip()
            if len(head) < len(START) and START.startswith(head):
                return "", ""  # may still open a think block
            if head.startswith(START):
                self._state, self._at = "reasoning", len(self._text) - len(head) + len(START)
            else:
                self._state = "reasoning" if self.parser.opens_in_prompt else "content"
        if self._state == "reasoning":
            end = self._text.find(END, self._at)
            if end < 0:
                safe = max(self._at, len(self._text) - _partial(self._text[self._at:], END))
                reasoning, self._at = self._text[self._at:safe], safe
                return reasoning, ""
            reasoning, self._at, self._state = self._text[self._at:end], end + len(END), "after"
        if self._state == "after":  # blanks after </think> are not content
            rest = self._text[self._at:].lstrip()
            self._at = len(self._text) - len(rest)
            if not rest:
                return reasoning, ""
            self._state = "content"
        content, self._at = self._text[self._at:], len(self._text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer."""
        rest, self._at = self._text[self._at:], len(self._text)
        if self._state == "start":
            return (rest, "") if self.parser.opens_in_prompt else ("", rest)
        if self._state == "reasoning":
            return rest, ""
        return "", rest if self._state == "content" else ""


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


def parser_for_template(source: str | None) -> str | None:
    """The reasoning parser a chat template implies: deepseek_r1 where its generation prompt
    opens the think block, qwen3 where the template knows <think> otherwise; None: no thinking."""
    if not source or START not in source:
        return None
    return "deepseek_r1" if "<｜Assistant｜><think>" in source or "'<think>\\n'" in source else "qwen3"
