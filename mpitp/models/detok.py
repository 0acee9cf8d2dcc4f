"""Streaming detokenization: the text of each new token, at a cost that does not grow
with the text (``tokenizers``' DecodeStream keeps only the few ids a character may still
need). A character split across byte-level tokens (emoji, CJK) is held back until its
last byte arrives, so a half character is never printed."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still partial)."""
        return self._stream.step(self.tokenizer, int(token_id)) or ""
