"""Reasoning split from content for thinking models (Qwen3, DeepSeek-R1), whole and streamed:
a stream cut anywhere gives the whole answer's reasoning and content."""
from __future__ import annotations

import pytest

from router.reasoning import ReasoningParser, ReasoningStream, parser_for_template

CASES = [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", "\nThe user greets me.\n",
     "Hello! How can I help?"),
    ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),  # enable_thinking false
    ("qwen3", "<think>\nStill thinking when max_tokens", "\nStill thinking when max_tokens", ""),
    ("qwen3", "<thinking is fun", None, "<thinking is fun"),
    ("qwen3", "<th", None, "<th"),
    ("deepseek_r1", "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4.", "Okay, 2 + 2 is 4.\n", "The answer is 4."),
    ("deepseek_r1", "<think>\nHmm.</think>4", "\nHmm.", "4"),
    ("deepseek_r1", "Never closes", "Never closes", ""),
    ("deepseek_r1", "</think>Direct.", None, "Direct."),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_a_whole_answer_splits_into_reasoning_and_content(name: str, text: str, reasoning: str | None,
                                                        content: str) -> None:
    assert ReasoningParser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_a_stream_cut_anywhere_splits_as_the_whole_answer(name: str, text: str, reasoning: str | None,
                                                          content: str) -> None:
    for cuts in [list(range(1, len(text))), [len(text) // 2], []]:
        stream = ReasoningStream(ReasoningParser(name))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        parts = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts)) == (reasoning, content), pieces


def test_reasoning_streams_as_it_comes_holding_back_only_a_possible_end_tag() -> None:
    stream = ReasoningStream(ReasoningParser("qwen3"))
    assert stream.feed("<think>Let") == ("Let", "")
    assert stream.feed(" me see</th") == (" me see", "")
    assert stream.feed("ink>\n\nHi") == ("", "Hi")


@pytest.mark.parametrize("template,parser", [
    ("{% if enable_thinking is false %}<think>\\n\\n</think>{% endif %}", "qwen3"),
    ("{{'<｜Assistant｜><think>\\n'}}", "deepseek_r1"),
    ("{{ messages }}", None),
    (None, None),
])
def test_the_parser_follows_the_chat_template(template: str | None, parser: str | None) -> None:
    assert parser_for_template(template) == parser


def test_an_unknown_reasoning_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'; known: qwen3, deepseek_r1"):
        ReasoningParser("o1")
