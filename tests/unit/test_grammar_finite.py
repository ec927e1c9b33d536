"""Constraints with no finite output (engine/structured/grammar_finite.py): llguidance compiles them
without a word; splitserve refuses them by name, and never refuses one that can end."""
from __future__ import annotations

import json
import re

import llguidance
import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from engine.structured.grammar_finite import lark_unending, schema_unending
from engine.core.request import Constraint
from engine.structured.grammars import Grammars
from engine.types import InvalidRequestError

ENDLESS_LARK = [
    ('start: "a" start', ["start"]),
    ('start: x\nx: "a" x | "b" x', ["start", "x"]),
    ('start: a b\na: "x"\n?b: "y" b\n', ["start", "b"]),
    ('start: "a"~3 start', ["start"]),
    ('start: item+\nitem: "x" item\nITEM: "q"', ["start", "item"]),
    ('start: %json {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}', ["start"]),
    ('start: ("(" start ")")', ["start"]),
]
FINITE_LARK = [
    'start: x\nx: "a" x | "b"',
    'start: a b\na: "x"\n?b: "y" b | c\nc: "z"',
    'start: item*\nitem: "x" item',
    'start: [item]\nitem: "x" item',
    'start: ("a" start)~0..2',
    'start: "a" -> alias\n | start "b"',
    'start: expr\nexpr: term ("+" term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n%ignore /\\s+/',
    'start: %json {"type": "object", "properties": {"n": {"$ref": "#"}}}',
    '%llguidance {}\nstart: "a"{0,3} start | "b"',
    'start: x{2}\nx: "a" | "b" x',
]


@pytest.mark.parametrize("text, endless", ENDLESS_LARK)
def test_a_grammar_whose_start_cannot_end_names_its_rules(text: str, endless: list[str]) -> None:
    assert not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(text))  # llguidance: fine
    assert lark_unending(text) == endless


@pytest.mark.parametrize("text", FINITE_LARK)
def test_grammars_that_can_end_pass(text: str) -> None:
    assert lark_unending(text) == []


def test_gbnf_is_read_after_its_conversion_to_lark() -> None:
    assert lark_unending(gbnf_to_lark('root ::= "a" root')) == ["start"]
    assert lark_unending(gbnf_to_lark('root ::= item+\nitem ::= "x" item')) == ["start", "item"]
    assert lark_unending(gbnf_to_lark('root ::= ("ab" | "cd" | "ef")+ "."')) == []
    assert lark_unending(gbnf_to_lark('root ::= "<" [a-c]+ ">"')) == []


def test_text_beyond_the_reader_gets_no_verdict() -> None:
    assert lark_unending('start: _sep{x, ","}\n_sep{a, b}: a (b a)*') == []  # templates: not read
    assert lark_unending("no rules at all") == []
    assert lark_unending("start: " + "(" * 3000 + '"a"' + ")" * 3000) == []


SELF = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


def test_a_schema_that_requires_itself_names_where() -> None:
    assert schema_unending(SELF) == ["#"]
    node = {"type": "object", "required": ["c"],
            "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}}
    assert schema_unending({"$defs": {"n": node}, "$ref": "#/$defs/n"}) == ["#/$defs/n"]
    assert schema_unending(False) == ["#"]


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional: a leaf ends it
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no type: a number is an instance
    {"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    {"$defs": {"n": {"type": "object", "required": ["c"],
                     "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#", "enum": [1]}}} | {"enum": [{"x": 1}]},
    {"$ref": "#/nowhere"}, {"type": "strang"},  # llguidance's errors to report
    {"type": "object"}, True,
])
def test_schemas_with_a_finite_instance_pass(schema: object) -> None:
    assert schema_unending(schema) == []


def test_a_long_chain_of_references_is_decided_in_linear_time() -> None:
    n = 1500  # deeper than Python's stack: the reading is iterative
    defs = {f"d{i}": {"type": "object", "required": ["x"], "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    assert schema_unending({"$defs": defs, "$ref": "#/$defs/d0"}) == []
    defs[f"d{n}"] = {"$ref": "#/$defs/d0"}
    assert len(schema_unending({"$defs": defs, "$ref": "#/$defs/d0"})) == n + 1


def test_grammars_refuse_them_with_a_message_a_person_can_act_on() -> None:
    g = Grammars(None, 512, [2])
    with pytest.raises(InvalidRequestError, match=r"grammar has no finite output: rule start, x cannot end"):
        g.check(Constraint("grammar", 'root ::= x\nx ::= "a" x | "b" x'))
    with pytest.raises(InvalidRequestError, match=r"JSON schema has no finite instance: # requires itself"):
        g.check(Constraint("json_schema", json.dumps(SELF)))
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        g.check(Constraint("json_schema", '{"items":' * 3000 + "{}" + "}" * 3000))
    assert len(g) == 3  # the refusals are kept: the same constraint again is refused at once
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        g.check(Constraint("json_schema", '{"items":' * 3000 + "{}" + "}" * 3000))
    assert len(g) == 3
    g.check(Constraint("grammar", 'root ::= x\nx ::= "a" x | "b"'))
    assert len(g) == 4


@pytest.mark.parametrize("gbnf,message", [("root ::= (", "Expected ')'"), ("root ::= y", "Rule 'y' not found"),
                                          ('root ::= "a', "Unexpected end of input")])
def test_a_malformed_gbnf_grammar_is_an_invalid_request_naming_the_fault(gbnf: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"the GBNF grammar cannot be read: .*{re.escape(message)}"):
        Grammars(None, 512, [2]).check(Constraint("grammar", gbnf))


def test_refs_that_spell_one_index_many_ways_are_not_followed_and_the_check_is_linear() -> None:
    """Distinct `$ref` spellings of one node ("00", "+0", "0_0": Python's int reads them all
    as 0) are not RFC 6901 pointers: unresolved (llguidance names them). Canonical ones
    naming one node read it once; a schema past the budget is refused naming it."""
    from engine.structured.grammar_finite import MAX_REFS, Budget, TooLarge

    selfish = {"type": "object", "properties": {"next": {"$ref": "#/$defs/l/0"}}, "required": ["next"]}
    for spelling in ("00", "+0", "0_0", " 0", "\u0660"):
        assert schema_unending({"$defs": {"l": [selfish]}, "$ref": f"#/$defs/l/{spelling}"}) == []
    assert schema_unending({"$defs": {"l": [selfish]}, "$ref": "#/$defs/l/0"}) == ["#/$defs/l/0"]
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    many = {"$defs": {"big": big}, "anyOf": [{"$ref": "#/$defs/big"}] * 5000}
    budget = Budget()
    assert schema_unending(many, budget) == []
    assert budget.steps - budget.left < 20_000  # the big node read once, not once per $ref
    with pytest.raises(TooLarge, match="more than 100 steps"):
        schema_unending(many, Budget(100))
    with pytest.raises(TooLarge, match=f"more than {MAX_REFS} distinct"):
        schema_unending({"$defs": {"x": {}}, "anyOf": [{"$ref": f"#/$defs/x{i}"} for i in range(MAX_REFS + 1)]})
