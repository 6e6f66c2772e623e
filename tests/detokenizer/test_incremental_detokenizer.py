"""IncrementalDecoder on the tiny model's byte-level BPE: UTF-8 safety and exact stop strings."""

from __future__ import annotations

import random

import pytest

from tokenline.detokenizer.incremental import IncrementalDecoder

REPLACEMENT = "\ufffd"
MULTILINGUAL = "café naïve résumé über straße 你好 世界 日本語 テスト 한국어 привет мир 🙂 🚀 ✓"


def feed_all(decoder: IncrementalDecoder, ids: list[int], per_feed: int = 1) -> list[str]:
    """Feed ``ids`` in groups, as the scheduler's outputs arrive; stop feeding once stopped."""
    pieces = []
    for i in range(0, len(ids), per_feed):
        pieces.append(decoder.feed(ids[i : i + per_feed]))
        assert REPLACEMENT not in pieces[-1], f"U+FFFD after {i + per_feed} tokens: {pieces}"
        if decoder.stopped:
            break
    return pieces


def byte_ids(text: str, byte_token_ids: dict[int, int]) -> list[int]:
    return [byte_token_ids[b] for b in text.encode()]


def random_split(text: str, token_bytes: dict[int, bytes], rng: random.Random) -> list[int]:
    """Any tokenization of ``text``'s bytes, chosen at random among the vocabulary's tokens,
    so tokens end mid-character and some span the end of one character and the start of
    the next."""
    by_bytes = {}
    for token_id, raw in token_bytes.items():
        by_bytes.setdefault(raw, token_id)
    data, ids, i = text.encode(), [], 0
    while i < len(data):
        fits = [raw for raw in by_bytes if data.startswith(raw, i)]
        raw = rng.choice(fits)
        ids.append(by_bytes[raw])
        i += len(raw)
    return ids


def splits_a_character(ids: list[int], token_bytes: dict[int, bytes]) -> bool:
    return any(_invalid_utf8(token_bytes[i]) for i in ids)


def _invalid_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return True
    return False


# ── UTF-8 safety ──────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("text", ["你好", "🙂", "é", "naïve 🙂 你好!", MULTILINGUAL])
def test_multibyte_characters_fed_byte_by_byte_never_show_replacement_chars(
    tokenizer, byte_token_ids, text
):
    decoder = IncrementalDecoder(tokenizer)
    pieces = feed_all(decoder, byte_ids(text, byte_token_ids))
    assert "".join(pieces) + decoder.flush() == text


def test_each_character_appears_as_soon_as_its_last_byte_arrives(tokenizer, byte_token_ids):
    decoder = IncrementalDecoder(tokenizer)
    pieces = feed_all(decoder, byte_ids("é你🙂", byte_token_ids))
    assert pieces == ["", "é", "", "", "你", "", "", "", "🙂"]


@pytest.mark.parametrize("text", ["你好", "café 🙂", MULTILINGUAL])
def test_natural_tokenization_reconstructs_the_text(tokenizer, text):
    ids = tokenizer.encode(text).ids
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(feed_all(decoder, ids)) + decoder.flush() == text


def test_random_token_boundaries_reconstruct_the_exact_text(tokenizer, token_bytes):
    rng = random.Random(0)
    straddling = 0
    for _ in range(20):
        ids = random_split(MULTILINGUAL, token_bytes, rng)
        straddling += splits_a_character(ids, token_bytes)
        for per_feed in (1, 3):
            decoder = IncrementalDecoder(tokenizer)
            assert "".join(feed_all(decoder, ids, per_feed)) + decoder.flush() == MULTILINGUAL
    assert straddling >= 10, "the random splits should mostly cut characters apart"


def test_special_tokens_are_not_shown(tokenizer):
    ids = [*tokenizer.encode("hello").ids, tokenizer.token_to_id("<|end|>")]
    decoder = IncrementalDecoder(tokenizer)
    assert "".join(feed_all(decoder, ids)) + decoder.flush() == "hello"


# ── stop strings ──────────────────────────────────────────────────────────────────────────────
SENTENCE = "The quick brown fox jumps over the lazy dog, 你好 🙂 and more"


def stopped_text(tokenizer, ids, stop, per_feed=1) -> tuple[str, bool]:
    decoder = IncrementalDecoder(tokenizer, stop)
    text = "".join(feed_all(decoder, ids, per_feed))
    if not decoder.stopped:
        text += decoder.flush()
    return text, decoder.stopped


@pytest.mark.parametrize("split", ["natural", "bytes", "random"])
@pytest.mark.parametrize("per_feed", [1, 4, 1000], ids=["1-per-feed", "4-per-feed", "all-at-once"])
@pytest.mark.parametrize(
    "stop, expected",
    [
        (["fox"], "The quick brown "),
        (["brown fox jumps"], "The quick "),  # spans several tokens
        (["lazy", "quick"], "The "),  # the earliest match wins, not the first listed
        (["quick brown", "ick"], "The qu"),  # the first to complete, as vLLM picks it
        (["好 🙂"], "The quick brown fox jumps over the lazy dog, 你"),
        (["never there", "dog"], "The quick brown fox jumps over the lazy "),
    ],
)
def test_stop_string_cuts_the_text_exactly(
    tokenizer, byte_token_ids, token_bytes, split, per_feed, stop, expected
):
    ids = {
        "natural": lambda: tokenizer.encode(SENTENCE).ids,
        "bytes": lambda: byte_ids(SENTENCE, byte_token_ids),
        "random": lambda: random_split(SENTENCE, token_bytes, random.Random(len(expected))),
    }[split]()
    assert stopped_text(tokenizer, ids, stop, per_feed) == (expected, True)


@pytest.mark.parametrize("split", ["natural", "bytes", "random"])
@pytest.mark.parametrize("per_feed", [1, 4, 1000], ids=["1-per-feed", "4-per-feed", "all-at-once"])
@pytest.mark.parametrize(
    "stop, expected",
    [
        (["fox"], "The quick brown fox"),
        (["brown fox jumps"], "The quick brown fox jumps"),
        (["quick brown", "ick"], "The quick"),
        (["好 🙂"], "The quick brown fox jumps over the lazy dog, 你好 🙂"),
    ],
)
def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(
    tokenizer, byte_token_ids, token_bytes, split, per_feed, stop, expected
):
    """vLLM's include_stop_str_in_output: nothing held back, the stop string kept, a stop
    string begun in text already emitted still ends it."""
    ids = {
        "natural": lambda: tokenizer.encode(SENTENCE).ids,
        "bytes": lambda: byte_ids(SENTENCE, byte_token_ids),
        "random": lambda: random_split(SENTENCE, token_bytes, random.Random(len(expected))),
    }[split]()
    decoder = IncrementalDecoder(tokenizer, stop, include_stop=True)
    pieces = feed_all(decoder, ids, per_feed)
    assert decoder.stopped and "".join(pieces) == expected and decoder.flush() == ""
    if per_feed == 1 and split == "natural":  # each token's text as soon as it decodes
        assert all(pieces[:-1])


def test_stop_string_spans_several_natural_tokens(tokenizer):
    assert len(tokenizer.encode("brown fox jumps").ids) > 2  # guards the case above


def test_stop_string_across_the_holdback_boundary(tokenizer):
    """The stop string starts in text held back by one feed and ends in the next."""
    decoder = IncrementalDecoder(tokenizer, ["world!"])
    first = decoder.feed(tokenizer.encode("hello wor").ids)
    assert not decoder.stopped
    assert "hello ".startswith(first), f"emitted {first!r}, which may be part of the stop"
    second = decoder.feed(tokenizer.encode("ld! and more").ids)
    assert decoder.stopped
    assert first + second == "hello "


def test_held_back_text_is_released_when_the_stop_string_does_not_complete(tokenizer):
    decoder = IncrementalDecoder(tokenizer, ["world!"])
    first = decoder.feed(tokenizer.encode("hello wor").ids)
    second = decoder.feed(tokenizer.encode("ld? and more text").ids)
    assert not decoder.stopped
    assert first + second + decoder.flush() == "hello world? and more text"
    assert "hello world? and more".startswith(first + second)


def test_flush_returns_held_back_text_when_no_stop_matched(tokenizer):
    decoder = IncrementalDecoder(tokenizer, ["zzzz"])
    text = "the end is near zz"  # ends with what could still have become the stop string
    emitted = "".join(feed_all(decoder, tokenizer.encode(text).ids))
    assert not decoder.stopped
    held = decoder.flush()
    assert held and held.endswith("zz")
    assert emitted + held == text
    assert decoder.flush() == ""


def test_without_stop_strings_nothing_is_held_back(tokenizer):
    ids = tokenizer.encode("hello world and more").ids
    decoder = IncrementalDecoder(tokenizer)
    pieces = feed_all(decoder, ids)
    assert all(pieces) and "".join(pieces) == "hello world and more"
    assert decoder.flush() == ""


def test_stop_strings_are_looked_for_only_after_min_tokens(tokenizer):
    """As vLLM: no stop string ends a reply within its first ``min_tokens`` tokens, and the
    text they made is never matched later; from then on a stop string ends it."""
    ids = tokenizer.encode("the end, then the end again").ids
    first_end = len(tokenizer.encode("the end").ids)
    decoder = IncrementalDecoder(tokenizer, ["end"], min_tokens=first_end)
    pieces = feed_all(decoder, ids)
    assert decoder.stopped
    assert "".join(pieces) == "the end, then the "
    plain = IncrementalDecoder(tokenizer, ["end"])
    assert "".join(feed_all(plain, ids)) == "the " and plain.stopped


def test_nothing_comes_out_after_a_stop(tokenizer):
    decoder = IncrementalDecoder(tokenizer, ["STOP"])
    assert decoder.feed(tokenizer.encode("a STOP b").ids) == "a "
    assert decoder.stopped
    assert decoder.feed(tokenizer.encode(" more").ids) == "" and decoder.emit("x") == ""
    assert decoder.flush() == ""
