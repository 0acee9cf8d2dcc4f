"""Cross-rank argument checks: the same clear exception on every rank.

Before a collective runs, each rank contributes a small signature (collective, dtype,
shape, op, root, algorithm, and any local argument error) in a fixed-size slot. All
ranks all-gather the slots, so every rank sees the same evidence and raises the same
:class:`~mpitp.errors.CollectiveMismatchError` — nobody is left waiting inside MPI.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveMismatchError
from .handle import Watchdog

SLOT = 4096  # bytes per rank


def exchange(mpi: MPI.Comm, watchdog: Watchdog, label: str, sig: dict, error: BaseException | None) -> list:
    """All-gather every rank's ``(signature, error text)``."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    payload = pickle.dumps((sig, text))
    if len(payload) > SLOT - 8:
        payload = pickle.dumps(({"collective": sig.get("collective")}, text or "arguments too large to describe"))
    slot = np.zeros(SLOT, np.uint8)
    slot[:8] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
    slot[8 : 8 + len(payload)] = np.frombuffer(payload, np.uint8)
    table = np.empty((mpi.size, SLOT), np.uint8)
    watchdog.wait([mpi.Iallgather(slot, table)], f"validation of {label}")
    out = []
    for row in table:
        n = int(row[:8].view(np.int64)[0])
        out.append(pickle.loads(row[8 : 8 + n].tobytes()))
    return out


def check(gathered: list[tuple[dict, str | None]], same: tuple[str, ...]) -> None:
    """Raise on every rank if any rank erred or a field in ``same`` differs.

    The message is built from the gathered evidence only (named after rank 0's call),
    so it is identical on every rank."""
    first = gathered[0][0]
    label = f"{first.get('collective')} #{first.get('seq')}"
    errors = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise CollectiveMismatchError(f"{label}: invalid arguments on {len(errors)} rank(s): {detail}")
    for key in same:
        values: list[Any] = [s.get(key) for s, _ in gathered]
        if any(v != values[0] for v in values[1:]):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise CollectiveMismatchError(f"{label}: {key} differs across ranks ({listing})")
