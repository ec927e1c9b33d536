"""Structured output: a request's `Constraint` as an llguidance matcher over the model's
tokenizer, and the per-step mask of the tokens it allows (torch-free: routers validate here too).

    Constraint (kind, value) --`grammar_text`--> llguidance grammar (JSON schema, regex,
        choice, Lark; GBNF converted to Lark), refused when it has no finite output
        (engine/structured/grammar_finite.py: llguidance compiles those without a word)
    --Grammars.matcher(constraint)--> a fresh matcher: compiled once per distinct constraint
        (an LRU of `max_entries` by content, each entry a matcher in its start state that is
        deep-copied per request), within llguidance's parser limits
    engine: the matcher consumes the tokens already generated under the constraint (the
        request's `constraint_prefix` prompt tokens, a decode worker's first token), then
        each step: `allowed_rows(matchers)` -> a boolean mask over the vocabulary, applied to the
        logits before sampling; the sampled tokens are consumed; EOS is allowed exactly when
        the constraint is complete, and a request whose constraint is complete and allows
        nothing more stops

llguidance (not xgrammar): it is one small dependency-free wheel (xgrammar pulls in triton
and a torch build), computes a mask in tens of microseconds on CPU with no precomputation
per grammar, covers JSON Schema broadly, and takes Lark grammars (GBNF converts), regexes
and choices directly. State is rebuilt from tokens wherever a request runs (prefill worker,
decode worker, a retry elsewhere), never shipped between processes.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from engine.structured.grammar_finite import TooLarge, lark_unending, schema_unending
from engine.core.request import Constraint
from engine.types import InvalidRequestError

MAX_ENTRIES = 256
"""Distinct constraints kept compiled (a flood of distinct schemas evicts, never grows)."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as OpenAI's structured outputs write it: one space after , and :, no other whitespace
(a schema's own "x-guidance" options override it)."""
LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              max_lexer_states=100_000)
"""llguidance's parser limits: compile and per-step work are bounded (its fuel is ~50k/ms)."""


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar of a constraint (InvalidRequestError for malformed JSON)."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.value)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not JSON: {e}") from None
        except RecursionError:
            raise InvalidRequestError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be a JSON object")
        unending = schema_unending(schema)
        if unending:
            raise InvalidRequestError(
                f"the JSON schema has no finite instance: {', '.join(unending)} requires itself without end "
                "(make the recursive property optional, or give it an alternative that ends)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema cannot be used: {e}") from None
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.value)
    if c.kind == "choice":
        try:
            options = json.loads(c.value)
        except ValueError:
            options = None
        if not (isinstance(options, list) and options and all(isinstance(o, str) and o for o in options)):
            raise InvalidRequestError("a choice is a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
    try:
        lark = gbnf_to_lark(c.value) if "::=" in c.value else c.value
    except Exception as e:  # noqa: BLE001  (the converter raises bare Exceptions for a rule it cannot find)
        raise InvalidRequestError(f"the GBNF grammar cannot be read: {str(e)[:300]}") from None
    unending = lark_unending(lark)
    if unending:
        raise InvalidRequestError(
            f"the grammar has no finite output: rule {', '.join(unending)} cannot end (each alternative needs "
            "a rule that cannot end; give one an alternative that ends)")
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammars:
    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: Sequence[int],
                 max_entries: int = MAX_ENTRIES) -> None:
        """`tokenizer_json`: the model's tokenizer.json text (None: syntax checks only, no masks)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = (llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_token_ids)
                          if tokenizer_json is not None else None)
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self.max_entries = max_entries
        self._pool: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher | str | InvalidRequestError] = OrderedDict()
        """Content hash -> a matcher in its start state (or, without a tokenizer, the grammar),
        or why it was refused."""

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars:
        path = Path(model_dir) / "tokenizer.json"
        return cls(path.read_text() if path.is_file() else None, vocab_size, eos_token_ids)

    def check(self, c: Constraint) -> None:
        """Raises InvalidRequestError naming the problem when the constraint cannot be compiled."""
        self._entry(c)

    def matcher(self, c: Constraint) -> llguidance.LLMatcher:
        """A matcher for `c` in its start state (compiled once, copied per request)."""
        entry = self._entry(c)
        if isinstance(entry, str):
            raise InvalidRequestError("structured output needs the model's tokenizer.json")
        return entry.deep_copy()

    def _entry(self, c: Constraint) -> llguidance.LLMatcher | str:
        """The compiled constraint, or InvalidRequestError; either is kept (a refused one is
        refused again at once: sending it again costs nothing)."""
        key = hashlib.sha256(f"{c.kind}\0{c.value}".encode()).hexdigest()
        entry = self._compiled.get(key)
        if entry is None:
            try:
                entry = self._compile(c)
            except InvalidRequestError as e:
                entry = e
            self._compiled[key] = entry
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        if isinstance(entry, InvalidRequestError):
            raise InvalidRequestError(str(entry))
        return entry

    def _compile(self, c: Constraint) -> llguidance.LLMatcher | str:
        try:
            grammar = grammar_text(c)
        except TooLarge as e:
            raise InvalidRequestError(str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"the {c.kind.replace('_', ' ')} cannot be compiled: {error.strip()}")
        if self.tokenizer is None:
            return grammar
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidRequestError(f"the {c.kind.replace('_', ' ')} cannot be compiled: {matcher.get_error()}")
        return matcher

    def __len__(self) -> int:
        return len(self._compiled)

    def allowed_rows(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), vocab_size] bool: each matcher's allowed tokens, computed in parallel
        (llguidance's threads, without the GIL)."""
        words = np.empty((len(matchers), (self.vocab_size + 31) // 32), dtype=np.int32)
        self._executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], words.ctypes.data,
                                                 words.shape[1] * 4, len(matchers))
        return np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size].astype(bool)

    def _executor(self) -> llguidance.LLExecutor:
        if self._pool is None:
            self._pool = llguidance.LLExecutor()
        return self._pool



def consume(matcher: llguidance.LLMatcher, tokens: Sequence[int], what: str) -> None:
    """The matcher takes `tokens` (already generated under it); InvalidRequestError if it cannot."""
    if tokens and not matcher.consume_tokens(list(tokens)):
        raise InvalidRequestError(f"{what} do not follow the constraint: {matcher.get_error()}")
