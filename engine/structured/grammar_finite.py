"""Can a constraint ever end? A grammar whose start rule cannot derive a finite string (each
alternative needs the rule again: `start: "a" start`), or a JSON schema that requires itself
(`{"properties": {"next": {"$ref": "#"}}, "required": ["next"]}`), compiles in llguidance
without a word, and a request under it could never emit EOS: it would run to max_tokens and
end with output that never parses. So these are refused up front, by name.

The test is productivity, the textbook fixed point over a context-free grammar: a rule is
productive when one of its alternatives consists of terminals and productive rules only;
iterate from "none" until nothing changes; the grammar is usable when its start is
productive. A JSON schema is read the same way, its local `$ref` targets standing for rules.
Both readings are conservative: what they do not understand (a remote `$ref`, a Lark form
they cannot parse) counts as productive, so a grammar llguidance accepts is refused only
when it provably has no finite output.

    lark_unending(text) -> rules that cannot end, reachable from start ([] when it can)
    schema_unending(schema) -> JSON pointers of schemas that cannot end ([] when it can)
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

_TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"i?)
  | (?P<regex>/(?!/)(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<repeat>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<special><[^>\n]*>)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>-?\d+)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<sub>@[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>[:|()\[\]?!*+~.{])
""", re.VERBOSE)

INLINE = {"%json", "%regex", "%lark"}
"""Directives that stand for a terminal inside an expansion (each followed by a {...} body)."""


class _Unknown(Exception):
    """The text is outside what this reader parses: no verdict (llguidance has validated it)."""


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise _Unknown(text[i:i + 20])
        kind, value = m.lastgroup or "", m.group()
        i = m.end()
        if kind == "ws":
            continue
        if kind == "op" and value == "{":  # a directive's JSON or Lark body: balanced, strings skipped
            body, i = _braced(text, i - 1)
            out.append(("body", body))
            continue
        out.append((kind, value))
    return out


def _braced(text: str, start: int) -> tuple[str, int]:
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        i += 1
        if in_string:
            if ch == "\\":
                i += 1
            in_string = ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth == 0:
                return text[start:i], i
    raise _Unknown("an unbalanced {")


# An expansion: ("seq", [items]) | ("alt", [expansions]) | ("opt", x) | ("need", x) | ("rule", name)
# | ("json", schema) | ("end",): a terminal, always finite.
Expr = tuple


class _Parser:
    def __init__(self, tokens: list[tuple[str, Any]]) -> None:
        self.t, self.i = tokens, 0

    def peek(self, k: int = 0) -> tuple[str, Any]:
        return self.t[self.i + k] if self.i + k < len(self.t) else ("eof", "")

    def at_definition(self) -> int:
        """How many tokens open a definition here: [?!] NAME [. NUMBER] ':' (a colon never
        appears inside an expansion); 0 where none does."""
        k = 1 if self.peek() in (("op", "?"), ("op", "!")) else 0
        if self.peek(k)[0] != "name":
            return 0
        if self.peek(k + 1) == ("op", ":"):
            return k + 2
        if self.peek(k + 1) == ("op", ".") and self.peek(k + 2)[0] == "number" and self.peek(k + 3) == ("op", ":"):
            return k + 4
        return 0

    def definitions(self) -> dict[str, Expr]:
        rules: dict[str, Expr] = {}
        while self.peek()[0] != "eof":
            kind, value = self.peek()
            if kind == "directive" and value not in INLINE:
                self.i += 1  # %ignore, %import, %llguidance {...}: up to the next definition
                while self.peek()[0] != "eof" and not self.at_definition():
                    self.i += 1
                continue
            opening = self.at_definition()
            if not opening:
                raise _Unknown(str(value))
            name = self.peek(1 if kind == "op" else 0)[1]  # past a ? or ! prefix
            self.i += opening
            body = self.alternatives()
            if _is_rule(name):
                rules[name] = body  # TERMINALS are regular, hence always finite
        return rules

    def alternatives(self) -> Expr:
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.i += 1
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self) -> Expr:
        items: list[Expr] = []
        while True:
            kind, value = self.peek()
            if kind == "eof" or self.at_definition() or (kind, value) in (("op", "|"), ("op", ")"), ("op", "]")):
                return ("seq", items)
            if kind == "directive" and value not in INLINE:
                return ("seq", items)
            if kind == "arrow":  # an alias: `a b -> name`
                self.i += 2
                continue
            items.append(self.postfix(self.atom()))

    def atom(self) -> Expr:
        kind, value = self.peek()
        self.i += 1
        if (kind, value) == ("op", "("):
            inner = self.alternatives()
            self.expect(")")
            return inner
        if (kind, value) == ("op", "["):
            inner = self.alternatives()
            self.expect("]")
            return ("opt", inner)
        if kind == "name":
            return ("rule", value) if _is_rule(value) else ("end",)
        if kind == "directive":  # %json {schema}, %regex {...}, %lark {...}
            body = self.peek()
            self.i += body[0] == "body"
            if value == "%json" and body[0] == "body":
                try:
                    return ("json", json.loads(body[1]))
                except ValueError:
                    raise _Unknown("%json") from None
            return ("end",)
        if kind in ("string", "regex", "special", "sub"):
            if kind == "string" and self.peek()[0] == "range":  # "a".."z"
                self.i += 2
            return ("end",)
        raise _Unknown(str(value))

    def postfix(self, x: Expr) -> Expr:
        while True:
            kind, value = self.peek()
            if self.at_definition():  # `a: x` then `?b: y`: the ? opens the next rule
                return x
            if (kind, value) in (("op", "?"), ("op", "*")):
                self.i += 1
                x = ("opt", x)
            elif (kind, value) == ("op", "+"):
                self.i += 1
            elif kind == "repeat":
                self.i += 1
                low = value.strip("{} ").split(",")[0].strip()
                x = ("opt", x) if low in ("", "0") else x
            elif (kind, value) == ("op", "~"):
                low = self.peek(1)[1]
                self.i += 2
                if self.peek()[0] == "range":
                    self.i += 2
                x = ("opt", x) if low == "0" else x
            else:
                return x

    def expect(self, op: str) -> None:
        if self.peek() != ("op", op):
            raise _Unknown(f"expected {op}")
        self.i += 1


def _is_rule(name: str) -> bool:
    """Lark: rules are lower case, terminals upper case (either may start with _)."""
    return name.lstrip("_")[:1].islower()


def _finite(x: Expr, done: Callable[[str], bool]) -> bool:
    tag = x[0]
    if tag == "seq":
        return all(_finite(y, done) for y in x[1])
    if tag == "alt":
        return any(_finite(y, done) for y in x[1])
    if tag == "rule":
        return done(x[1])
    if tag == "json":
        return not schema_unending(x[1])
    return True  # "end", "opt"


def _refs(x: Expr) -> set[str]:
    if x[0] in ("seq", "alt"):
        return set().union(*(_refs(y) for y in x[1])) if x[1] else set()
    if x[0] == "opt":
        return _refs(x[1])
    return {x[1]} if x[0] == "rule" else set()


def lark_unending(text: str, budget: Budget | None = None) -> list[str]:
    """The rules reachable from `start` that derive no finite string, when `start` is one of
    them ([] when the grammar can end, or when the text is beyond this reader); TooLarge past
    `budget` (rule readings)."""
    budget = budget or Budget()
    try:
        rules = _Parser(_tokens(text)).definitions()
    except (_Unknown, RecursionError):
        return []
    if "start" not in rules:
        return []

    def holds(r: str, done: set[str]) -> bool:
        budget.spend(1 + len(rules[r][1]) if rules[r][0] in ("seq", "alt") else 1)
        return _finite(rules[r], lambda x: x in done or x not in rules)

    done = _least_fixed_point({r: _refs(body) for r, body in rules.items()}, holds)
    if "start" in done:
        return []
    seen, todo = {"start"}, ["start"]
    while todo:
        for r in _refs(rules[todo.pop()]) & rules.keys():
            if r not in seen:
                seen.add(r)
                todo.append(r)
    return sorted(seen - done, key=lambda r: (r != "start", r))


def _least_fixed_point(deps: dict[K, set[K]], holds: Callable[[K, set[K]], bool]) -> set[K]:
    """The names that hold, each rechecked only when one it depends on comes to hold: the
    least fixed point in time linear in the dependencies, not quadratic in the names."""
    users: dict[K, list[K]] = {}
    for name, needs in deps.items():
        for need in needs:
            users.setdefault(need, []).append(name)
    done: set[K] = set()
    todo = list(deps)
    while todo:
        name = todo.pop()
        if name not in done and holds(name, done):
            done.add(name)
            todo.extend(users.get(name, ()))
    return done


class TooLarge(ValueError):
    """The constraint is beyond the checking budget: refused naming the limit, not checked for ever."""


MAX_CHECK_STEPS = 1_000_000
"""Schema nodes (or grammar rule visits) one check may visit: ~1 s of Python at most; a
schema past it is refused as too large to check."""
MAX_REFS = 10_000
"""Distinct local `$ref` strings one schema may hold."""
_INDEX = re.compile(r"0|[1-9][0-9]*")
"""An array index in a JSON pointer (RFC 6901): ASCII digits, no sign, no leading zero."""


class Budget:
    def __init__(self, steps: int = MAX_CHECK_STEPS) -> None:
        self.left = steps
        self.steps = steps

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise TooLarge(f"the constraint is too large to check (more than {self.steps} steps)")


def _schema_refs(node: Any, budget: Budget) -> set[str]:
    out: set[str] = set()
    stack = [node]
    while stack:
        x = stack.pop()
        budget.spend()
        if isinstance(x, dict):
            if isinstance(x.get("$ref"), str):
                out.add(x["$ref"])
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


_UNRESOLVED = object()


def _pointer(root: Any, ref: str) -> Any:
    """The node a local `$ref` names, read as RFC 6901 says (an index only as its canonical
    digits); `_UNRESOLVED` where it names none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _UNRESOLVED
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and _INDEX.fullmatch(part) and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return _UNRESOLVED
    return node


def schema_unending(schema: Any, budget: Budget | None = None) -> list[str]:
    """The local `$ref` targets (JSON pointers) with no finite instance, when the whole schema
    has none ([] when it has one). Each node is read once, however many `$ref` spellings name
    it, so the check is linear in the schema (within `budget`: TooLarge past it)."""
    budget = budget or Budget()
    node_of: dict[str, int] = {}  # a $ref -> the id of the node it names
    nodes: dict[int, Any] = {}
    refs_in: dict[int, set[str]] = {id(schema): _schema_refs(schema, budget)}
    todo, seen = [id(schema)], set()
    while todo:
        for ref in refs_in[todo.pop()]:
            if not ref.startswith("#") or ref in seen:
                continue
            seen.add(ref)
            if len(seen) > MAX_REFS:
                raise TooLarge(f"the JSON schema holds more than {MAX_REFS} distinct $refs")
            target = _pointer(schema, ref)
            if target is _UNRESOLVED:
                continue  # unresolvable: llguidance reports it, not us
            key = node_of[ref] = id(target)
            if key not in nodes:
                nodes[key] = target
                if key not in refs_in:
                    refs_in[key] = _schema_refs(target, budget)
                todo.append(key)
    try:
        done = _least_fixed_point({k: {node_of[r] for r in refs_in[k] if r in node_of} for k in nodes},
                                  lambda k, done: _instance(nodes[k], _known(node_of, done), budget))
        ends = _instance(schema, _known(node_of, done), budget)
    except RecursionError:  # nested past Python's stack: no verdict
        return []
    if ends:
        return []
    return sorted(r for r, k in node_of.items() if k not in done) or ["#"]


def _known(node_of: dict[str, int], done: set[int]) -> Callable[[str], bool]:
    """Whether a `$ref` is known to have a finite instance (an unresolvable one counts as
    having one: llguidance refuses it)."""
    return lambda ref: ref not in node_of or node_of[ref] in done


def _instance(s: Any, known: Callable[[str], bool], budget: Budget) -> bool:
    """Whether schema `s` has a finite instance, the `$ref`s `known` to have one."""
    budget.spend()
    if s is False:
        return False
    if not isinstance(s, dict):
        return True
    ref = s.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not known(ref):
        return False
    if "const" in s or "enum" in s:
        return True
    for key, need in (("allOf", all), ("anyOf", any), ("oneOf", any)):
        subs = s.get(key)
        if isinstance(subs, list) and subs and not need(_instance(x, known, budget) for x in subs):
            return False
    types = s.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if types is None or types - {"object", "array"}:  # a scalar (or a type llguidance will refuse)
        return True
    ok = False
    if "object" in types:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        required = [r for r in s.get("required", []) if isinstance(r, str)] if isinstance(s.get("required"), list) else []
        ok = all(_instance(props.get(r, True), known, budget) for r in required)
    if "array" in types and not ok:
        low = s.get("minItems", 0) if isinstance(s.get("minItems", 0), int) else 0
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        firsts = prefix[:low]
        rest = s.get("items", True) if low > len(prefix) else True
        ok = all(_instance(x, known, budget) for x in firsts) and _instance(rest, known, budget)
    return ok
