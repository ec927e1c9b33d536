"""Structured output in one engine (engine/structured/grammars.py, engine/structured/constrainer.py): the mask is
llguidance's, applied on the prefill side and the decode side, continued from tokens, under
speculation; compiled constraints are cached and bounded."""
from __future__ import annotations

import json
import re

import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.core.request import Constraint, SamplingParams
from engine.structured.grammars import Grammars
from engine.types import InvalidRequestError

PROMPT = [11, 12, 13, 14, 15, 16, 17]
REGEX = Constraint("regex", r"(ab|cd)[0-9]{3}(!|\?)")


def engine(model_dir: str, role: str = "both", spec: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, role=role, speculative=spec or SpeculativeConfig(),  # type: ignore[arg-type]
                                  cache=CacheConfig(block_size=4, num_blocks=128)))


def test_the_constraint_overrules_the_models_favourite_token(tiny_llama_dir: str) -> None:
    e = engine(tiny_llama_dir)
    free = e.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    constrained = e.generate([PROMPT], SamplingParams(max_tokens=10, constraint=Constraint("choice", '["zq zq"]')))[0]
    assert constrained.text == "zq zq" and constrained.finish_reason.value == "stop"
    assert constrained.token_ids[0] != free.token_ids[0]  # the unconstrained greedy token was forbidden


def test_every_kind_greedy_and_sampled_follows_its_constraint(tiny_llama_dir: str) -> None:
    e = engine(tiny_llama_dir)
    schema = {"type": "object", "required": ["k"], "additionalProperties": False,
              "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}}}
    cases = [(Constraint("json_schema", json.dumps(schema)), lambda t: json.loads(t)["k"] in range(100)),
             (REGEX, lambda t: re.fullmatch(REGEX.value, t)),
             (Constraint("choice", '["one", "two words"]'), lambda t: t in ("one", "two words")),
             (Constraint("grammar", 'root ::= "<" [a-c]+ ">"'), lambda t: re.fullmatch(r"<[a-c]+>", t))]
    for c, check in cases:
        for params in (SamplingParams(max_tokens=40, constraint=c),
                       SamplingParams(max_tokens=40, temperature=1.0, seed=5, constraint=c)):
            out = e.generate([PROMPT], params)[0]
            assert out.finish_reason.value == "stop" and check(out.text), (c.kind, out.text)
    assert e.check_invariants().num_in_use == 0


def test_a_continued_request_picks_up_the_constraint_from_its_tokens(tiny_llama_dir: str) -> None:
    e = engine(tiny_llama_dir)
    whole = e.generate([PROMPT], SamplingParams(max_tokens=20, constraint=REGEX))[0].token_ids
    sent = whole[:3]  # a retry re-prefills the prompt and the tokens sent, and asks for the rest
    rest = e.generate([PROMPT + sent], SamplingParams(max_tokens=17, constraint=REGEX, constraint_prefix=3))[0]
    assert sent + rest.token_ids == whole
    with pytest.raises(InvalidRequestError, match="do not follow the constraint"):
        e.add_request(PROMPT + [7, 7, 7], SamplingParams(constraint=REGEX, constraint_prefix=3))


def test_the_decode_side_continues_from_the_prefill_workers_first_token(tiny_llama_dir: str) -> None:
    p = engine(tiny_llama_dir)
    first = p.generate([PROMPT], SamplingParams(max_tokens=1, constraint=REGEX))[0].token_ids[0]
    d = engine(tiny_llama_dir, role="decode")
    params = SamplingParams(max_tokens=20, constraint=REGEX)
    reservation = d.connector.reserve(PROMPT, params, request_id="r")
    assert reservation is not None
    outs = d.connector.landed(reservation.request_id, first)  # (the KV is not really there: the mask still holds)
    while d.has_unfinished():
        outs += d.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens[0] == first and re.fullmatch(REGEX.value, d.tokenizer.decode(tokens))  # type: ignore[union-attr]
    bad = d.connector.reserve(PROMPT, params, request_id="bad")
    assert bad is not None
    with pytest.raises(InvalidRequestError, match="do not follow the constraint"):
        d.connector.landed(bad.request_id, 7)  # a first token the constraint forbids is refused


def test_under_speculation_proposals_are_cut_and_the_output_is_the_same(tiny_llama_dir: str) -> None:
    plain = engine(tiny_llama_dir)
    spec = engine(tiny_llama_dir, spec=SpeculativeConfig(method="draft", draft_model_dir=tiny_llama_dir))
    c = Constraint("grammar", 'root ::= ("ab" | "cd" | "ef")+ "."')
    params = [SamplingParams(max_tokens=30, constraint=c), SamplingParams(max_tokens=30, seed=3, temperature=1.0,
                                                                         constraint=c)]
    want = [o.token_ids for o in plain.generate([PROMPT, PROMPT[:5]], params)]
    assert [o.token_ids for o in spec.generate([PROMPT, PROMPT[:5]], params)] == want
    assert spec.speculator.counters.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert spec.check_invariants().num_in_use == 0


def test_compiled_constraints_are_cached_and_bounded(tiny_llama_dir: str) -> None:
    g = Grammars.for_model(tiny_llama_dir, 512, [2])
    a, b = g.matcher(REGEX), g.matcher(REGEX)
    assert len(g) == 1 and a is not b  # one compile, a fresh copy per request
    small = Grammars(None, 512, [2], max_entries=8)
    for i in range(50):  # a flood of distinct schemas
        small.check(Constraint("json_schema", json.dumps({"type": "object", "properties": {f"p{i}": {}}})))
    assert len(small) == 8
    with pytest.raises(InvalidRequestError, match="at most 65536"):
        Constraint("regex", "a" * 70000)


def test_on_the_real_model_every_kind_parses_where_one_engine_prefills_and_decodes(
        smollm2_gguf: str, smollm2_dir: str) -> None:
    """The colocated path on the embedded SmolLM2 (the cluster tests run it disaggregated)."""
    import jsonschema
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{smollm2_dir}/tokenizer.json")
    person = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0}}}
    cases = [("Invent a person as JSON:", Constraint("json_schema", json.dumps(person)),
              lambda t: jsonschema.validate(json.loads(t), person) is None),
             ("Here is a JSON object describing the city of Paris, with its name and country:\n",
              Constraint("json_object", ""),
              lambda t: isinstance(json.loads(t), dict)),
             ("Call 555-", Constraint("regex", r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             ("Is the sky blue? Answer:", Constraint("choice", '[" yes", " no"]'), lambda t: t in (" yes", " no")),
             ("Count to three:", Constraint("grammar", 'root ::= (" " [0-9]{1,2} ","){2} " " [0-9]{1,2} "."'),
              lambda t: re.fullmatch(r"( [0-9]{1,2},){2} [0-9]{1,2}\.", t))]
    e = LLMEngine(EngineConfig(model_dir=smollm2_gguf, cache=CacheConfig(block_size=16, num_blocks=256)))
    prompts, params = [], []
    for text, c, _ in cases:
        for p in (SamplingParams(max_tokens=120, constraint=c),
                  SamplingParams(max_tokens=120, temperature=0.7, seed=3, constraint=c)):
            prompts.append(tok.encode(text).ids)
            params.append(p)
    outs = e.generate(prompts, params)
    for i, out in enumerate(outs):
        _, c, check = cases[i // 2]
        assert out.finish_reason.value == "stop" and check(out.text), (c.kind, out.text)
    assert e.check_invariants().num_in_use == 0
