"""Byte counters: what this rank sent, by collective, peer class and phase.

Two kinds of record, kept apart so that neither is a guess:

* hand-written algorithms and point-to-point calls record every message exactly,
  classified by where the peer lives: ``"intra"`` (same node) or ``"inter"``;
* MPI's own collectives record the payload this rank hands to MPI for other ranks
  (its contribution; the route inside MPI is not visible), under peer class ``"mpi"``.

Phase labels come from ``with comm.phase("forward"): ...``; records outside any
phase go under ``None``. Counters live in small lists ("cells") keyed by
(collective, peer, phase); the small-message hot path keeps its cells and bumps them
directly (``epoch`` tells it when to fetch new ones), and the totals below are summed
from the cells when read. A loop over the very same buffers keeps just a tally of its
calls (``tally``), folded into the cells before anything is read or the phase changes.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager


class Traffic:
    def __init__(self, on_epoch=None):
        self._cells: dict = {}     # (collective, peer, phase) -> [bytes, messages]
        self._calls: dict = {}     # collective -> [calls]
        self._phases: list = []
        self._tally = None         # the hot path's [calls] counter, with where it folds to
        # bumped whenever a cell handed out by ``cell``/``calls_cell`` may stop being the
        # right one (a phase starts or ends, counters are reset): holders check it
        self.epoch = 0
        self._on_epoch = on_epoch     # called after every bump (the hot path's holder lets go)

    @property
    def current_phase(self) -> str | None:
        return self._phases[-1] if self._phases else None

    @contextmanager
    def phase(self, label: str):
        self._bump()
        self._phases.append(label)
        try:
            yield self
        finally:
            self._bump()
            self._phases.pop()

    def _bump(self) -> None:
        self._fold()
        self._tally = None
        self.epoch += 1
        if self._on_epoch is not None:
            self._on_epoch()

    def tally(self, collective: str, peer: str, nbytes: int) -> list:
        """A [calls] counter for calls that each send ``nbytes`` in one message to ``peer``
        class (0: nothing sent), folded into the cells when anything is read; one at a
        time (a new one folds the last), valid until ``epoch`` changes (``on_epoch``)."""
        self._fold()
        counter = [0]
        self._tally = (counter, self.calls_cell(collective), self.cell(collective, peer), nbytes)
        return counter

    def _fold(self) -> None:
        if self._tally is None:
            return
        counter, calls, cell, nbytes = self._tally
        n, counter[0] = counter[0], 0
        calls[0] += n
        if nbytes:
            cell[0] += n * nbytes
            cell[1] += n

    def cell(self, collective: str, peer: str) -> list:
        """The [bytes, messages] counters of (collective, peer) in the current phase; valid
        while ``epoch`` is unchanged (the small-message hot path keeps one)."""
        key = (collective, peer, self._phases[-1] if self._phases else None)
        c = self._cells.get(key)
        if c is None:
            c = self._cells[key] = [0, 0]
        return c

    def calls_cell(self, collective: str) -> list:
        c = self._calls.get(collective)
        if c is None:
            c = self._calls[collective] = [0]
        return c

    def count_call(self, collective: str) -> None:
        self.calls_cell(collective)[0] += 1

    def record(self, nbytes: int, collective: str, peer: str) -> None:
        c = self.cell(collective, peer)
        c[0] += nbytes
        c[1] += 1

    def _sum(self, index: int) -> Counter:
        self._fold()
        out: Counter = Counter()
        for key, (n, _) in self._cells.items():
            out[key[index]] += n
        return out

    @property
    def total(self) -> int:
        self._fold()
        return sum(n for n, _ in self._cells.values())

    @property
    def messages(self) -> int:
        self._fold()
        return sum(m for _, m in self._cells.values())

    @property
    def by_collective(self) -> Counter:
        return self._sum(0)

    @property
    def by_peer(self) -> Counter:
        return self._sum(1)

    @property
    def by_phase(self) -> Counter:
        return self._sum(2)

    @property
    def calls(self) -> Counter:
        self._fold()
        return Counter({k: n for k, (n,) in self._calls.items()})

    def reset(self) -> None:
        self._tally = None          # its calls are dropped with the rest
        self._cells.clear()
        self._calls.clear()
        self._bump()

    def snapshot(self) -> dict:
        return {
            "total": self.total,
            "messages": self.messages,
            "by_collective": dict(self.by_collective),
            "by_peer": dict(self.by_peer),
            "by_phase": {str(k): v for k, v in self.by_phase.items()},
            "calls": dict(self.calls),
        }

    def __repr__(self) -> str:
        return f"Traffic(total={self.total}, by_peer={dict(self.by_peer)}, calls={dict(self.calls)})"
