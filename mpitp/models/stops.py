"""Stop strings, matched on the decoded text across token boundaries.

A stop string may end inside a token, or span several; each sequence's text is decoded
incrementally (:class:`mpitp.models.detok.TextStream`) and searched after every token.
While streaming, text that could still be the start of a stop string is held back, so a
stop string is never printed, not even in part::

    stops ["\\n\\n"]    tokens "Hi" "!\\n" "\\nBye"   ->   prints "Hi", "!", then stops (text "Hi!")
"""

from __future__ import annotations

from .detok import TextStream


class StopText:
    def __init__(self, tokenizer, stops: list[str]):
        self.stream = TextStream(tokenizer)
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything decoded so far
        self.shown = 0  # characters handed out by ``push``
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Text now safe to show (never part of a stop string)."""
        if self.stopped:
            return ""
        piece = self.stream.push(token_id)
        start = max(0, len(self.text) - self.keep)
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            out, self.shown = self.text[self.shown :], len(self.text)
            return out
        safe = len(self.text) - self.keep if self.stops else len(self.text)
        out = self.text[self.shown : max(safe, self.shown)]
        self.shown += len(out)
        return out

    def flush(self) -> str:
        """The held-back rest, once the sequence has ended without a stop string."""
        out, self.shown = self.text[self.shown :], len(self.text)
        return out
