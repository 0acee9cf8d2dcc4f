"""Tool calls and reasoning as OpenAI's clients parse them, from what the model writes.

A model writes its calls in its family's own syntax, which its chat template teaches it;
the family is read from the template (``--tool-parser`` forces one)::

    hermes    <tool_call>{"name": "f", "arguments": {...}}</tool_call>    Qwen2.5, Qwen3, Hermes
    llama3    {"name": "f", "parameters": {...}}  (or after <|python_tag|>; ";" between calls)
    mistral   [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]

:func:`split` turns a whole reply into (content, calls): the text before the first call
stays content; a call that does not parse is left as text, never an error. :class:`Stream`
does the same piece by piece for streaming: content as it comes, held back only while it
may be the start of a call, each call as deltas (its index, id and name once, then its
arguments in pieces), joined equal to the whole reply's. ``tool_choice`` "required" or a
named function is enforced by a grammar (:func:`grammar`: llguidance's Lark with the
functions' JSON schemas, bounded as ``response_format`` is).

Reasoning: a reply that opens a ``<think>`` block (Qwen3, DeepSeek-R1 styles; a template
may have written ``<think>`` itself) has that block as ``reasoning_content``, apart from
``content`` (:func:`split_reasoning`, :class:`Stream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .grammar import grammar_schema
from .protocol import RequestError

FAMILIES = ("hermes", "llama3", "mistral")
THINK, END_THINK = "<think>", "</think>"
_MARKS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def family_of(template: str) -> str | None:
    """The tool-call syntax a chat template teaches, or None where it knows no tools."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template or '"parameters"' in template:
        return "llama3"
    return "hermes"  # a template that renders tools but names no syntax: Hermes's, the most common


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(obj: Any, family: str) -> dict | None:
    """An OpenAI tool call from one parsed JSON object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters" if family == "llama3" and "parameters" in obj else "arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def split(text: str, family: str) -> tuple[str, list[dict]]:
    """(content, calls) of a whole reply; the reply itself as content when no call parses."""
    if family == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in _HERMES.findall(text[start:]):
            try:
                c = _call(json.loads(body), family)
            except ValueError:
                c = None
            if c is None:
                return text, []
            calls.append(c)
        rest = _HERMES.sub("", text[start:]).strip()
        return (text, []) if not calls or rest else (text[:start], calls)
    if family == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        try:
            objs = json.loads(text[start + len("[TOOL_CALLS]") :].strip())
        except ValueError:
            return text, []
        found = [_call(o, family) for o in (objs if isinstance(objs, list) else [objs])]
        calls = [c for c in found if c is not None]
        return (text, []) if not calls or len(calls) < len(found) else (text[:start], calls)
    body = text.strip().removeprefix("<|python_tag|>").strip()  # llama3: the reply is the call(s)
    if not body.startswith("{"):
        return text, []
    try:
        objs = [json.loads(part) for part in body.split(";") if part.strip()]
    except ValueError:
        return text, []
    found = [_call(o, family) for o in objs]
    calls = [c for c in found if c is not None]
    return (text, []) if not calls or len(calls) < len(found) else ("", calls)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content): the ``<think>`` block's text apart, as it was written (vLLM's
    reasoning parsers strip nothing either; ``opened``: the prompt already ended in
    ``<think>``); (None, text) where there is none."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(THINK):
            return None, text
        text = stripped[len(THINK) :]
    end = text.find(END_THINK)
    if end < 0:  # cut by max_tokens inside the block: all of it was reasoning
        return text, ""
    return text[:end], text[end + len(END_THINK) :]


@dataclass
class Tools:
    """A chat request's tools as the server uses them: ``family`` to parse, ``choice``
    (auto, none, required, or a function's name), ``parallel``."""

    functions: list[dict]  # [{"name", "description", "parameters"}]
    choice: str = "auto"
    parallel: bool = True
    family: str = "hermes"

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    def for_template(self) -> list[dict]:
        """``tools`` as the template reads them (transformers passes the request's list)."""
        return [{"type": "function", "function": f} for f in self.functions]


def tools_of(raw_tools, raw_choice, parallel, family: str) -> Tools | None:
    """The request's tools checked (a 400 naming the field where they are malformed)."""
    if not raw_tools:
        if raw_choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice': there are no 'tools' to choose from")
        return None
    functions = []
    for i, t in enumerate(raw_tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"'tools[{i}]': a tool is {{'type': 'function', 'function': {{'name': ...}}}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise RequestError(f"'tools[{i}].function.parameters': a JSON Schema of an object is expected")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    choice: str = "auto"
    if isinstance(raw_choice, dict):
        name = (raw_choice.get("function") or {}).get("name")
        if name not in [f["name"] for f in functions]:
            raise RequestError(
                f"'tool_choice': no tool named {name!r} (the tools are {[f['name'] for f in functions]})"
            )
        choice = str(name)
    elif raw_choice is not None:
        if raw_choice not in ("auto", "none", "required"):
            raise RequestError(f"'tool_choice': {raw_choice!r} is not 'auto', 'none', 'required' or a function")
        choice = raw_choice
    return Tools(functions, choice, True if parallel is None else bool(parallel), family)


def grammar(tools: Tools) -> str | None:
    """A Lark grammar (llguidance) holding the reply to calls of the allowed functions, whose
    arguments validate against each one's schema; None where the model chooses (auto)."""
    if tools.choice in ("auto", "none"):
        return None
    allowed = [f for f in tools.functions if tools.choice == "required" or f["name"] == tools.choice]
    key = "parameters" if tools.family == "llama3" else "arguments"
    one = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for f in allowed
        ]
    }
    # parallel calls under "required": at most one per allowed function (a small model held to calls
    # may otherwise repeat them until max_tokens); a named function: one call
    extra = len(allowed) - 1 if tools.parallel and tools.choice == "required" else 0
    many = extra > 0
    body = f"body: %json {json.dumps(grammar_schema(one))}"
    if tools.family == "hermes":
        more = f' ("\\n" call){{0,{extra}}}' if many else ""
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        return f"start: call{more}\n{call}\n{body}"
    if tools.family == "mistral":
        rest = f' ("," body){{0,{extra}}}' if many else ""
        return f'start: "[TOOL_CALLS][" body{rest} "]"\n{body}'
    rest = f' (";" body){{0,{extra}}}' if many else ""
    return f"start: body{rest}\n{body}"


@dataclass
class Stream:
    """Deltas of one streamed choice from its text pieces (see the module's docstring):
    ``feed(piece)`` and ``end()`` return a list of deltas, each a dict of ``content``,
    ``reasoning_content`` or ``tool_calls``."""

    tools: Tools | None
    reasoning: bool = False  # split a <think> block off
    opened: bool = False  # the prompt ended inside <think>
    text: str = ""
    sent: int = 0  # chars of text already handed out (as content or reasoning)
    in_think: bool = False
    calls: list = field(default_factory=list)
    _thinking_checked: bool = False
    _calls_first: bool | None = None  # llama3: whether the reply opens with a call

    def __post_init__(self):
        self.in_think = self.reasoning and self.opened

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        out: list[dict[str, Any]] = []
        while True:
            if self.in_think:
                end = self.text.find(END_THINK, self.sent)
                if end < 0:
                    safe = _safe_end(self.text, self.sent, END_THINK)
                    if safe > self.sent:
                        out.append({"reasoning_content": self.text[self.sent : safe]})
                        self.sent = safe
                    return out
                if end > self.sent:
                    out.append({"reasoning_content": self.text[self.sent : end]})
                self.sent, self.in_think = end + len(END_THINK), False
                continue
            if self.reasoning and not self._thinking_checked:
                head = self.text[self.sent :].lstrip()
                if not head:
                    return out
                if THINK.startswith(head[: len(THINK)]) and len(head) < len(THINK):
                    return out  # may still become <think>
                self._thinking_checked = True
                if head.startswith(THINK):
                    self.sent = self.text.index(THINK, self.sent) + len(THINK)
                    self.in_think = True
                    continue
            if self.tools is None or self.tools.choice == "none":
                if len(self.text) > self.sent:
                    out.append({"content": self.text[self.sent :]})
                    self.sent = len(self.text)
                return out
            if self.tools.family == "llama3":  # the reply is either the call(s) or text: decided by its start
                if self._calls_first is None:
                    head = self.text[self.sent :].lstrip()
                    if not head:
                        return out
                    self._calls_first = head[0] in "{<"
                if self._calls_first:
                    return out  # held whole: decided at the end
                out.append({"content": self.text[self.sent :]})
                self.sent = len(self.text)
                return out
            mark = _MARKS[self.tools.family]
            at = self.text.find(mark, self.sent)
            stop = _safe_end(self.text, self.sent, mark) if at < 0 else at
            if stop > self.sent:
                out.append({"content": self.text[self.sent : stop]})
                self.sent = stop
            return out  # from a call's mark on, the rest may be calls: decided at the end

    def end(self) -> list[dict]:
        """The deltas left at the end of the reply: its calls, or what was held back as text."""
        rest = self.text[self.sent :]
        if self.in_think:
            return [{"reasoning_content": rest}] if rest else []
        if not rest:
            return []
        if self.tools is None or self.tools.choice == "none":
            return [{"content": rest}]
        content, calls = split(rest, self.tools.family)
        if not calls:
            return [{"content": rest}]
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for i, c in enumerate(calls):
            self.calls.append(c)
            fn = c["function"]
            head = {"index": i, "id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
            out.append({"tool_calls": [head]})
            args = fn["arguments"]
            for a in range(0, len(args), 16):  # the arguments in pieces, as OpenAI's server streams them
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[a : a + 16]}}]})
        return out


def _safe_end(text: str, start: int, mark: str) -> int:
    """How far text may be handed out without cutting a possible start of ``mark``."""
    for k in range(min(len(mark) - 1, len(text) - start), 0, -1):
        if mark.startswith(text[len(text) - k :]):
            return len(text) - k
    return len(text)
