"""Byte counters: what this rank sent, by collective, peer class and phase.

Two kinds of record, kept apart so that neither is a guess:

* hand-written algorithms and point-to-point calls record every message exactly,
  classified by where the peer lives: ``"intra"`` (same node) or ``"inter"``;
* MPI's own collectives record the payload this rank hands to MPI for other ranks
  (its contribution; the route inside MPI is not visible), under peer class ``"mpi"``.

Phase labels come from ``with comm.phase("forward"): ...``; records outside any
phase go under ``None``. Counters live in small lists ("cells") keyed by
(collective, peer, phase); the small all-reduce's fast path keeps its cells and bumps
them directly (``epoch`` tells it when to fetch new ones), and the totals below are
summed from the cells when read.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager


class Traffic:
    def __init__(self):
        self._cells: dict = {}  # (collective, peer, phase) -> [bytes, messages]
        self._calls: dict = {}  # collective -> [calls]
        self._phases: list = []
        # bumped whenever a cell handed out by ``cell``/``calls_cell`` may stop being the
        # right one (a phase starts or ends, counters are reset): holders check it
        self.epoch = 0

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
        self.epoch += 1

    def cell(self, collective: str, peer: str) -> list:
        """The [bytes, messages] counters of (collective, peer) in the current phase; valid
        while ``epoch`` is unchanged (the small all-reduce's fast path keeps one)."""
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
        out: Counter = Counter()
        for key, (n, _) in self._cells.items():
            out[key[index]] += n
        return out

    @property
    def total(self) -> int:
        return sum(n for n, _ in self._cells.values())

    @property
    def messages(self) -> int:
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
        return Counter({k: n for k, (n,) in self._calls.items()})

    def reset(self) -> None:
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
