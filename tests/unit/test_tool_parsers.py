"""Tool-call parsers against outputs as each family writes them (Qwen2.5/Qwen3 and Hermes,
Llama 3.1, Mistral v3 and v11), whole and streamed: the stream, cut anywhere, gives the same
content and calls as the whole answer."""
from __future__ import annotations

import json

import pytest

from router.tool_parsers import ToolStream, make_parser, parser_for_template

QWEN_TWO_CALLS = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
                  'CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
                  '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>')
CASES = [
    ("hermes", QWEN_TWO_CALLS, None,
     [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
      ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    ("hermes", 'Let me look that up.\n\n<tool_call>\n{"name": "search", "arguments": {"q": "caf\u00e9 \\"x\\""}}\n'
     '</tool_call>', "Let me look that up.", [("search", {"q": 'caf\u00e9 "x"'})]),
    ("hermes", '<tool_call>\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": 1}}]\n</tool_call>',
     None, [("a", {}), ("b", {"n": 1})]),  # SmolLM2's list inside one pair of tags
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"x": 1}}', None, [("cut", {"x": 1})]),  # closing tag cut
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": 1}), ("b", {})]),
    ("llama3_json", 'Use {"name": ...} to call.', 'Use {"name": ...} to call.', []),
    ("llama3_json", '\n{"name": "broken", "parameters": ', '\n{"name": "broken", "parameters": ', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
     '"format": "celsius"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]', None,
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"}), ("get_time", {"tz": "CET"})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', "Sure.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("mistral", '[TOOL_CALLS]lookup[CALL_ID]a1b2c3d4e[ARGS]{"q": 1}', None, [("lookup", {"q": 1})]),
]


def _named(calls) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_whole_answer_reads_as_its_content_and_calls(name: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = make_parser(name).parse(text)
    assert got_content == content and _named(got_calls) == calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_streamed_answer_cut_anywhere_gives_the_whole_answer_s_content_and_calls(
        name: str, text: str, content: str | None, calls: list) -> None:
    for cuts in [list(range(1, len(text))), [len(text) // 3, len(text) // 2], []]:
        stream = ToolStream(make_parser(name))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
        streamed = "".join(d.content for d in deltas)
        assert (streamed or None) == content, pieces
        started = [d for d in deltas if d.call is not None]
        args = {i: "".join(d.arguments for d in deltas if d.index == i and d.call is None) for i in range(len(started))}
        assert [(d.call.name, json.loads(args[d.index])) for d in started] == calls
        assert [d.index for d in started] == list(range(len(calls)))
        # a call's deltas come after all the content
        last_content = max((i for i, d in enumerate(deltas) if d.content), default=-1)
        assert all(i > last_content for i, d in enumerate(deltas) if d.index >= 0)


def test_hermes_calls_stream_as_each_closes_and_parallel_calls_can_be_limited() -> None:
    stream = ToolStream(make_parser("hermes"))
    first_end = QWEN_TWO_CALLS.index("</tool_call>") + len("</tool_call>")
    sent = stream.feed(QWEN_TWO_CALLS[:first_end])
    assert [d.call.name for d in sent if d.call] == ["get_current_temperature"]  # before the answer ends
    one = ToolStream(make_parser("hermes"), max_calls=1)
    deltas = one.feed(QWEN_TWO_CALLS) + one.finish()
    assert [d.call.name for d in deltas if d.call] == ["get_current_temperature"] and len(one.calls) == 1


def test_content_is_held_only_while_it_may_be_a_marker_s_start() -> None:
    stream = ToolStream(make_parser("hermes"))
    assert [d.content for d in stream.feed("Hello <tool")] == ["Hello"]
    assert [d.content for d in stream.feed("s> are")] == [" <tools> are"]


@pytest.mark.parametrize("template,parser", [
    ("{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>", "hermes"),
    ("{% for t in tools %}[AVAILABLE_TOOLS]{% endfor %}[TOOL_CALLS]", "mistral"),
    ("{%- if tools %}Environment: ipython{% endif %}<|python_tag|><|eom_id|>", "llama3_json"),
    ("{{ messages }}<tool_call>", None),  # no tools rendered: a call format alone is not enough
    ("{% if tools %}{{ tools }}{% endif %}", None),
    (None, None),
])
def test_the_parser_follows_the_chat_template_s_own_format(template: str | None, parser: str | None) -> None:
    assert parser_for_template(template) == parser


def test_an_unknown_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'pythonic'; known: hermes, llama3_json, mistral"):
        make_parser("pythonic")
