"""Byte counters: what this rank sent, by collective, peer class and phase.

Two kinds of record, kept apart so that neither is a guess:

* hand-written algorithms and point-to-point calls record every message exactly,
  classified by where the peer lives: ``"intra"`` (same node) or ``"inter"``;
* MPI's own collectives record the payload this rank hands to MPI for other ranks
  (its contribution; the route inside MPI is not visible), under peer class ``"mpi"``.

Phase labels come from ``with comm.phase("forward"): ...``; records outside any
phase go under ``None``.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Traffic:
    total: int = 0
    by_collective: Counter = field(default_factory=Counter)
    by_peer: Counter = field(default_factory=Counter)
    by_phase: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    messages: int = 0
    _phases: list = field(default_factory=list, repr=False)

    @property
    def current_phase(self) -> str | None:
        return self._phases[-1] if self._phases else None

    @contextmanager
    def phase(self, label: str):
        self._phases.append(label)
        try:
            yield self
        finally:
            self._phases.pop()

    def count_call(self, collective: str) -> None:
        self.calls[collective] += 1

    def record(self, nbytes: int, collective: str, peer: str) -> None:
        self.total += nbytes
        self.messages += 1
        self.by_collective[collective] += nbytes
        self.by_peer[peer] += nbytes
        self.by_phase[self._phases[-1] if self._phases else None] += nbytes

    def reset(self) -> None:
        self.total = 0
        self.messages = 0
        for c in (self.by_collective, self.by_peer, self.by_phase, self.calls):
            c.clear()

    def snapshot(self) -> dict:
        return {
            "total": self.total,
            "messages": self.messages,
            "by_collective": dict(self.by_collective),
            "by_peer": dict(self.by_peer),
            "by_phase": {str(k): v for k, v in self.by_phase.items()},
            "calls": dict(self.calls),
        }
