"""The tiny model's byte-level BPE tokenizer, and the ids of its single-byte tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tokenline import model_source, tiny_model


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: which printable character stands for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    # The same cache directory as tests/scheduler, so the tiny model is built once per session.
    cache = tmp_path_factory.getbasetemp() / "tiny-model-cache"
    tiny_model.ensure_cached(cache)
    source = model_source.resolve("tiny", cache_dir=str(cache))
    return source.load_tokenizer().backend_tokenizer


@pytest.fixture(scope="session")
def byte_alphabet() -> dict[int, str]:
    return _bytes_to_unicode()


@pytest.fixture(scope="session")
def byte_token_ids(tokenizer: Tokenizer, byte_alphabet: dict[int, str]) -> dict[int, int]:
    """Token id of every single byte 0..255."""
    from tokenizers import pre_tokenizers

    assert set(byte_alphabet.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = tokenizer.get_vocab()
    return {byte: vocab[char] for byte, char in byte_alphabet.items()}


@pytest.fixture(scope="session")
def token_bytes(tokenizer: Tokenizer, byte_alphabet: dict[int, str]) -> dict[int, bytes]:
    """The raw bytes of every non-special token."""
    to_byte = {char: byte for byte, char in byte_alphabet.items()}
    out = {}
    for piece, token_id in tokenizer.get_vocab().items():
        if all(char in to_byte for char in piece):
            out[token_id] = bytes(to_byte[char] for char in piece)
    return out
