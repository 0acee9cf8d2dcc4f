"""Serving with data-parallel attention (``mpitp serve --dp-attention``): each rank decodes its
own requests, the experts of a mixture-of-experts model reached by all-to-all
(:class:`mpitp.models.moe.SparseMoE`), as DeepSeek and SGLang serve such models.

Rank 0 answers HTTP and gives each new request to the rank with the fewest; every rank runs
its own :class:`.engine.Engine` (its own rows and KV cache) in lockstep with the others::

    iteration:  rank 0 broadcasts: each rank's new requests, the cancelled, shutdown
                prefill   if any rank has prompts: each rank its own, or an idle pass
                          (its part in every MoE layer's all-to-all, with no rows)
                sample    each rank its own rows (its requests' own generators); rank 0
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

from ..log import get_logger
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


def _sample(e: Engine, results: dict, service: Service | None, requests: dict, where: dict) -> None:
    """Each rank picks its rows' next tokens; rank 0 gathers them, streams them and says which
    requests ended; every rank records its picks and drops its ended requests."""
    mine = {}
    for row, out in results.items():
        s = e.slots[row]
        if s is None:
            continue
        token = out.token if out.token >= 0 else e.pick(row, out.logits)
        mine[row] = (s.job.id, token)
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
