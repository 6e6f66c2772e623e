"""Incremental, UTF-8 safe detokenization of one request, with exact stop strings.

tokenizers' `DecodeStream` holds back bytes until they form whole characters, so a multi-byte
character split across tokens never shows up as U+FFFD. Stop strings are matched on the text;
text that could still become a stop string is held back until it cannot. As in vLLM, the stop
string that completes first wins (ties: the first listed), and with
``include_stop_str_in_output`` nothing is held back and the text ends after the stop string.
"""

from __future__ import annotations

from collections.abc import Collection

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

RECENT = 8  # ids kept to prime a restarted stream: a character spans at most four


class IncrementalDecoder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str] | None = None,
        prompt_tail: list[int] | None = None,
        skip_special_tokens: bool = True,
        hidden: Collection[int] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        """``skip_special_tokens`` False keeps special tokens in the text (a tool format whose
        markers are special tokens), but for ``hidden``: ids never shown as text (the
        model's end-of-sequence and other control tokens). ``min_tokens``: as vLLM, stop
        strings are looked for only once more tokens than that have come, in the text they
        add from then on."""
        self._tokenizer = tokenizer
        # Primed with the prompt's last ids, as vLLM primes it: a SentencePiece decoder drops
        # the leading space of a sequence's first piece, and the first generated token is not
        # the sequence's first piece.
        self._skip_special_tokens = skip_special_tokens
        self._recent = list(prompt_tail or [])[-RECENT:]  # the last ids, to prime a restart
        self._stream = DecodeStream(
            ids=_whole_characters(tokenizer, self._recent), skip_special_tokens=skip_special_tokens
        )
        self._hidden = frozenset() if skip_special_tokens else frozenset(hidden)
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop
        longest = max((len(s) for s in self._stop), default=1) - 1
        # Held back: what may start a stop string, unless the stop string is text too. Then
        # the emitted text's last characters are kept to match a stop string begun in them.
        self._holdback = 0 if include_stop else longest
        self._tail = ""  # the emitted text's last characters (include_stop only)
        self._tail_len = longest if include_stop else 0
        self._text = ""  # decoded text not yet emitted
        self._min_tokens = min_tokens
        self._tokens = 0  # every id decoded, hidden ones too (vLLM counts every output token)
        self.stopped = False

    def feed(self, token_ids: list[int]) -> str:
        """Text that is now safe to emit. Sets ``stopped`` when a stop string matched."""
        return self.emit(self.decode(token_ids))

    def decode(self, token_ids: list[int]) -> str:
        """The text these ids add, as decoded: no stop string looked for yet (`emit` does)."""
        text = ""
        for token_id in token_ids:
            self._tokens += 1
            if token_id in self._hidden:
                continue
            self._recent = [*self._recent[1 - RECENT :], token_id]
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                text += piece
        return text

    def emit(self, text: str) -> str:
        """Of the decoded text so far and ``text``, what is now safe to emit (not a possible
        stop string's start). Sets ``stopped`` when a stop string matched; after that,
        nothing more."""
        if self.stopped:
            return ""
        self._text += text
        if self._tokens <= self._min_tokens:  # no stop string yet: nothing to hold back
            return self._release(len(self._text))
        if self._stop:
            window = self._tail + self._text
            end = self._first_stop_end(window, len(self._tail))
            if end is not None:
                self.stopped = True
                return self._release(end - len(self._tail))
        return self._release(len(self._text) - self._holdback)

    def _first_stop_end(self, window: str, searched: int) -> int | None:
        """Where, in ``window``, the text up to the first stop string to complete after its
        first ``searched`` characters ends: after the stop string with include_stop, else
        before it. None: no stop string completes there."""
        best: tuple[int, int] | None = None  # (where it completes, where it starts)
        for stop in self._stop:
            start = window.find(stop, max(searched - len(stop) + 1, 0))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start)
        if best is None:
            return None
        return best[0] if self._include_stop else best[1]

    def _release(self, count: int) -> str:
        """Emit the first ``count`` characters held (none for a count of 0 or less); once
        stopped, the rest is dropped."""
        out = self._text[: max(count, 0)]
        self._text = "" if self.stopped else self._text[max(count, 0) :]
        if self._tail_len:
            self._tail = (self._tail + out)[-self._tail_len :]
        return out

    def restart(self) -> None:
        """Start a new stretch of text (the answer after the thinking): bytes of a character
        the last stretch left unfinished are dropped, not let out as the new stretch's first
        text (U+FFFD that breaks a JSON answer)."""
        self._stream = DecodeStream(
            ids=_whole_characters(self._tokenizer, self._recent),
            skip_special_tokens=self._skip_special_tokens,
        )

    def flush(self) -> str:
        """Whatever is held back, at the end of the request."""
        out, self._text = self._text, ""
        return out


def _whole_characters(tokenizer: Tokenizer, tail: list[int]) -> list[int]:
    """The prompt's tail without ids that end it partway through a character.

    A prompt sent as token ids may stop inside a multi-byte character; primed with it, the
    stream would count the prompt's unfinished character as the completion's first text.
    """
    tail = list(tail)
    for _ in range(4):  # a UTF-8 character spans at most four bytes, so four ids
        if not tail or not tokenizer.decode(tail, skip_special_tokens=True).endswith("\ufffd"):
            break
        tail.pop()
    return tail
