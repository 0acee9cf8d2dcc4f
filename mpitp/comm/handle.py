"""Driving communication steps: blocking waits, nonblocking handles, the watchdog.

Every collective is written as a generator that posts MPI requests and yields the ones
it needs finished before its next step; its ``return`` value is the result. The same
generator runs blocking (:func:`drive`) or nonblocking (:class:`Handle`), and every wait
goes through :class:`Watchdog`, so a collective that one rank never enters aborts the
job with a message instead of hanging it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Generator
from typing import Any

from mpi4py import MPI

Steps = Generator[Any, None, Any]  # yields Request | list[Request]; returns the result


class Watchdog:
    """Abort the whole job when one wait exceeds ``timeout`` seconds (None: wait forever)."""

    def __init__(self, timeout: float | None, rank: int):
        self.timeout = timeout if timeout and timeout > 0 else None
        self.rank = rank

    @classmethod
    def from_env(cls, timeout: float | None, rank: int) -> Watchdog:
        if timeout is None:
            from .. import settings

            timeout = settings.current().timeout
        return cls(timeout, rank)

    def wait(self, reqs: list, label: str) -> None:
        if self.timeout is None:
            MPI.Request.Waitall(reqs)
            return
        self.until(lambda: MPI.Request.Testall(reqs), label)

    def until(self, ready, label: str) -> None:
        """Poll ``ready()`` until it is true, aborting the job past the timeout (with one set)."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        spins = 0
        while not ready():
            spins += 1
            if spins % 64 == 0:
                if deadline is not None and time.monotonic() > deadline:
                    self.abort(label)
                time.sleep(0)  # let an oversubscribed peer run

    def abort(self, label: str) -> None:
        # where this rank waits, in the same write as the message: two ranks that give up
        # at once would otherwise interleave their lines (and a short write stays whole)
        stack = "".join(traceback.format_stack(limit=24)[:-1])  # the innermost frames, not abort
        self._end(
            f"mpitp watchdog: rank {self.rank} waited more than {self.timeout:g} s in {label}; "
            "another rank never entered it or is stuck. Aborting the job (MPITP_TIMEOUT).\n"
            f"mpitp watchdog: rank {self.rank} waits here (its Python stack):\n{stack}"
        )

    def fail(self, label: str, reason: str) -> None:
        """End the job over an error in the middle of a collective, where the other ranks
        are already waiting on this one (raising here would leave them hanging)."""
        self._end(f"mpitp: rank {self.rank} failed in {label}: {reason}. Aborting the job.")

    def _end(self, msg: str) -> None:
        from ..failfast import EXIT_WATCHDOG, abort

        abort(EXIT_WATCHDOG, msg)


def _as_list(reqs) -> list:
    if reqs is None:
        return []
    return list(reqs) if isinstance(reqs, (list, tuple)) else [reqs]


def drive(steps: Steps, watchdog: Watchdog, label: str) -> Any:
    """Run a collective's steps to completion (blocking)."""
    try:
        reqs = next(steps)
        while True:
            watchdog.wait(_as_list(reqs), label)
            reqs = steps.send(None)
    except StopIteration as stop:
        return stop.value


class Handle:
    """A collective in flight. ``wait()`` returns its result; ``test()`` polls.

    MPI makes progress on hand-written algorithms only inside ``test``/``wait``: call
    them from time to time while computing.
    """

    def __init__(self, steps: Steps, watchdog: Watchdog, label: str):
        self._steps, self._watchdog, self.label = steps, watchdog, label
        self._done, self._result = False, None
        self._pending: list = []
        self._advance(first=True)

    def _advance(self, first: bool = False) -> None:
        try:
            reqs = next(self._steps) if first else self._steps.send(None)
            self._pending = _as_list(reqs)
        except StopIteration as stop:
            self._done, self._result, self._pending = True, stop.value, []

    def test(self) -> bool:
        while not self._done:
            if not MPI.Request.Testall(self._pending):
                return False
            self._advance()
        return True

    def wait(self) -> Any:
        while not self._done:
            self._watchdog.wait(self._pending, self.label)
            self._advance()
        return self._result

    @property
    def done(self) -> bool:
        return self._done

    @property
    def pending(self) -> list:
        """The requests the next step waits for."""
        return self._pending
