"""Continuous batching, in lockstep on every tensor-parallel rank.

One KV cache of ``max_batch`` rows shares a timeline of columns; each running request
owns a row. Every iteration rank 0 broadcasts what changed (new requests, cancellations,
shutdown), then every rank runs the same model steps::

    iteration:   admit new requests into free rows   (prefill each alone, B = 1, then
                                                      copy its keys/values into its row,
                                                      right-aligned at the current column)
                 one decode step for all rows         (inactive rows compute, unused)
                 rank 0 samples, broadcasts the tokens and which requests finished

    columns:     row 0  . . . [p p p p g g g]        p = prompt, g = generated, . = masked
                 row 1  . . . . . . [p p g g]         a request that joined later
                                            ^ the next column, written by every row

A request's positions are its own (RoPE), so where its columns sit in the shared
timeline does not matter; the mask hides everything else. A prompt longer than the
timeline so far shifts the running rows right; a full timeline is compacted left.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..models.generate import sample


@dataclass
class Job:
    """What every rank needs of a request (rank 0 keeps the HTTP side in ``Request``)."""

    id: int
    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # alternatives per token (0: the chosen token's only); None: none
    echo: bool = False  # with logprobs: the prompt's own too (its prefill keeps every position's logits)

    @property
    def prompt_logits(self) -> bool:
        return self.echo and self.logprobs is not None


@dataclass
class Slot:
    job: Job
    pos: int  # the position of the next token
    last: int  # the token to feed next
    made: int = 0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)


class Engine:
    def __init__(self, model, max_batch: int, max_len: int | None = None):
        self.model, self.comm = model, model.comm
        self.B = max_batch
        self.max_len = max_len or min(model.config.max_position_embeddings, 4096)
        self.cache = model.new_cache(self.B, self.max_len)
        self.slots: list[Slot | None] = [None] * self.B

    # ------------------------------------------------------------------ lockstep control
    def exchange(self, message):
        """Rank 0's ``message`` on every rank. While requests run, the waiting ranks wait
        in MPI (the message is due within a step; a sleep would add up to its length to
        every step); an idle server's ranks poll with sleeps instead of spinning, leaving
        the cores to rank 0's HTTP threads."""
        comm = self.comm
        if comm is None or comm.size == 1:
            return message
        mpi = comm.mpi
        data = pickle.dumps(message) if comm.rank == 0 else b""
        size = np.array([len(data)], np.int64)
        req = mpi.Ibcast(size, root=0)
        if self.busy:  # every rank knows: the slots change only by what was exchanged
            req.Wait()
        while not req.Test():
            time.sleep(0.0005)
        buf = bytearray(data) if comm.rank == 0 else bytearray(int(size[0]))
        mpi.Bcast(buf, root=0)
        return message if comm.rank == 0 else pickle.loads(bytes(buf))

    @property
    def free(self) -> int:
        return sum(s is None for s in self.slots)

    @property
    def busy(self) -> bool:
        return any(s is not None for s in self.slots)

    # ------------------------------------------------------------------ model steps
    def admit(self, job: Job) -> np.ndarray:
        """Prefill ``job`` into a free row; returns its next-token logits [V] — or, when the
        job asks for its prompt's log-probabilities, every position's [P, V] (the last row
        is the next token's)."""
        m, c = self.model, self.cache
        P = len(job.ids)
        if P > c.length:  # P <= max_len: checked when the request came in
            self._shift(P - c.length)
        r = self.running  # the first free row: running requests hold rows 0 … k-1
        one = m.new_cache(1, P)
        one.valid[:, :P] = True
        xp = m.xp
        every = job.prompt_logits
        logits = m.forward(xp.asarray(np.array([job.ids])), xp.asarray(np.arange(P)[None]), one, last_only=not every)
        L = c.length
        for layer in range(len(c.k)):
            c.k[layer][r, L - P : L] = one.k[layer][0, :P]
            c.v[layer][r, L - P : L] = one.v[layer][0, :P]
        c.valid[r, :] = False
        c.valid[r, L - P : L] = True
        self.slots[r] = Slot(
            job, pos=P, last=-1, rng=np.random.default_rng(job.seed if job.seed is not None else job.id)
        )
        return _host(logits[0]) if every else _host(logits[:, -1])[0]

    def step(self) -> np.ndarray:
        """One decode step for the rows that have a token to feed; returns logits for rows
        0 … k-1, the running ones (rows without a token to feed yet hold garbage: masked
        out, never read). Running requests always hold the lowest rows (``release`` moves
        the last one down), so the step computes k rows, not the whole batch."""
        m, c = self.model, self.cache
        if c.length >= self.max_len or self._unused() > max(256, c.length // 2):
            self._compact()  # full, or most of the timeline belongs to finished requests
        k = self.running
        rows = self.slots[:k]
        feed = [s is not None and s.last >= 0 for s in rows]
        toks = np.array([[s.last if f and s else 0] for s, f in zip(rows, feed)], np.int64)
        pos = np.array([[s.pos if f and s else 0] for s, f in zip(rows, feed)], np.int64)
        c.valid[:k, c.length] = feed  # a row without a token must not see this column later
        view = _Rows(c, k)
        with np.errstate(invalid="ignore", divide="ignore"):  # rows with nothing to attend to
            logits = m.forward(m.xp.asarray(toks), m.xp.asarray(pos), view, last_only=True)[:, -1]
        c.length = view.length
        for s, f in zip(rows, feed):
            if f and s is not None:
                s.pos += 1
        return _host(logits)

    def kv_usage(self) -> float:
        """The share of the cache's rows x columns that running requests attend to."""
        c, k = self.cache, self.running
        return float(c.valid[:k, : c.length].sum()) / (self.B * self.max_len) if k else 0.0

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def pick(self, row: int, logits: np.ndarray) -> int:
        """Rank 0: the next token of the request in ``row``."""
        s = self.slots[row]
        assert s is not None
        j = s.job
        return int(sample(logits[None], s.rng, j.temperature, j.top_k, j.top_p)[0])

    def release(self, row: int) -> int | None:
        """Free ``row``; the last running request moves into it (its keys, values and mask),
        so running requests stay in rows 0 … k-1. Returns the row that moved, or None.
        Release several rows in descending order."""
        c = self.cache
        last = self.running - 1
        moved = None
        if row != last:
            L = c.length
            for arrs in (c.k, c.v):
                for a in arrs:
                    a[row, :L] = a[last, :L]
            c.valid[row] = c.valid[last]
            self.slots[row] = self.slots[last]
            moved = last
        self.slots[last] = None
        c.valid[last, :] = False
        if last == 0:  # nothing runs: the timeline starts again at column 0
            c.length = 0
        return moved

    def _unused(self) -> int:
        """Leading columns of the timeline that no running request attends to."""
        c = self.cache
        used = c.valid[: self.running, : c.length].any(axis=0)
        return int(np.argmax(used)) if used.any() else c.length

    def _shift(self, by: int) -> None:
        """Move every row's columns right by ``by`` (a new prompt longer than the timeline)."""
        c = self.cache
        L = c.length
        for arrs in (c.k, c.v):
            for a in arrs:
                a[:, by : by + L] = a[:, :L].copy()
        c.valid[:, by : by + L] = c.valid[:, :L].copy()
        c.valid[:, :by] = False
        c.length = L + by

    def _compact(self) -> None:
        """Drop the leading columns no running request uses."""
        c = self.cache
        used = c.valid[:, : c.length].any(axis=0)
        first = int(np.argmax(used)) if used.any() else c.length
        if first == 0:
            raise RuntimeError("the KV cache is full: a request longer than the context is running")
        L = c.length - first
        for arrs in (c.k, c.v):
            for a in arrs:
                a[:, :L] = a[:, first : first + L].copy()
        c.valid[:, :L] = c.valid[:, first : first + L].copy()
        c.valid[:, L:] = False
        c.length = L


class _Rows:
    """The first ``k`` rows of a KV cache, as the model's forward sees a cache (views)."""

    def __init__(self, c, k: int):
        self.k = [a[:k] for a in c.k]
        self.v = [a[:k] for a in c.v]
        self.valid = c.valid[:k]
        self.length, self.max_len = c.length, c.max_len


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def world_rank() -> int:
    return MPI.COMM_WORLD.rank
