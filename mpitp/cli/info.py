"""``mpitp info``: the MPI library, the world, the node layout, CUDA-awareness, versions."""

from __future__ import annotations

import json
import platform


def add_parser(sub) -> None:
    p = sub.add_parser(
        "info",
        help="show MPI library, world size, node layout, CUDA-awareness, versions",
        description="Print what mpitp sees: MPI library and version, world size, node "
        "layout (MPITP_RANKS_PER_NODE simulates nodes), whether MPI is "
        "CUDA-aware, and NumPy/CuPy versions. Rank 0 prints.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")


def collect(comm) -> dict:
    import mpi4py
    from mpi4py import MPI

    from .. import __version__, backend
    from ..comm.algorithms.tuning import library_version

    lib = library_version()
    topo = comm.topology
    path, kind = mpi_library_path() if comm.rank == 0 else (None, None)
    from .. import threads

    per, why = threads.CHOICE
    return {
        **_cpu(),
        "mpitp": __version__,
        "python": platform.python_version(),
        "mpi4py": mpi4py.__version__,
        "mpi_library": lib,
        "mpi_library_path": path,
        "mpi_library_kind": kind,
        "threads_per_rank": per,
        "threads_reason": why,
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "world_size": comm.size,
        "processor": MPI.Get_processor_name(),
        "nodes": [list(r) for r in topo.nodes],
        "leaders": list(topo.leaders),
        "simulated_nodes": topo.simulated,
        "cuda_aware_mpi": backend.cuda_aware_mpi(),
        **backend.versions(),
    }


def _cpu() -> dict:
    """The CPU as the int8 kernels see it (llvmlite comes with numba; absent, none)."""
    try:
        from ..kernels import cpu
    except ImportError:
        return {"cpu": None, "int8_isas": [], "int8_isa": None, "activations": "float32"}
    try:
        chosen, act = cpu.isa(), str(cpu.activations())
    except ValueError as e:
        chosen, act = f"error: {e}", "error"
    from ..kernels import parallel

    try:
        kernel_threads: int | str = parallel.check(parallel.threads())
    except ValueError as e:
        kernel_threads = f"error: {e}"
    return {
        "cpu": cpu.host()[0],
        "int8_isas": list(cpu.supported()),
        "int8_isa": chosen,
        "activations": act,
        "kernel_threads": kernel_threads,
    }


def mpi_library_path() -> tuple[str | None, str]:
    """The MPI shared library mpi4py loaded (``python -m mpi4py --mpi-library``) and what it
    is: a PyPI wheel inside this Python environment, or a site MPI (modules, system)."""
    import subprocess
    import sys
    from pathlib import Path

    try:
        out = subprocess.run(
            [sys.executable, "-m", "mpi4py", "--mpi-library"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None, "unknown"
    if not out:
        return None, "unknown"
    inside = Path(out).resolve().is_relative_to(Path(sys.prefix).resolve())
    return out, "PyPI wheel in this Python environment" if inside else "site MPI (not from this environment)"


def run(args) -> int:
    from ..comm import Communicator

    with Communicator() as comm:  # freed however the command ends
        return _info(args, comm)


def _info(args, comm) -> int:
    data = collect(comm)
    if comm.rank == 0:
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print(f"mpitp {data['mpitp']}  (python {data['python']}, mpi4py {data['mpi4py']})")
            print(f"MPI library:    {data['mpi_library']}  (MPI {data['mpi_standard']})")
            print(f"                {data['mpi_library_path']}: {data['mpi_library_kind']}")
            per = data["threads_per_rank"]
            print(f"BLAS threads:   {per if per else 'unchanged'} per rank ({data['threads_reason']})")
            print(f"world size:     {data['world_size']}")
            print(
                f"CPU:            {data['cpu']}; int8 dot products: {', '.join(data['int8_isas']) or 'none'}; "
                f"in use: {data['int8_isa']}; activations of block weights: {data['activations']}; "
                f"kernel threads per rank: {data.get('kernel_threads', 1)} (MPITP_THREADS, --threads)"
            )
            aware = "yes" if data["cuda_aware_mpi"] else "no (device arrays are staged through host memory)"
            print(f"CUDA-aware MPI: {aware}")
            print(f"numpy {data['numpy']}, cupy {data['cupy'] or 'not installed'}")
            print("layout:         " + comm.topology.describe().replace("\n", "\n                "))
    return 0
