"""Logging with the rank in every record, as HPC sites expect::

    [rank 3/8 node1] WARNING mpitp.train: ...

Rank 0 logs at INFO and the others at WARNING, so a 64-rank job prints each message once;
``MPITP_LOG_LEVEL`` (or ``--log-level``) sets every rank's level. ``MPITP_LOG_DIR`` adds
one file per rank (``rank00003.log``, all at that rank's level), as ``srun --output=%t``
gives. The standard :mod:`logging` module underneath: ``logging.getLogger("mpitp")``
takes any handler a program adds.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from . import failfast, settings


class _Where(logging.Filter):
    """Stamps each record with ``rank r/N host`` (known once MPI runs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.where = failfast.where()
        return True


def _rank() -> int:
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.rank
    except ImportError:
        pass
    rn = failfast.launched_rank()
    return rn[0] if rn else 0


def setup(level: str | None = None, log_dir: str | None = None) -> logging.Logger:
    """(Re)configure the ``mpitp`` logger; arguments override the MPITP_* settings."""
    env = settings.current()
    rank = _rank()
    lvl = (level or env.log_level or ("INFO" if rank == 0 else "WARNING")).upper()
    logger = logging.getLogger("mpitp")
    for h in list(logger.handlers):
        if getattr(h, "_mpitp", False):
            logger.removeHandler(h)
            h.close()
    logger.setLevel(lvl)
    logger.propagate = False
    fmt = logging.Formatter("[%(where)s] %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    folder = log_dir or env.log_dir
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(folder) / f"rank{rank:05d}.log"))
    for h in handlers:
        h._mpitp = True  # type: ignore[attr-defined]
        h.setFormatter(fmt)
        h.addFilter(_Where())
        logger.addHandler(h)
    return logger


def get_logger(name: str) -> logging.Logger:
    """``mpitp.<name>``, configuring the ``mpitp`` logger on first use."""
    root = logging.getLogger("mpitp")
    if not any(getattr(h, "_mpitp", False) for h in root.handlers):
        setup()
    return logging.getLogger(f"mpitp.{name}")
