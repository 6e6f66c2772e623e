"""Token texts and bytes for logprobs: bytes of consecutive tokens rebuild the exact text, even
where a token holds only part of a multi-byte character."""

from __future__ import annotations

from tokenline.detokenizer.token_text import TokenTexts
from tokenline.protocol import TokenLogprobs


def test_bytes_of_each_token_join_into_the_text(tokenizer):
    texts = TokenTexts(tokenizer)
    text = "café 你好 世界 🙂 привет hello 𝄞 😀 ẞ 漢"  # the last four were never trained on
    ids = tokenizer.encode(text).ids
    pieces = [texts.get(i) for i in ids]
    assert any("\ufffd" in t for t, _ in pieces), "the text should split a character"
    assert b"".join(bytes(b) for _, b in pieces) == text.encode()
    for t, b in pieces:
        if "\ufffd" not in t:
            assert bytes(b).decode() == t


def test_entry_renders_the_token_and_its_alternatives(tokenizer):
    texts = TokenTexts(tokenizer)
    hello, world = tokenizer.encode("hello").ids[0], tokenizer.encode(" world").ids[0]
    entry = texts.entry(
        TokenLogprobs(token_id=hello, logprob=-0.5, top_ids=[hello, world], top_logprobs=[-0.5, -2])
    )
    assert entry.token == tokenizer.decode([hello])
    assert entry.bytes == list(entry.token.encode())
    assert [(t.token, t.logprob) for t in entry.top] == [
        (tokenizer.decode([hello]), -0.5),
        (tokenizer.decode([world]), -2),
    ]
