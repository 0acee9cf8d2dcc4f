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
    inbox: queue.Queue = field(init=False)
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.inbox = queue.Queue(maxsize=self.max_queue)
        self.template, self.special = chat.load(self.model_dir)
        self.grammars: Grammars | None = None  # made on the first constrained request
        self.metrics = Metrics(self.name, waiting=self.inbox.qsize)

    def _matcher(self, response_format):
        if not response_format or response_format.type == "text":
            return None
        if self.grammars is None:
            self.grammars = Grammars(self.tok, self.vocab, self.eos)
        return self.grammars.compile(response_format.as_dict())

    def make(self, body, kind: str, events=None) -> list[Request]:
        """The request's choices (``n`` per prompt, one row each; a text completion may send
        several prompts) sharing ``events`` (a new queue.Queue when None), or
        :class:`BadRequest`."""
        req, unknown = protocol.parse(body, "chat" if kind == "chat" else "text")
        if unknown:
            get_logger("serve").warning(f"ignoring unknown field(s) {', '.join(map(repr, unknown))} of a request")
        prompts: list[tuple[list[int], str]] = []  # (token ids, the text echo sends back)
        if isinstance(req, protocol.ChatRequest):
            messages = [m.model_dump() for m in req.messages]
            text = chat.render(self.template, messages, add_generation_prompt=True, **self.special)
            prompts.append((self.tok.encode(text, add_special_tokens=False).ids, ""))  # type: ignore[attr-defined]
            max_tokens = req.max_completion_tokens or req.max_tokens or 256
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            matcher = self._matcher(req.response_format)
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
                out.append(r)
        return out

    eos: tuple = ()
    vocab: int = 1 << 62  # the model's vocabulary: prompt token ids must lie below it
