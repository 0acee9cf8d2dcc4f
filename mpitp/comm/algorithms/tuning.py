"""Tuning file for ``algorithm="auto"``: where the ring overtakes MPI's own call.

Written by ``mpitp bench allreduce --tune`` (in the spirit of MPICH's JSON collective
selection files), read from ``MPITP_TUNING`` or ``~/.config/mpitp/tuning.json``::

    {"version": 1, "mpi_library": "MPICH Version: 5.0.2",
     "allreduce": {"2": 262144, "4": 1048576},      # world size -> crossover bytes
     "reduce_scatter": {"2": 262144}}

Rank 0 reads it and broadcasts it, so every rank makes the same choice.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from mpi4py import MPI


def library_version() -> str:
    """The MPI library in use, as one line: the first of ``MPI_Get_library_version``
    (Open MPI pads it with NUL bytes). Tuning files record it."""
    text = MPI.Get_library_version().replace("\x00", "").strip()
    return text.splitlines()[0].strip() if text else "unknown MPI"


@lru_cache(maxsize=1)
def mpi_flavor() -> str:
    """``"mpich"``, ``"openmpi"`` or ``"other"``: which built-in crossover table applies."""
    v = library_version().lower()
    return "openmpi" if "open mpi" in v else "mpich" if "mpich" in v else "other"


def default_path() -> Path:
    from ... import settings

    env = settings.current().tuning
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "mpitp" / "tuning.json"


def load(path: str | Path | None = None) -> dict:
    p = Path(path) if path else default_path()
    try:
        with open(p) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def key(collective: str, nodes: int = 1) -> str:
    """The tuning file's entry: ``allreduce`` on one node, ``allreduce@2nodes`` across two
    (where the contender is the two-level all-reduce, not the flat ring)."""
    return collective if nodes <= 1 else f"{collective}@{nodes}nodes"


def crossover(table: dict, collective: str, size: int) -> int | None:
    """Crossover bytes for this world size: exact entry, else the nearest smaller size measured."""
    entries = table.get(collective) or {}
    known = sorted((int(k), v) for k, v in entries.items() if str(k).isdigit())
    if not known:
        return None
    best = [v for k, v in known if k <= size] or [known[0][1]]
    return int(best[-1])


def fit_crossover(rows, contender: str = "ring") -> int:
    """Smallest measured size from which ``contender`` is faster than MPI at every larger size."""
    by: dict[int, dict[str, float]] = {}
    for r in rows:
        by.setdefault(r.size_bytes, {})[r.algorithm] = r.time_us
    sizes = sorted(s for s, t in by.items() if "mpi" in t and contender in t)
    cross = 1 << 62
    for s in reversed(sizes):
        if by[s][contender] < by[s]["mpi"]:
            cross = s
        else:
            break
    return cross


def write_crossover(path, collective: str, size: int, rows, nodes: int = 1) -> Path:
    """Record where the ring (one node) or the two-level all-reduce (``nodes`` > 1)
    overtakes MPI's own call in ``rows``, for this world size."""
    p = Path(path) if path else default_path()
    data = load(p)
    data["version"] = 1
    data["mpi_library"] = library_version()
    contender = "hierarchical" if nodes > 1 else "ring"
    data.setdefault(key(collective, nodes), {})[str(size)] = fit_crossover(rows, contender)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, p)  # atomic: a concurrent reader sees the old file or the new one
    return p
