"""Structured output: ``response_format`` as a grammar that masks the logits, per row.

llguidance (a maintained grammar engine, as vLLM and llama.cpp use) compiles a JSON
schema — or "any JSON object" for ``json_object`` — into a matcher over the model's
tokenizer, with what the schema leaves unbounded bounded (:func:`bounded`). Rank 0
samples every row, so only rank 0 holds matchers: before a constrained row's token is
picked, the tokens the grammar forbids get -inf; the picked token then advances the
matcher. Once the grammar is complete only end-of-text is allowed, so the reply ends with
finish_reason "stop" — or "length", truncated, when max_tokens comes first. Unconstrained
rows in the same batch are untouched.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .protocol import RequestError

# What a schema leaves unbounded, bounded, so that a constrained reply can always close
# within its budget (a small model may otherwise write digits or spaces until max_tokens,
# and the cut reply is not JSON). llama.cpp's schema grammars cap integers at 16 digits,
# and whitespace to a newline and 20 indents; here the same integer cap, numbers' fractions
# at 10 digits (the most llguidance's multipleOf can express exactly) and no exponent,
# whitespace as llama.cpp allows it (one space, or a newline and at most 20 spaces or
# tabs of indent). Bounds a schema states itself are kept.
DIGITS = 16
LIMIT = 10**DIGITS - 1
FRACTION = 1e-10
WHITESPACE = r"\x20|\x0A[\x20\x09]{0,20}"  # llama.cpp's: one space, or a newline and an indent


def _types(node: dict) -> set:
    t = node.get("type", ())
    return {t} if isinstance(t, str) else set(t)


def bounded(schema: Any) -> Any:
    """``schema`` (a JSON schema) with bounds on integers, numbers and whitespace where it
    states none; a copy, the input is not changed."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    kept = ("enum", "const", "default", "examples", "x-guidance")  # values, not schemas
    out = {k: (v if k in kept else bounded(v)) for k, v in schema.items()}
    kinds = _types(out)
    if kinds & {"integer", "number"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = LIMIT
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = FRACTION
    return out


# ``json_object``: any JSON object, its values held to the same bounds (a value is any of
# the JSON kinds, recursively)
_VALUE = {
    "anyOf": [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "array", "items": {"$ref": "#/$defs/value"}},
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
    ]
}
ANY_OBJECT = {"$defs": {"value": _VALUE}, "type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}


def grammar_schema(schema: dict) -> dict:
    """The schema handed to the grammar engine: bounded, with the whitespace rule unless the
    schema brings its own ``x-guidance``."""
    out = bounded(schema)
    if isinstance(out, dict) and "x-guidance" not in out:
        out["x-guidance"] = {"whitespace_pattern": WHITESPACE}
    return out


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
            schema: Any = ANY_OBJECT
        else:  # json_schema (protocol.py checked the shape)
            schema = response_format["json_schema"]["schema"]  # type: ignore[index]
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(grammar_schema(schema))
        except ValueError as e:
            raise RequestError(f"'response_format': {e}") from None
        return self._matcher(grammar, "response_format")

    def compile_other(self, kind: str, text: str, field: str):
        """A matcher for a Lark grammar (``kind`` "lark": tool calls, :mod:`.tools`) or a
        regular expression ("regex": ``guided_regex``); :class:`RequestError` naming
        ``field`` when it cannot be compiled."""
        import llguidance

        try:
            make = llguidance.LLMatcher.grammar_from_lark if kind == "lark" else llguidance.LLMatcher.grammar_from_regex
            grammar = make(text)
        except ValueError as e:
            raise RequestError(f"'{field}': {e}") from None
        return self._matcher(grammar, field)

    def _matcher(self, grammar, field: str):
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"'{field}': the schema cannot be compiled: {matcher.get_error()}")
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
