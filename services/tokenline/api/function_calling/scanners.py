"""Where a bracketed value that arrives in pieces closes, for the stream parsers: a JSON
object (a call's arguments) or an item of a Python list (a pythonic call)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class Nesting:
    """Where a bracketed value that arrives in pieces closes: its depth, the quote of the
    string it is in (brackets there do not count) and whether the last character escaped the
    next. Subclasses say which characters quote, open and close."""

    QUOTES: ClassVar[str] = '"'
    OPENS: ClassVar[str] = "{["
    CLOSES: ClassVar[str] = "}]"

    depth: int = 0
    quote: str = ""
    escaped: bool = False

    def close(self, text: str, start: int = 0) -> int | None:
        """The index after where the value closes in ``text[start:]``; None: not there."""
        for i in range(start, len(text)):
            char = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = ""
            elif char in self.QUOTES:
                self.quote = char
            elif char in self.OPENS:
                self.depth += 1
            elif char in self.CLOSES:
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class ObjectScanner(Nesting):
    """Where a JSON object that arrives in pieces ends."""

    closed: bool = False

    def take(self, text: str) -> int:
        """How much of ``text`` belongs to the object (all of it until it closes)."""
        end = self.close(text)
        if end is None:
            return len(text)
        self.closed = True
        return end


@dataclass
class PythonScanner(Nesting):
    """Where each item of a Python list that arrives in pieces ends."""

    QUOTES = "\"'"
    OPENS = "([{"
    CLOSES = ")]}"

    def item_end(self, text: str, start: int) -> tuple[int, bool]:
        """(index after an item that closes in ``text[start:]``, True) or (len, False)."""
        end = self.close(text, start)
        return (len(text), False) if end is None else (end, True)
