"""Byte counters: what this rank sent, by collective, peer class and phase.

Two kinds of record, kept apart so that neither is a guess:

* hand-written algorithms and point-to-point calls record every message exactly,
  classified by where the peer lives: ``"intra"`` (same node) or ``"inter"``;
* MPI's own collectives record the payload this rank hands to MPI for other ranks
  (its contribution; the route inside MPI is not visible), under peer class ``"mpi"``.

Phase labels come from ``with comm.phase("forward"): ...``; records outside any
phase go under ``None``. Each record touches one dict entry keyed by
(collective, peer, phase) — it sits on the small-message hot path — and the totals
below are summed from those entries when read.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager


class Traffic:
    def __init__(self):
        self._bytes: dict = {}     # (collective, peer, phase) -> bytes
        self._msgs: dict = {}      # (collective, peer, phase) -> messages
        self._calls: dict = {}     # collective -> calls
        self._phases: list = []

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
        self._calls[collective] = self._calls.get(collective, 0) + 1

    def record(self, nbytes: int, collective: str, peer: str) -> None:
        key = (collective, peer, self._phases[-1] if self._phases else None)
        self._bytes[key] = self._bytes.get(key, 0) + nbytes
        self._msgs[key] = self._msgs.get(key, 0) + 1

    def record_call(self, collective: str, nbytes: int, peer: str) -> None:
        """One call that handed ``nbytes`` to MPI, in one go (the hot path: no further calls)."""
        calls, b, m = self._calls, self._bytes, self._msgs
        calls[collective] = calls.get(collective, 0) + 1
        if nbytes:
            key = (collective, peer, self._phases[-1] if self._phases else None)
            b[key] = b.get(key, 0) + nbytes
            m[key] = m.get(key, 0) + 1

    def _sum(self, index: int) -> Counter:
        out: Counter = Counter()
        for key, n in self._bytes.items():
            out[key[index]] += n
        return out

    @property
    def total(self) -> int:
        return sum(self._bytes.values())

    @property
    def messages(self) -> int:
        return sum(self._msgs.values())

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
        return Counter(self._calls)

    def reset(self) -> None:
        self._bytes.clear()
        self._msgs.clear()
        self._calls.clear()

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
        return f"Traffic(total={self.total}, by_peer={dict(self.by_peer)}, calls={dict(self._calls)})"
