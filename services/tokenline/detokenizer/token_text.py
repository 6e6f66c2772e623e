"""Token ids to the text and bytes that logprobs report, one token at a time, cached per id."""

from __future__ import annotations

import re
from collections.abc import Collection

from tokenline.protocol import LogprobEntry, TokenLogprobs, TopLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each printable stand-in char to its byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


class TokenTexts:
    """Text of a token decoded alone, and its bytes.

    A byte-level token that holds part of a multi-byte character decodes to U+FFFD; its
    ``bytes`` are then the raw token's own bytes (byte-level BPE or ``<0xNN>`` byte fallback),
    so a client can join the bytes of consecutive tokens into the exact text.
    """

    def __init__(
        self,
        tokenizer,  # tokenizers.Tokenizer
        max_cached: int = 1 << 20,
        shown: Collection[int] = (),
        special: Collection[int] = (),
    ) -> None:
        """``shown``: the special tokens a request that keeps special tokens sees as text;
        ``special``: every special token, as a prompt's tokens show them (the prompt the model
        saw, as an echo gives it back)."""
        self._tokenizer = tokenizer
        self._anchor = tokenizer.encode("a", add_special_tokens=False).ids
        self._anchor_text = tokenizer.decode(self._anchor)
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._max_cached = max_cached
        self._shown = {i: self._of(i, skip_special_tokens=False) for i in shown}
        self._special = {i: self._of(i, skip_special_tokens=False) for i in special}

    def __len__(self) -> int:
        return len(self._cache)

    def get(
        self, token_id: int, skip_special_tokens: bool = True, prompt: bool = False
    ) -> tuple[str, list[int]]:
        if prompt and token_id in self._special:
            return self._special[token_id]
        if not skip_special_tokens and token_id in self._shown:
            return self._shown[token_id]
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._of(token_id)
            if len(self._cache) < self._max_cached:
                self._cache[token_id] = hit
        return hit

    def _of(self, token_id: int, skip_special_tokens: bool = True) -> tuple[str, list[int]]:
        text = self._in_text(token_id, skip_special_tokens)
        return text, self._bytes(token_id, text)

    def _in_text(self, token_id: int, skip_special_tokens: bool) -> str:
        """The token's text as it reads inside a text: decoded after a plain word, because a
        SentencePiece (Metaspace) decoder drops the leading space of a sequence's first piece
        ("▁world" alone is "world", mid-text " world"); byte-level tokens read the same."""
        decode = self._tokenizer.decode
        after = decode([*self._anchor, token_id], skip_special_tokens=skip_special_tokens)
        if self._anchor_text and after.startswith(self._anchor_text):
            return after[len(self._anchor_text) :]
        return decode([token_id], skip_special_tokens=skip_special_tokens)

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if "\ufffd" in text:
            raw = self._tokenizer.id_to_token(token_id)
            if raw:
                fallback = _BYTE_FALLBACK.fullmatch(raw)
                if fallback:
                    return [int(fallback.group(1), 16)]
                if all(c in _BYTE_LEVEL for c in raw):
                    return [_BYTE_LEVEL[c] for c in raw]
        return list(text.encode())

    def entry(
        self, logprobs: TokenLogprobs, skip_special_tokens: bool = True, prompt: bool = False
    ) -> LogprobEntry:
        """``prompt``: a prompt token's, special tokens shown whatever the request skips."""
        text, raw = self.get(logprobs.token_id, skip_special_tokens, prompt)
        top = []
        for token_id, value in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True):
            top_text, top_raw = self.get(token_id, skip_special_tokens, prompt)
            top.append(TopLogprob(token=top_text, logprob=value, bytes=top_raw))
        return LogprobEntry(token=text, logprob=logprobs.logprob, bytes=raw, top=top)
