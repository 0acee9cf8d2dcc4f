"""Communication layer: collectives on arrays, hand-written algorithms, counters."""

from .communicator import Communicator
from .handle import Handle
from .mpi_types import ReduceOp
from .topology import Topology
from .traffic import Traffic

__all__ = ["Communicator", "Handle", "ReduceOp", "Topology", "Traffic"]
