"""The requests rank 0 holds, and the loop every rank runs (the HTTP side: http.py).

HTTP threads turn a body into :class:`Request` s — one per choice (``n``), sharing one
event queue — and queue them (503 when the bounded queue is full); the main thread of
every rank runs :func:`run`, where rank 0 takes queued requests into free batch rows at
the next step. Text reaches the client as tokens complete (stop strings never shown);
a client that goes away, or a request past ``--request-timeout``, is cancelled. SIGTERM
(or SIGINT) ends the requests in flight with what they have (finish_reason "abort",
vLLM's word for a request the server ended) and ends every rank.
"""

from __future__ import annotations

import itertools
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..log import get_logger
from ..models import chat
from ..models.stops import StopText
from . import logprobs as lp
from . import protocol
from .engine import Engine, Job
from .grammar import Grammars
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


# ---------------------------------------------------------------------------- the loop
class Stop(threading.Event):
    """Set by SIGTERM or SIGINT, naming the signal. Installed before the HTTP side starts,
    so a signal that arrives as soon as /health answers still ends the server cleanly."""

    def __init__(self):
        super().__init__()
        self.why = "a signal"
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on)

    def _on(self, signum, _frame):
        self.why = signal.Signals(signum).name
        self.set()


def run(engine: Engine, service: Service | None, stop: Stop | None = None) -> None:
    """Every rank: serve until SIGTERM/SIGINT (rank 0 decides; the others follow)."""
    rank0 = service is not None
    stop = stop or Stop()
    requests: dict[int, Request] = {}  # rank 0: job id -> request, prefilling or running
    while True:
        control = None
        if rank0:
            assert service is not None
            now = time.monotonic()
            cancels = [i for i, r in requests.items() if r.cancelled or now > r.deadline]
            jobs: list[Job] = []
            while len(jobs) < engine.free:
                try:
                    wait = 0.05 if not engine.busy and not jobs and not stop.is_set() else 0.0
                    req = service.inbox.get(timeout=wait) if wait else service.inbox.get_nowait()
                except queue.Empty:
                    break
                if req.cancelled:
                    service.metrics.finished(req, "cancelled")
                    continue
                jobs.append(req.job)
                requests[req.job.id] = req
                service.metrics.admitted(req)
            control = (jobs, cancels, stop.is_set())
        jobs, cancels, shutdown = engine.exchange(control)
        engine.cancel(cancels)
        for i in cancels if rank0 else ():
            r = requests.pop(i)
            _finish(r, "length" if time.monotonic() > r.deadline else "cancelled")
        for job in jobs:
            engine.add(job)
        fresh = engine.prefill()
        if service is not None:
            service.metrics.kv_used(engine.kv_usage())
            service.metrics.prefix(engine.prefix.queries, engine.prefix.hits)
        picks = None
        if engine.running:
            fed = any(s and s.last >= 0 for s in engine.slots)
            logits = engine.step() if fed else None
            if rank0:
                picks = {}
                for row, slot in enumerate(engine.slots):
                    if slot is None or (row not in fresh and slot.last < 0):
                        continue  # (cannot happen: a row without a token was just prefilled)
                    r = requests[slot.job.id]
                    lg = fresh[row] if row in fresh else logits[row]  # type: ignore[index]
                    token, record = _pick(engine, service, row, r, lg)
                    picks[row] = (token, _emit(r, token, record))
            picks = engine.exchange(picks)
            for row, (token, _) in picks.items():
                engine.took(row, token)
            done = [engine.slots[row].job.id for row, (_, end) in picks.items() if end]
            engine.cancel(done)
            for i in done if rank0 else ():
                requests.pop(i, None)
        if shutdown:
            if service is not None:
                service.stopping.set()
            if rank0:
                get_logger("serve").info(f"{stop.why}: ending {len(requests)} request(s) in flight with what they have")
            for i in list(requests):
                _finish(requests.pop(i), "abort")
            return


def _pick(engine: Engine, service: Service | None, row: int, r: Request, lg) -> tuple[int, Any]:
    """Rank 0: the next token of ``r`` from its logits (masked by its grammar, if any),
    and its log-probability record (from the model's own logits) when asked."""
    k = r.job.logprobs
    if lg.ndim == 2:  # a prefill that kept every position: the prompt's records
        r.prompt_records = lp.prompt_records(lg, r.job.ids, k or 0)
        lg = lg[-1]
    g = service.grammars if service is not None and r.matcher is not None else None
    token = engine.pick(row, lg if g is None else g.mask(r.matcher, lg))
    if g is not None and token not in r.job.stop_ids and (error := g.advance(r.matcher, token)) is not None:
        get_logger("serve").error(f"request {r.job.id}: grammar: {error}; unconstrained from here")
        r.matcher = None
    return token, None if k is None else lp.record(lg, token, k)


def _emit(r: Request, token: int, record=None) -> str | None:
    """Rank 0: one new token of ``r`` (and its log-probability record): stream its text;
    the finish reason once it ends. Records travel with the next text sent."""
    if r.made == 0 and r.echo:
        r.events.put((r.index, "echo", r.echo, r.prompt_records or []))
    r.made += 1
    if r.metrics is not None:
        r.metrics.token(r)
    if token in r.job.stop_ids:
        _finish(r, "stop")
        return "stop"
    if record is not None:
        r.pending.append(record)
    piece = r.stops.push(token)
    if piece:
        r.events.put((r.index, "delta", piece, r.pending))
        r.pending = []
    if r.stops.stopped:
        _finish(r, "stop")
        return "stop"
    if r.made >= r.job.max_tokens:
        _finish(r, "length")
        return "length"
    return None


def _finish(r: Request, reason: str) -> None:
    rest = "" if r.stops.stopped else r.stops.flush()
    if rest or r.pending:
        r.events.put((r.index, "delta", rest, r.pending))
        r.pending = []
    if r.metrics is not None:  # counted before the client hears of it: a scrape after sees it
        r.metrics.finished(r, reason)
    r.events.put((r.index, "done", reason, []))
