"""The first generated token's text, in the prompt's context, for byte-level and SentencePiece
(Metaspace) tokenizers alike: the stream is primed with the prompt's last ids."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenline.detokenizer.incremental import IncrementalDecoder

CORPUS = [
    "the river runs past the old mountain road",
    "a blue light far over the stone bridge",
    "hello world, hello river, hello mountain",
] * 20


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> Tokenizer:
    """A Llama-2/Mistral-style tokenizer: Metaspace pieces ("▁world"), built offline."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _streamed(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    decoder = IncrementalDecoder(tokenizer, prompt_tail=prompt_ids[-8:])
    text = "".join(decoder.feed([token]) for token in output_ids)
    return text + decoder.flush()


def test_metaspace_streams_the_text_the_whole_sequence_decodes_to(metaspace_tokenizer):
    encoding = metaspace_tokenizer.encode("hello world the river runs far")
    ids = encoding.ids
    word_starts = [i for i, piece in enumerate(encoding.tokens) if i and piece.startswith("▁")]
    assert len(word_starts) >= 3
    for split in word_starts:
        prompt, output = ids[:split], ids[split:]
        whole = metaspace_tokenizer.decode(prompt + output)
        expected = whole[len(metaspace_tokenizer.decode(prompt)) :]
        assert expected.startswith(" ")  # the first output piece starts a word
        assert _streamed(metaspace_tokenizer, prompt, output) == expected
        # started empty, as before priming, the leading space is lost
        unprimed = IncrementalDecoder(metaspace_tokenizer)
        assert "".join(unprimed.feed([t]) for t in output) + unprimed.flush() != expected


def test_byte_level_streams_exactly_the_decoded_output(tiny_tokenizer):
    backend = tiny_tokenizer.backend_tokenizer
    prompt = backend.encode("Tell me about the river").ids
    output = backend.encode(" and the mountain, é ü 日本").ids
    assert _streamed(backend, prompt, output) == backend.decode(output)


def test_logprob_texts_keep_a_metaspace_tokens_leading_space(metaspace_tokenizer):
    """Each token's logprob text reads as it does in the text, so they join into it (and a
    completion's text_offset counts right): "▁world" is " world", not "world"."""
    from tokenline.detokenizer.token_text import TokenTexts

    texts = TokenTexts(metaspace_tokenizer)
    prompt = metaspace_tokenizer.encode("hello").ids
    output = metaspace_tokenizer.encode("hello world the river").ids[len(prompt) :]
    whole = metaspace_tokenizer.decode(prompt + output)
    expected = whole[len(metaspace_tokenizer.decode(prompt)) :]
    assert expected.startswith(" ")
    pieces = [texts.get(t) for t in output]
    assert "".join(text for text, _ in pieces) == expected
    assert b"".join(bytes(raw) for _, raw in pieces) == expected.encode()
