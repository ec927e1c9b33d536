"""A deterministic byte-level BPE tokenizer built without training.

Vocabulary: special tokens, the 256 byte-level symbols, then left-to-right merges
of common English words and seeded pseudo-words until `vocab_size` is reached. The
result depends only on (vocab_size, seed), so checkpoints are byte-for-byte
reproducible and need no corpus or network.
"""
from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
_WORDS = (
    "the of and to in is was for that with as on by at from his her he she it they "
    "we you be are were have has had not but or which this an all their there one "
    "would what so up out if about who get go me when make can like time no just him "
    "know take people into year your good some could them see other than then now look "
    "only come its over think also back after use two how our work first well way even "
    "new want because any these give day most us hello world model token cache block "
    "request prefill decode serve fast quick brown fox jumps lazy dog once upon story"
).split()
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def _byte_symbols() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda s: ord(s))


def _words(seed: int):
    for w in _WORDS:
        yield "Ġ" + w
        yield w
    rng = random.Random(seed)
    while True:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        yield "Ġ" + w if rng.random() < 0.7 else w


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    vocab: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for sym in _byte_symbols():
        vocab[sym] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be at least {len(vocab)}, got {vocab_size}")
    merges: list[tuple[str, str]] = []
    words = _words(seed)
    while len(vocab) < vocab_size:
        w = next(words)
        for i in range(2, len(w) + 1):
            if w[:i] not in vocab and len(vocab) < vocab_size:
                merges.append((w[: i - 1], w[i - 1]))
                vocab[w[:i]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok
