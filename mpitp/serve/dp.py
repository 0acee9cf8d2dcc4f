"""Serving with data-parallel attention (``mpitp serve --dp-attention``): each rank decodes its
own requests, the experts of a mixture-of-experts model reached by all-to-all
(:class:`mpitp.models.moe.SparseMoE`), as DeepSeek and SGLang serve such models.

Rank 0 answers HTTP and gives each new request to the rank with the fewest; every rank runs
its own :class:`.engine.Engine` (its own rows and KV cache) in lockstep with the others::

    iteration:  rank 0 broadcasts: each rank's new requests, the cancelled, shutdown
                prefill   if any rank has prompts: each rank its own, or an idle pass
                          (its part in every MoE layer's all-to-all, with no rows)
                sample    each rank its own rows (its requests' own generators) by the
                          vocabulary-cut head (:func:`pick`: rows all-gathered); rank 0
                          gathers the tokens, streams them, decides which requests ended
                          and broadcasts that
                decode    if any rank has a row to feed: one step each (or an idle pass),
                          sampled the same way
                every rank learns every rank's load (the next assignments; busy or idle)

Requests that need rank 0 to see the logits (log-probabilities, a grammar: response_format,
guided_regex, a forced tool call) are refused with a 400 in this mode.
"""

from __future__ import annotations

import time

import numpy as np

from ..log import get_logger
from ..tp.dp_head import DataParallelHead
from .engine import Engine
from .requests import Service
from .scheduler import Stop, emit, finish, take_request


def run_dp(e: Engine, service: Service | None, stop: Stop | None = None) -> None:
    """Every rank: serve its own requests until SIGTERM/SIGINT (rank 0 decides)."""
    comm, rank0 = e.comm, service is not None
    assert comm is not None
    stop = stop or Stop()
    requests: dict = {}  # rank 0: job id -> Request
    where: dict[int, int] = {}  # rank 0: job id -> its rank
    load = [0] * comm.size  # rank 0: each rank's running + waiting requests
    busy = False
    while True:
        control = None
        if rank0:
            assert service is not None
            now = time.monotonic()
            cancels = [j for j, r in requests.items() if r.cancelled or now > r.deadline]
            assigned: dict[int, list] = {}
            while sum(load) < e.B * comm.size:
                req = take_request(service, 0.05 if not busy and not assigned and not stop.is_set() else 0.0)
                if req is None:
                    break
                r = min(range(comm.size), key=lambda q: (load[q] >= e.B, load[q]))  # the least loaded rank
                load[r] += 1
                assigned.setdefault(r, []).append(req.job)
                requests[req.job.id], where[req.job.id] = req, r
                service.metrics.admitted(req)
            control = (assigned, cancels, stop.is_set())
        assigned, cancels, shutdown = e.exchange(control, busy)
        e.cancel(cancels)
        for j in cancels if rank0 else ():
            r, _ = requests.pop(j), where.pop(j)
            finish(r, "length" if time.monotonic() > r.deadline else "cancelled")
        for job in assigned.get(comm.rank, []):
            e.add(job)
        if comm.allreduce_object(int(bool(e.waiting)), op="max"):  # someone prefills: all take part
            fresh = e.prefill() if e.waiting else _idle(e)
            _sample(e, fresh, service, requests, where)
        fed = any(s is not None and s.last >= 0 for s in e.slots)
        if comm.allreduce_object(int(fed), op="max"):
            out = e.step() if fed else None
            if out is None:
                _idle(e)
            rows = {r: out[r] for r, s in enumerate(e.slots[: e.running]) if out is not None and s and s.last >= 0}
            _sample(e, rows, service, requests, where)
        load = comm.allgather_object(e.running + len(e.waiting))  # every rank's: the assignments, and
        busy = any(load)  # whether the next control message is due within a step
        if shutdown:
            if service is not None:
                service.stopping.set()
                get_logger("serve").info(f"{stop.why}: ending {len(requests)} request(s) in flight with what they have")
            for j in list(requests):
                finish(requests.pop(j), "abort")
            return


def _idle(e: Engine) -> dict:
    """This rank's part in a forward the others run: every MoE layer's all-to-all, no rows."""
    e.model.idle_step()
    return {}


def pick(e: Engine, results: dict) -> dict[int, int]:
    """Every rank, in step: the next token of each of its rows in ``results`` (row -> its
    normed hidden state, the forward's ``hidden``), by the vocabulary-cut head
    (:meth:`mpitp.tp.dp_head.DataParallelHead.pick`): greedy rows the argmax, rows at a
    temperature sampled with two uniforms of their own generator; rows with top-k or top-p
    get their logits whole and are sampled here as before (:meth:`.engine.Engine.pick`)."""
    m = e.model
    assert isinstance(m.lm_head, DataParallelHead)
    rows = [r for r in results if e.slots[r] is not None]
    h = np.stack([results[r].logits.reshape(-1) for r in rows]) if rows else np.zeros((0, m.config.hidden_size))
    T, u = np.zeros(len(rows)), np.zeros((len(rows), 2))
    for i, r in enumerate(rows):
        s = e.slots[r]
        j = s.job
        if j.temperature <= 0:
            continue  # greedy (top-k and top-p change no argmax)
        if (0 < j.top_k < m.config.vocab_size) or j.top_p < 1.0:
            T[i] = np.nan  # the whole distribution is needed
        else:
            T[i], u[i] = j.temperature, s.rng.random(2)
    tokens, logits = m.lm_head.pick(h, T, u)
    whole = iter(logits)
    return {r: int(t) if t >= 0 else e.pick(r, next(whole)) for r, t in zip(rows, tokens)}


def _sample(e: Engine, results: dict, service: Service | None, requests: dict, where: dict) -> None:
    """Each rank picks its rows' next tokens; rank 0 gathers them, streams them and says which
    requests ended; every rank records its picks and drops its ended requests."""
    mine = {row: (e.slots[row].job.id, token) for row, token in pick(e, results).items()}  # type: ignore[union-attr]
    everyone = e.comm.gather_object(list(mine.values()))
    ended = None
    if service is not None:
        ended = set()
        for picks in everyone:
            for job, token in picks:
                r = requests.get(job)
                if r is not None and emit(r, token) is not None:
                    ended.add(job)
                    requests.pop(job, None), where.pop(job, None)
    ended = e.exchange(ended, True)
    for row, (_, token) in mine.items():
        e.took(row, token)
    e.cancel([job for job, _ in mine.values() if job in ended])
