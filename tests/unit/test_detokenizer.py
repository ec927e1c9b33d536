from __future__ import annotations

from engine.core.detokenizer import IncrementalDetokenizer
from engine.model.tiny_tokenizer import build_tokenizer

TOK = build_tokenizer(512)


def stream(text: str, stop: tuple[str, ...] = (), keep_stop: bool = False,
           deltas: list[str] | None = None) -> tuple[str, bool, IncrementalDetokenizer]:
    ids = TOK.encode(text).ids
    d = IncrementalDetokenizer(TOK, TOK.encode("Prompt:").ids, stop, keep_stop=keep_stop)
    out = ""
    for t in ids:
        delta, stopped = d.append(t)
        out += delta
        if deltas is not None:
            deltas.append(delta)
        if stopped:
            return out, True, d
    return out + d.flush(), False, d


def test_incremental_text_equals_one_shot_decode() -> None:
    text = "Hello world, the quick brown fox jumps over the lazy dog. ünïcödé ✓ 日本"
    out, stopped, _ = stream(text)
    assert out == text and not stopped


def test_stop_string_cuts_text_and_never_leaks_a_partial_stop() -> None:
    out, stopped, d = stream("the quick brown fox jumps", stop=("brown f",))
    assert stopped and out == "the quick " and d.text == "the quick "


def test_stop_string_split_across_many_tokens() -> None:
    out, stopped, _ = stream("abc STOP def", stop=("STOP", "zzz"))
    assert stopped and out == "abc "


def test_a_kept_stop_string_ends_the_text_and_nothing_is_held_back_before_it() -> None:
    """include_stop_str_in_output: the text is cut after the stop string, not before; the first
    to start wins (of two starting there, the longer); text streams as it comes (whatever
    follows, it is output), so no token's text waits for the next."""
    deltas: list[str] = []
    out, stopped, d = stream("abc STOP def", stop=("zzz", "STOP"), keep_stop=True, deltas=deltas)
    assert stopped and out == d.text == "abc STOP"
    assert "".join(deltas) == out and all(deltas[:-1])  # each token's text at once, none held back
    out, stopped, _ = stream("abc STOP def", stop=("STO", "STOP"), keep_stop=True)
    assert stopped and out == "abc STO"  # it is complete a token before the longer one
    out, stopped, _ = stream("abc STOP def", stop=("a", "ab", "bc"), keep_stop=True)  # "ab" is one token
    assert stopped and out == "ab"


def test_no_stop_found_flushes_held_back_text() -> None:
    out, stopped, _ = stream("hello there", stop=("xyz",))
    assert out == "hello there" and not stopped


def test_tokenizer_is_deterministic() -> None:
    assert build_tokenizer(512, seed=3).to_str() == build_tokenizer(512, seed=3).to_str()


def test_an_output_ends_at_a_stop_token_or_a_special_one_only_when_specials_are_kept() -> None:
    from engine.model.tiny_tokenizer import EOS_ID

    word = TOK.encode(" hello").ids[0]
    kept = IncrementalDetokenizer(TOK, [], (), skip_special_tokens=False, special_ids=frozenset({EOS_ID}))
    assert kept.ends_output(EOS_ID, ()) and kept.ends_output(word, (word,))
    assert not kept.ends_output(word, ())
    skipped = IncrementalDetokenizer(TOK, [], (), special_ids=frozenset({EOS_ID}))
    assert not skipped.ends_output(EOS_ID, ()) and not skipped.ends_output(word, (word,))  # their text is empty


def test_extend_takes_tokens_up_to_the_one_that_completes_a_stop_string() -> None:
    """The one loop the engine's output and the router's replies share: the tokens after the
    one that stopped are not taken; tokens past `num_text` are taken without text."""
    ids = TOK.encode("abc STOP def").ids
    d = IncrementalDetokenizer(TOK, TOK.encode("Prompt:").ids, ("STOP",))
    text, kept, stopped = d.extend(ids)
    one = IncrementalDetokenizer(TOK, TOK.encode("Prompt:").ids, ("STOP",))
    at = next(i for i in range(len(ids)) if one.append(ids[i])[1])  # the token that completes "STOP"
    assert (text, kept, stopped) == ("abc ", at + 1, True) and kept < len(ids)
    plain = IncrementalDetokenizer(TOK, TOK.encode("Prompt:").ids, ())
    text, kept, stopped = plain.extend(ids, num_text=len(ids) - 1)
    assert (kept, stopped) == (len(ids), False) and text + plain.flush() == TOK.decode(ids[:-1])
