"""When one rank fails, end the whole job instead of leaving the others waiting.

Under a multi-rank launcher (mpiexec of MPICH or Open MPI, srun), ``import mpitp``
installs an exception hook: an uncaught exception on any rank prints that rank's
traceback once, headed ``[rank r/N host]``, then calls ``MPI_Abort`` so the launcher
tears the job down within seconds (mpi4py's ``python -m mpi4py`` does the same; without
it the other ranks block in their next collective forever). ``MPITP_ABORT_ON_ERROR=0``
leaves the hook out, for programs that handle errors themselves.

Exit status of a job (what the launcher returns):

    0  success
    1  a rank raised an uncaught exception: its traceback, then MPI_Abort(1)
    2  usage or input error (bad argument, missing file, corrupt checkpoint): one message,
       every rank exits 2 (a rank whose peers did not fail the same way aborts with 2)
    3  the watchdog (MPITP_TIMEOUT) or a transport failure inside a collective aborted
    other  a rank was killed (e.g. 137 = SIGKILL) and the launcher ended the job
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

EXIT_ERROR, EXIT_USAGE, EXIT_WATCHDOG = 1, 2, 3

_RANK_VARS = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)


def launched_rank(environ=os.environ) -> tuple[int, int] | None:
    """(rank, world size) as the launcher announces it, before MPI starts; None alone."""
    for rank_var, size_var in _RANK_VARS:
        r, n = environ.get(rank_var, ""), environ.get(size_var, "")
        if r.isdigit() and n.isdigit():
            return int(r), int(n)
    return None


def where(environ=os.environ) -> str:
    """``rank r/N host`` for messages: from MPI when it runs, else from the launcher."""
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            w = MPI.COMM_WORLD
            return f"rank {w.rank}/{w.size} {socket.gethostname().split('.')[0]}"
    except ImportError:
        pass
    rn = launched_rank(environ)
    host = socket.gethostname().split(".")[0]
    return f"rank {rn[0]}/{rn[1]} {host}" if rn else host


def abort(code: int, message: str | None = None) -> None:
    """Print ``message`` (if any), then end every rank of the job with ``code``."""
    sys.stderr.flush()
    sys.stdout.flush()
    if message:  # to the process's own stderr, past any Python-level capture (pytest's)
        os.write(2, (message if message.endswith("\n") else message + "\n").encode(errors="replace"))
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            time.sleep(0.2)  # let the launcher forward the message before the teardown
            MPI.COMM_WORLD.Abort(code)
    except ImportError:
        pass
    os._exit(code)  # should Abort ever return


def _hook(tp, value, tb) -> None:
    if issubclass(tp, SystemExit):  # sys.exit() is not a failure of the job
        return sys.__excepthook__(tp, value, tb)
    head = f"[{where()}] "
    lines = "".join(traceback.format_exception(tp, value, tb)).rstrip("\n").split("\n")
    abort(
        EXIT_ERROR,
        "".join(head + line + "\n" for line in lines)
        + f"{head}uncaught {tp.__name__}: aborting the whole job (MPITP_ABORT_ON_ERROR=0 keeps the other "
        "ranks running)\n",
    )


def install(environ=os.environ) -> bool:
    """Install the hook when a launcher started several ranks and the user did not opt out."""
    rn = launched_rank(environ)
    if rn is None or rn[1] <= 1:
        return False
    from .settings import Settings

    if not Settings.from_env(environ).abort_on_error:
        return False
    sys.excepthook = _hook
    return True


def usage_error(message: str, what: str = "mpitp", grace: float = 5.0) -> int:
    """An input error raised on this rank: if every rank raised it (the usual case: they
    read the same arguments), rank 0 prints it once and each returns 2. If the other
    ranks are still working (the error is this rank's alone), waiting for them would
    hang: after ``grace`` seconds this rank prints it with its rank and aborts with 2."""
    try:
        from mpi4py import MPI
    except ImportError:
        print(f"{what}: {message}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.size == 1:
        print(f"{what}: {message}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    w = MPI.COMM_WORLD
    req = w.Ibarrier()
    deadline = time.monotonic() + grace
    while not req.Test():
        if time.monotonic() > deadline:
            abort(EXIT_USAGE, f"[{where()}] {what}: {message} (only some ranks failed: aborting the job)")
        time.sleep(0.01)
    if w.rank == 0:
        print(f"{what}: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE
