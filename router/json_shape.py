"""How many items each list and map of a JSON body holds, counted before the body is parsed.

    body bytes --scan (a regex walks the tokens; a string or a flat list of numbers is one
               token, so its length costs C time, not Python time)--> each container's count
               against its limit: the first one over ends the scan with a 400

A parser builds the whole body before any size check can run: pydantic took 0.5-0.7 s (and
a request's conversion seconds more) on a 15 MiB body of one million `logit_bias` entries or
messages, on the router's event loop. The scan stops at the item past a limit, a few KiB
into such a body. Keys are read as JSON reads them (`"r\\u006fle"` is `role`).

Limits are by path (`("messages", "*", "content")`, `*` for any index), with flat lists of
numbers apart (token ids); any container with no limit of its own holds at most `default_items`, and nesting stops at `max_depth`. What is
not JSON, or not an object, is left to the parser, which says what is wrong with it.
Torch-free.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

Path = tuple[str, ...]

_TOKEN = re.compile(rb'"[^"]*"'  # a string (to its first quote: an escaped one is seen to, `_Text`)
                    rb'|[\[\]{},:]'
                    rb'|[^\s\[\]{},:"]+')  # a literal: a number, true, false, null
_SEP = frozenset(b",:")


class TooMany(Exception):
    """A container holds more items than its limit: `path` names it, `limit` is the most allowed."""

    def __init__(self, path: Path, limit: int, what: str) -> None:
        super().__init__(f"{'.'.join(path) or 'the body'} holds more than {limit} {what}")
        self.path, self.limit, self.what = path, limit, what


@dataclass(frozen=True)
class Shape:
    limits: Mapping[Path, int]
    """The most items a container at this path holds (a list's entries, a map's keys)."""
    number_lists: Mapping[Path, int]
    """The most numbers a flat list of numbers at this path holds (token ids: a prompt's may
    be as long as the context, where a list of prompts is short); others `default_items`."""
    default_items: int = 4096
    """Any other container's most items."""
    max_depth: int = 64
    """Containers inside containers, the body's own object counted."""

    def check(self, body: bytes) -> None:
        """Raises TooMany for the first container past its limit (while scanning, so a flood
        costs the few KiB up to that item); returns at the body's end or where it is not JSON."""
        text = _Text(body)
        stack: list[_Open] = []
        key: str | None = None  # the current object's last key
        pos = 0
        while (m := text.token(pos)) is not None:
            pos = m.end()
            tok = m.group()
            c = tok[0]
            if c in _SEP:
                continue
            if c in b"]}":
                if not stack:
                    return
                stack.pop()
                continue
            if not stack:  # the body's own value
                if c != ord("{"):
                    return
                stack.append(_Open((), True, self._limit(())))
                continue
            top = stack[-1]
            if top.is_map and top.wants_key:
                if c != ord('"'):
                    return
                key = _key(body[m.start():pos])
                top.wants_key = False
                top.add(1)
                continue
            if top.is_map:
                top.wants_key = True
                name = key if key is not None else "?"
            else:
                name = "*"
                top.add(1)
            if c not in b"[{":
                continue
            path = (*top.path, name)
            if c == ord("[") and (flat := text.flat_list(pos)) is not None:  # counted in C, not walked
                end, num = flat
                if num > (limit := self.number_lists.get(path, self.default_items)):
                    raise TooMany(path, limit, "numbers")
                pos = end + 1
                continue
            if len(stack) >= self.max_depth:
                raise TooMany(path, self.max_depth, "levels of nesting")
            stack.append(_Open(path, c == ord("{"), self._limit(path)))
            key = None

    def _limit(self, path: Path) -> int:
        return self.limits.get(path, self.default_items)


class _Open:
    """A container being scanned."""

    __slots__ = ("path", "is_map", "limit", "num", "wants_key")

    def __init__(self, path: Path, is_map: bool, limit: int) -> None:
        self.path, self.is_map, self.limit, self.num, self.wants_key = path, is_map, limit, 0, is_map

    def add(self, n: int) -> None:
        self.num += n
        if self.num > self.limit:
            raise TooMany(self.path, self.limit, "keys" if self.is_map else "items")


class _Text:
    """The body as the scan reads it: tokens, and flat lists of scalars found by C searches.

    A string token runs to the next quote. Until a string is seen to end in a backslash the
    body is read as it is; from then on, a copy with each escape pair (`\\\\`, then `\\"`)
    written over as `__`, where every quote left bounds a string and every offset is the body's
    (one pass over the body, paid only by bodies with such strings)."""

    def __init__(self, body: bytes) -> None:
        self.body = self.text = body

    def token(self, pos: int) -> re.Match[bytes] | None:
        m = _TOKEN.search(self.text, pos)
        if m is not None and m.group()[-2:] == b'\\"' and self.text is self.body and len(m.group()) > 1:
            self.text = self.body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
            m = _TOKEN.search(self.text, pos)
        return m

    def flat_list(self, pos: int) -> tuple[int, int] | None:
        """(where it ends, how many items) of the list opened just before `pos`, if it holds no
        string, list or map (numbers, true, false, null); None otherwise."""
        text = self.text
        end = text.find(b"]", pos)
        if end < 0 or any(text.find(c, pos, end) >= 0 for c in (b"[", b"{", b'"')):
            return None
        empty = end - pos <= 64 and not text[pos:end].strip()  # (a long list is never all blanks)
        return end, 0 if empty else text.count(b",", pos, end) + 1


@functools.lru_cache(maxsize=256)
def _key(tok: bytes) -> str:
    """A key's text; one with escapes as JSON reads it (a key no limit names stays unmatched)."""
    if b"\\" not in tok:
        return tok[1:-1].decode("utf-8", "replace")
    try:
        return str(json.loads(tok))
    except ValueError:
        return "?"
