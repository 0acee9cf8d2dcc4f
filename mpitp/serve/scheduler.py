"""The lockstep loop every rank runs (requests.py: what rank 0 holds; engine.py: the
model runner).

Each iteration rank 0 takes queued requests into free rows and finds the cancelled and
timed-out ones; every rank gets that from rank 0, prefills (packed, under the token
budget), decodes one step; rank 0 samples (grammar masks, log-probabilities), streams the
text as tokens complete (stop strings never shown), and tells every rank which requests
finished. Prompts that complete while other requests run are sampled before that step
(their first tokens stream without waiting for it, and the step feeds them too).
SIGTERM (or SIGINT) ends the requests in flight with what they have (finish_reason
"abort", vLLM's word for a request the server ended) and ends every rank.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ..log import get_logger
from . import logprobs as lp
from .engine import Engine
from .jobs import Job
from .pacing import LONG, PROMPTS, REPS, SHORT, Pacing
from .requests import Request, Service
from .results import Next, Out


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


def run(
    engines: list[Engine] | Engine, service: Service | None, stop: Stop | None = None, pacing: Pacing | None = None
) -> None:
    """Every rank: serve until SIGTERM/SIGINT (rank 0 decides; the others follow). With
    ``pacing`` (rank 0's, :mod:`.pacing`), each prefill forward takes the waiting prompts it
    picks; without, all that fit the token budget.

    With P pipeline stages ``engines`` holds P engines (vLLM's virtual engines: each its own
    rows and KV cache; a request stays in one). Iteration i runs engine i mod P's forward,
    then samples the results of iteration i − (P − 1): by then the last stage has sent them,
    and rank 0's stage has computed the next micro-batch meanwhile instead of waiting::

        iteration       0     1     2     3
        stage 0        e0    e1    e0    e1     e0's tokens of iteration 0 are sampled at the
        stage 1              e0    e1    e0     end of iteration 1, before e0 runs again
    """
    engines = engines if isinstance(engines, list) else [engines]
    lag = len(engines) - 1
    rank0 = service is not None
    stop = stop or Stop()
    requests: dict[int, Request] = {}  # rank 0: job id -> request, prefilling or running
    home: dict[int, int] = {}  # rank 0: job id -> the engine that holds it
    in_flight: deque[tuple[Engine, dict[int, Out], Next | None]] = deque()  # forwards not yet sampled
    i = 0
    while True:
        v, i = i % len(engines), i + 1
        e = engines[v]
        busy = any(x.busy for x in engines)
        control = None
        if rank0:
            assert service is not None
            now = time.monotonic()
            cancels = [j for j, r in requests.items() if home[j] == v and (r.cancelled or now > r.deadline)]
            jobs: list[Job] = []
            while len(jobs) < e.free:
                req = take_request(service, 0.05 if not busy and not jobs and not stop.is_set() else 0.0)
                if req is None:
                    break
                jobs.append(req.job)
                requests[req.job.id], home[req.job.id] = req, v
                service.metrics.admitted(req)
            pace = pacing.pace(e.running > 0) if pacing is not None and not lag else None
            control = (jobs, cancels, stop.is_set(), pace)
        jobs, cancels, shutdown, pace = e.exchange(control, busy)
        e.cancel(cancels)  # (an engine's results are all sampled before it runs again)
        for j in cancels if rank0 else ():
            r, _ = requests.pop(j), home.pop(j)
            finish(r, "length" if time.monotonic() > r.deadline else "cancelled")
        for job in jobs:
            e.add(job)
        ran, t = bool(e.waiting), time.perf_counter()
        overlapping = bool(in_flight)  # an earlier micro-batch's forward is not sampled yet
        fresh = e.prefill(pace)
        if ran and pacing is not None:  # a served forward's cost (pacing.Pacing.prefilled)
            pacing.prefilled(e.last_tokens, time.perf_counter() - t)
        if service is not None:
            service.metrics.kv_used(sum(x.kv_usage() for x in engines) / len(engines))
            service.metrics.prefix(e.prefix.queries, e.prefix.hits)
        fed = any(s and s.last >= 0 for s in e.slots)
        if fresh and fed and not lag:
            # the new prompts' first tokens go out now, not after the running rows' step
            # (which then feeds them too): 8 clients' first tokens waited ~14 ms more
            _sample(e, fresh, None, service, requests, home)
            fresh = {}
        t = time.perf_counter()
        in_flight.append((e, fresh, e.step() if fed else None))
        if overlapping and (ran or fed) and service is not None:
            service.metrics.overlapped.labels(service.metrics.name).inc()
        if fed and pacing is not None:
            pacing.stepped(time.perf_counter() - t)
        while len(in_flight) > (0 if shutdown else lag):
            _sample(*in_flight.popleft(), service, requests, home)
        if shutdown:
            if e.hand_back is not None:
                e.hand_back.drain()
            if service is not None:
                service.stopping.set()
            if rank0:
                get_logger("serve").info(f"{stop.why}: ending {len(requests)} request(s) in flight with what they have")
            for j in list(requests):
                finish(requests.pop(j), "abort")
            return


def take_request(service: Service, wait: float) -> Request | None:
    """Rank 0: the next queued request still wanted (cancelled ones counted and dropped), or
    None once the inbox is empty, after waiting up to ``wait`` seconds for one."""
    while True:
        try:
            req = service.inbox.get(timeout=wait) if wait else service.inbox.get_nowait()
        except queue.Empty:
            return None
        if not req.cancelled:
            return req
        service.metrics.finished(req, "cancelled")


def _sample(e: Engine, fresh: dict[int, Out], out: Next | None, service: Service | None, requests, home) -> None:
    """Rank 0 picks the next token of every running row of ``e`` from a forward's results
    (and streams it); every rank records the picks and drops the requests that ended."""
    if not e.running:
        return
    picks = None
    if service is not None:
        picks = {}
        for row, slot in enumerate(e.slots):
            if slot is None or (row not in fresh and (slot.last < 0 or out is None)):
                continue  # no result for it in this call (the fresh rows alone: see run)
            r = requests[slot.job.id]
            token, record = _pick(e, service, row, r, fresh[row] if row in fresh else out[row])  # type: ignore[index]
            picks[row] = (token, emit(r, token, record))
    picks = e.exchange(picks, True)
    for row, (token, _) in picks.items():
        e.took(row, token)
    done = [e.slots[row].job.id for row, (_, end) in picks.items() if end]
    e.cancel(done)
    for j in done if service is not None else ():
        requests.pop(j, None), home.pop(j, None)


def _pick(engine: Engine, service: Service | None, row: int, r: Request, result: Out) -> tuple[int, Any]:
    """Rank 0: the next token of ``r`` from its logits (masked by its grammar, if any),
    and its log-probability record (from the model's own logits) when asked — or the
    token the last pipeline stage sampled (a request that wants neither)."""
    if result.token >= 0:
        return result.token, None
    lg, k = result.logits, r.job.logprobs
    if lg.ndim == 2:  # a prefill that kept every position: the prompt's records
        r.prompt_records = lp.prompt_records(lg, r.job.ids, k or 0)
        lg = lg[-1]
    g = service.grammars if service is not None and r.matcher is not None else None
    token = engine.pick(row, lg if g is None else g.mask(r.matcher, lg))
    if g is not None and token not in r.job.stop_ids and (error := g.advance(r.matcher, token)) is not None:
        get_logger("serve").error(f"request {r.job.id}: grammar: {error}; unconstrained from here")
        r.matcher = None
    return token, None if k is None else lp.record(lg, token, k)


def emit(r: Request, token: int, record=None) -> str | None:
    """Rank 0: one new token of ``r`` (and its log-probability record): stream its text;
    the finish reason once it ends. Records travel with the next text sent."""
    if r.made == 0 and r.echo:
        r.events.put((r.index, "echo", r.echo, r.prompt_records or []))
    r.made += 1
    if r.metrics is not None:
        r.metrics.token(r)
    if token in r.job.stop_ids:
        finish(r, "stop")
        return "stop"
    if record is not None:
        r.pending.append(record)
    piece = r.stops.push(token)
    if piece:
        r.events.put((r.index, "delta", piece, r.pending))
        r.pending = []
    if r.stops.stopped:
        finish(r, "stop")
        return "stop"
    if r.made >= r.job.max_tokens:
        finish(r, "length")
        return "length"
    return None


def finish(r: Request, reason: str) -> None:
    rest = "" if r.stops.stopped else r.stops.flush()
    if rest or r.pending:
        r.events.put((r.index, "delta", rest, r.pending))
        r.pending = []
    if r.metrics is not None:  # counted before the client hears of it: a scrape after sees it
        r.metrics.finished(r, reason)
    r.events.put((r.index, "done", reason, []))


def calibrate(model, rank0: bool, comm=None, max_len: int = 4096) -> Pacing:
    """Every rank: timed prefills (in lockstep) through a small engine of its own (no
    prefix cache), so its packing is in the figures: one prompt of SHORT tokens, and LONG
    tokens in PROMPTS prompts; rank 0's :class:`Pacing` from them (the others get one too,
    unused). Off where the fit makes no sense (b ≤ 0, a < 0) or the context is too short."""
    per = LONG // PROMPTS
    if max_len < per + 1:
        return Pacing()
    e = Engine(model, PROMPTS, max_len=per + 1, budget=LONG, prefix_bytes=0, comm=comm)
    vocab = model.config.vocab_size
    times = {SHORT: math.inf, LONG: math.inf}
    job = 0
    for _ in range(REPS):
        for n, prompts in ((SHORT, 1), (LONG, PROMPTS)):
            for k in range(prompts):
                job += 1
                e.add(Job(job, [int(v) for v in (np.arange(n // prompts) * 7919 + k) % vocab], 1))
            if comm is not None:
                comm.barrier()
            t = time.perf_counter()
            e.prefill()
            times[n] = min(times[n], time.perf_counter() - t)
            e.cancel(range(job + 1))
    b = (times[LONG] - times[SHORT]) / (LONG - SHORT)
    a = times[SHORT] - b * SHORT
    if not rank0 or b <= 0 or a < 0:
        return Pacing()
    return Pacing(a, b)
