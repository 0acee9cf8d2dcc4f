"""Structured output: ``response_format`` as a grammar that masks the logits, per row.

llguidance (a maintained grammar engine, as vLLM and llama.cpp use) compiles a JSON
schema — or "any JSON object" for ``json_object`` — into a matcher over the model's
tokenizer. Rank 0 samples every row, so only rank 0 holds matchers: before a constrained
row's token is picked, the tokens the grammar forbids get -inf; the picked token then
advances the matcher. Once the grammar is complete only end-of-text is allowed, so the
reply ends with finish_reason "stop" — or "length", truncated, when max_tokens comes first.
Unconstrained rows in the same batch are untouched.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .protocol import RequestError


class Grammars:
    """Compiles response formats for one tokenizer (built once, on first use: ~0.5 s)."""

    def __init__(self, tok, vocab: int, eos: tuple[int, ...]):
        self.tok, self.vocab, self.eos = tok, vocab, list(eos)
        self._lltok = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        import llguidance

        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(self.tok.to_str(), n_vocab=self.vocab, eos_token=self.eos)
        return self._lltok

    def compile(self, response_format: dict[str, Any] | None):
        """A matcher for ``response_format`` (None for plain text), or :class:`RequestError`
        when the schema cannot be compiled."""
        kind = (response_format or {}).get("type", "text")
        if kind == "text":
            return None
        import llguidance

        if kind == "json_object":
            schema: Any = {"type": "object"}
        else:  # json_schema (protocol.py checked the shape)
            schema = response_format["json_schema"]["schema"]  # type: ignore[index]
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise RequestError(f"'response_format': {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"'response_format': the schema cannot be compiled: {matcher.get_error()}")
        return matcher

    def mask(self, matcher, logits: np.ndarray) -> np.ndarray:
        """``logits`` with the tokens ``matcher`` forbids next set to -inf (a copy)."""
        bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
        out = np.array(logits, np.float32, copy=True)
        out[~allowed[: out.shape[-1]]] = -np.inf
        return out

    @staticmethod
    def advance(matcher, token: int) -> str | None:
        """Feed the picked ``token`` to ``matcher``; the matcher's error if it refused it."""
        return None if matcher.consume_token(int(token)) else matcher.get_error() or "refused"
