"""The body's lists and maps counted before any parse (router/json_shape.py): each refusal
names the container by its path, strings (escapes and all) never count, and what is not a
JSON object is left to the parser."""
from __future__ import annotations

import json

import pytest

from router.json_shape import Shape, TooMany

SHAPE = Shape({("messages",): 3, ("messages", "*", "content"): 2, ("logit_bias",): 2},
              {("prompt",): 5, ("prompt", "*"): 4}, default_items=6, max_depth=5)


def too_many(body: bytes | str) -> tuple[tuple[str, ...], int, str] | None:
    try:
        SHAPE.check(body.encode() if isinstance(body, str) else body)
    except TooMany as e:
        return e.path, e.limit, e.what
    return None


def test_each_container_is_held_to_its_paths_limit() -> None:
    assert too_many(json.dumps({"messages": [{"role": "u"}] * 3})) is None
    assert too_many(json.dumps({"messages": [{"role": "u"}] * 4})) == (("messages",), 3, "items")
    assert too_many(json.dumps({"messages": [{"content": [{}, {}, {}]}]})) == (("messages", "*", "content"), 2, "items")
    assert too_many(json.dumps({"logit_bias": {"1": 1, "2": 2, "3": 3}})) == (("logit_bias",), 2, "keys")
    assert too_many(json.dumps({"a": list("abcdefg")})) == (("a",), 6, "items")  # no limit of its own
    assert too_many(json.dumps(dict.fromkeys("abcdefg", 0))) == ((), 6, "keys")


def test_flat_lists_of_numbers_have_limits_of_their_own() -> None:
    assert too_many('{"prompt": [1, 2, 3, 4, 5]}') is None and too_many('{"prompt": []}') is None
    assert too_many('{"prompt": [1, 2, 3, 4, 5, 6]}') == (("prompt",), 5, "numbers")
    assert too_many('{"prompt": [[1, 2, 3, 4], [1, -2.5e3, 3, 4, 5]]}') == (("prompt", "*"), 4, "numbers")
    assert too_many('{"x": [1, 2, 3, 4, 5, 6, 7]}') == (("x",), 6, "numbers")


def test_keys_are_read_as_json_reads_them_and_strings_never_count() -> None:
    escaped = '{"m\\u0065ssages": [' + ",".join(['{"r\\u006fle": "u"}'] * 4) + "]}"
    assert too_many(escaped) == (("messages",), 3, "items")
    quoted = json.dumps({"messages": ['[[[["\\"]]]]', "{,,,,,,,}", 'a\\\\"b']})  # escapes, brackets in strings
    assert too_many(quoted) is None
    assert too_many(json.dumps({"k\"ey": ["x"] * 7})) == (('k"ey',), 6, "items")


def test_nesting_stops_at_max_depth() -> None:
    assert too_many('{"a": [[[{}]]]}') is None
    assert too_many('{"a": [[[[{}]]]]}') == (("a", "*", "*", "*", "*"), 5, "levels of nesting")


@pytest.mark.parametrize("body", ["[1, 2, 3, 4, 5, 6, 7, 8]", '"text"', "", "{nonsense", '{"a": [1, 2,'])
def test_what_is_not_a_json_object_is_left_to_the_parser(body: str) -> None:
    assert too_many(body) is None
