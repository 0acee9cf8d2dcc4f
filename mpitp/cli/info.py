"""``mpitp info``: the MPI library, the world, the node layout, CUDA-awareness, versions."""
from __future__ import annotations

import json
import platform


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="show MPI library, world size, node layout, CUDA-awareness, versions",
                       description="Print what mpitp sees: MPI library and version, world size, node "
                                   "layout (MPITP_RANKS_PER_NODE simulates nodes), whether MPI is "
                                   "CUDA-aware, and NumPy/CuPy versions. Rank 0 prints.")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")


def collect(comm) -> dict:
    import mpi4py
    from mpi4py import MPI

    from .. import __version__, backend
    from ..comm.library import library_version

    lib = library_version()
    topo = comm.topology
    return {
        "mpitp": __version__,
        "python": platform.python_version(),
        "mpi4py": mpi4py.__version__,
        "mpi_library": lib,
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "world_size": comm.size,
        "processor": MPI.Get_processor_name(),
        "nodes": [list(r) for r in topo.nodes],
        "leaders": list(topo.leaders),
        "simulated_nodes": topo.simulated,
        "cuda_aware_mpi": backend.cuda_aware_mpi(),
        **backend.versions(),
    }


def run(args) -> int:
    from ..comm import Communicator

    comm = Communicator()
    data = collect(comm)
    if comm.rank == 0:
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print(f"mpitp {data['mpitp']}  (python {data['python']}, mpi4py {data['mpi4py']})")
            print(f"MPI library:    {data['mpi_library']}  (MPI {data['mpi_standard']})")
            print(f"world size:     {data['world_size']}")
            print(f"CUDA-aware MPI: {'yes' if data['cuda_aware_mpi'] else 'no (device arrays are staged through host memory)'}")
            print(f"numpy {data['numpy']}, cupy {data['cupy'] or 'not installed'}")
            print("layout:         " + comm.topology.describe().replace("\n", "\n                "))
    comm.free()
    return 0
