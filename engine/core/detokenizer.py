"""Incremental detokenization and stop strings, one object per request.

Decodes a sliding window of ids (a few tokens of context before the unread ones), so
each step costs O(window), and holds back text while it ends in an incomplete UTF-8
sequence. Stop strings are searched only in the tail that the new text can complete.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool = True, special_ids: frozenset[int] = frozenset(),
                 keep_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = special_ids
        """The tokenizer's special tokens' ids (the caller's cached set): what ends_output knows
        as special; skipped ones need none."""
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._emitted = 0
        self.stop = stop
        self.keep_stop = keep_stop
        """The stop string that ends the text stays in it."""
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._held = 0 if keep_stop else self._max_stop_len - 1
        """How much of the text's end may still turn out to be a stop string's start, and so is
        not emitted yet (none when the stop string is kept: text before it is output either way)."""

    def ends_output(self, token_id: int, stop_token_ids: tuple[int, ...]) -> bool:
        """Whether `token_id`, the last of an output that stopped, is its stop token (a stop
        token id or a special token such as EOS: not a constrained output's last token) whose
        text the output leaves out; with special tokens skipped it has none anyway."""
        if self.skip_special_tokens:
            return False
        return token_id in stop_token_ids or token_id in self.special_ids

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (new text, whether a stop string ended the text)."""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return "", False
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append_text(delta)

    def extend(self, token_ids: Sequence[int], num_text: int | None = None) -> tuple[str, int, bool]:
        """Appends tokens in order until one completes a stop string: the text they add, how many
        were taken (all, or up to the one that stopped), and whether one stopped. Only the first
        `num_text` (None: all) become text; the rest are taken without (the stop token that ends
        an output)."""
        text = ""
        for i, token_id in enumerate(token_ids):
            if num_text is not None and i >= num_text:
                break
            piece, stopped = self.append(token_id)
            text += piece
            if stopped:
                return text, i + 1, True
        return text, len(token_ids), False

    def _append_text(self, delta: str) -> tuple[str, bool]:
        """Text may be emitted only once no stop string can still start inside it."""
        start = len(self.text)
        self.text += delta
        if not self.stop:
            self._emitted = len(self.text)
            return delta, False
        search_from = max(0, start - self._max_stop_len + 1)
        hits = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, minus_length = min(hits)  # the first to start (of two there, the longer)
            self.text = self.text[: at - minus_length if self.keep_stop else at]
            return self.flush(), True
        safe = len(self.text) - self._held
        if safe <= self._emitted:
            return "", False
        out, self._emitted = self.text[self._emitted : safe], safe
        return out, False

    def flush(self) -> str:
        """Text held back for stop-string matching; call when the request finishes."""
        out, self._emitted = self.text[self._emitted :], len(self.text)
        return out
