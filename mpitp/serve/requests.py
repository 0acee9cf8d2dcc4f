"""What rank 0 holds of each request (the HTTP side: http.py; the loop: scheduler.py).

HTTP threads turn a body into :class:`Request` s — one per choice (``n`` per prompt),
sharing one event queue — and queue them in :class:`Service` (503 when the bounded queue
is full); the scheduler takes them into free batch rows at its next iteration.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..log import get_logger
from ..models import chat
from ..models.stops import StopText
from . import protocol
from .grammar import Grammars
from .jobs import Job
from .metrics import Metrics
from .tools import family_of, tools_of
from .tools import grammar as tools_grammar

_ids = itertools.count(1)


BadRequest = protocol.RequestError


@dataclass
class Request:
    """One choice of a client's request: a batch row's worth. Its events go to the queue
    its siblings share, as ``(index, kind, text, records)``."""

    job: Job
    kind: str  # "chat" or "text"
    stream: bool
    stops: StopText
    deadline: float
    events: Any = field(default_factory=queue.Queue)  # put((choice, kind, text, records)); http.Events
    index: int = 0  # which choice
    cancelled: bool = False
    made: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    echo: str = ""  # text completions with echo: the prompt's text, sent first
    prompt_records: list | None = None  # with echo and logprobs: the prompt's own (rank 0)
    pending: list = field(default_factory=list)  # token records not yet sent with text
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    offset: int = 0  # text completions' logprobs: text_offset of the next token
    matcher: Any = None  # response_format's grammar (rank 0), None when unconstrained
    metrics: Any = None  # the service's Metrics
    arrived: float = field(default_factory=time.monotonic)
    last_token_at: float = 0.0
    admitted: bool = False  # took a batch row (metrics: running)
    first: bool = True  # the first choice of its prompt (usage counts each prompt once)
    tools: Any = None  # mpitp.serve.tools.Tools: the reply's calls parsed out (chat with tools)
    reasoning: bool = False  # a <think> block split off as reasoning_content
    opened: bool = False  # the prompt ended inside <think> (the template opened it)


@dataclass
class Service:
    """What the HTTP threads share with rank 0's loop."""

    tok: object
    model_dir: str
    name: str
    context: int
    max_queue: int
    timeout: float
    api_key: str | None = None
    tool_template: str | None = None  # --tool-template: for models whose own template knows no tools
    tool_parser: str | None = None  # --tool-parser: a family forced (else read from the template)
    reasoning_parser: str = "auto"  # --reasoning-parser: auto (templates that know <think>) or none
    dp: bool = False  # --dp-attention: each rank samples its own rows; what needs the logits on rank 0 is refused
    inbox: queue.Queue = field(init=False)
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.inbox = queue.Queue(maxsize=self.max_queue)
        self.template, self.special = chat.load(self.model_dir)
        self.grammars: Grammars | None = None  # made on the first constrained request
        self.metrics = Metrics(self.name, waiting=self.inbox.qsize)

    def _matcher(self, req, tools):
        """The grammar holding a chat reply: forced tool calls, ``response_format`` or
        ``guided_regex`` (one of them), or None."""
        forced = tools_grammar(tools) if tools is not None else None
        asked = [n for n, v in (("tool_choice", forced), ("response_format", req.response_format and
                 req.response_format.type != "text"), ("guided_regex", req.guided_regex)) if v]  # fmt: skip
        if not asked:
            return None
        if len(asked) > 1:
            raise BadRequest(f"{' and '.join(map(repr, asked))} each constrain the reply: give one")
        if self.grammars is None:
            self.grammars = Grammars(self.tok, self.vocab, self.eos)
        if forced:
            return self.grammars.compile_other("lark", forced, "tools")
        if req.guided_regex:
            return self.grammars.compile_other("regex", req.guided_regex, "guided_regex")
        return self.grammars.compile(req.response_format.as_dict())

    def _chat_prompt(self, req) -> tuple[str, Any, bool]:
        """(the rendered prompt, the request's Tools or None, whether to split reasoning)."""
        template, tools = self.template, None
        if req.tools:
            if family_of(template) is None:
                if self.tool_template is None:
                    raise BadRequest(
                        "'tools': this model's chat template renders no tools; start the server with "
                        "--tool-template hermes (or llama3_json, or a template file)"
                    )
                template = self.tool_template
            tools = tools_of(req.tools, req.tool_choice, req.parallel_tool_calls,
                             self.tool_parser or family_of(template) or "hermes")  # fmt: skip
        elif req.tool_choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice': there are no 'tools' to choose from")
        try:
            messages = [m.for_template() for m in req.messages]
        except ValueError as e:
            raise BadRequest(f"'messages': {e}") from None
        extra = {**self.special, **(req.chat_template_kwargs or {})}
        text = chat.render(template, messages, add_generation_prompt=True,
                           tools=tools.for_template() if tools else None, **extra)  # fmt: skip
        reasoning = self.reasoning_parser != "none" and "<think>" in template
        return text, tools, reasoning

    def make(self, body, kind: str, events=None) -> list[Request]:
        """The request's choices (``n`` per prompt, one row each; a text completion may send
        several prompts) sharing ``events`` (a new queue.Queue when None), or
        :class:`BadRequest`."""
        req, unknown = protocol.parse(body, "chat" if kind == "chat" else "text")
        if unknown:
            get_logger("serve").warning(f"ignoring unknown field(s) {', '.join(map(repr, unknown))} of a request")
        prompts: list[tuple[list[int], str]] = []  # (token ids, the text echo sends back)
        tools, reasoning, opened = None, False, False
        if isinstance(req, protocol.ChatRequest):
            text, tools, reasoning = self._chat_prompt(req)
            opened = reasoning and text.rstrip().endswith("<think>")
            prompts.append((self.tok.encode(text, add_special_tokens=False).ids, ""))  # type: ignore[attr-defined]
            max_tokens = req.max_completion_tokens or req.max_tokens or 256
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            matcher = self._matcher(req, tools)
        else:
            for p in req.prompts:
                if isinstance(p, str):
                    ids = self.tok.encode(p).ids  # type: ignore[attr-defined]
                else:
                    ids = list(p)
                    bad = [t for t in ids if not 0 <= t < self.vocab]
                    if bad:
                        raise BadRequest(f"prompt token id {bad[0]} lies outside the vocabulary of {self.vocab}")
                echo = (p if isinstance(p, str) else self.tok.decode(ids)) if req.echo else ""  # type: ignore[attr-defined]
                prompts.append((ids, echo))
            max_tokens = req.max_tokens or 16
            logprobs = req.logprobs
            matcher = None
        if self.dp and (logprobs is not None or matcher is not None or any(e for _, e in prompts)):
            raise BadRequest(
                "log-probabilities, echo and constrained output (response_format, guided_regex, a forced tool "
                "call) are not served with --dp-attention: each rank samples its own requests"
            )
        for ids, _ in prompts:
            if len(ids) + max_tokens > self.context:
                raise BadRequest(
                    f"{len(ids)} prompt tokens + max_tokens {max_tokens} exceed the context of {self.context}"
                )
        events = queue.Queue() if events is None else events
        deadline = time.monotonic() + self.timeout
        out: list[Request] = []
        for ids, echo in prompts:
            for i in range(req.n):
                job = Job(
                    id=next(_ids),
                    ids=ids,
                    max_tokens=max_tokens,
                    temperature=0.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=max(0, req.top_k or 0),
                    seed=None if req.seed is None else req.seed + i,  # choice i: seed + i, reproducible
                    stop_ids=tuple(self.eos),
                    logprobs=logprobs,
                    echo=bool(echo),
                    constrained=matcher is not None,
                )
                stops = StopText(self.tok, req.stop or [])
                r = Request(job, kind, req.stream, stops, deadline, events, index=len(out))
                r.echo, r.first = echo, i == 0
                r.matcher = None if matcher is None else matcher.deep_copy()
                r.metrics = self.metrics
                r.include_usage = bool((req.stream_options or {}).get("include_usage"))
                r.tools, r.reasoning, r.opened = tools, reasoning, opened
                out.append(r)
        return out

    eos: tuple = ()
    vocab: int = 1 << 62  # the model's vocabulary: prompt token ids must lie below it
