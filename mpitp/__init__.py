"""mpitp: large-model parallelism on MPI.

Collectives on NumPy/CuPy arrays (:class:`Communicator`), hand-written ring and
two-level algorithms, tensor-parallel LLaMA and FSDP/ZeRO-3 — all under ``mpiexec``.
"""
from .comm import Communicator, Handle, ReduceOp, Topology, Traffic
from .errors import CollectiveMismatchError, MpitpError, UnsupportedOperation

__version__ = "0.1.0"

__all__ = [
    "Communicator", "Handle", "ReduceOp", "Topology", "Traffic",
    "MpitpError", "CollectiveMismatchError", "UnsupportedOperation", "__version__",
]
