"""mpitp: large-model parallelism on MPI.

Collectives on NumPy/CuPy arrays (:class:`Communicator`), hand-written ring and
two-level algorithms, tensor-parallel LLaMA and FSDP/ZeRO-3 — all under ``mpiexec``.
"""

from .failfast import install as _install_failfast
from .threads import set_default_threads

set_default_threads()  # before NumPy loads its BLAS: a thread pool per core, not per rank
_install_failfast()  # under a multi-rank launcher: an uncaught exception aborts the whole job

from .comm import Communicator, Handle, ReduceOp, Topology, Traffic  # noqa: E402
from .errors import CollectiveMismatchError, MpitpError, UnsupportedOperation  # noqa: E402


def __getattr__(name):
    # the model pulls in safetensors/tokenizers; load it only when asked for
    if name == "LlamaForCausalLM":
        from .models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise AttributeError(f"module 'mpitp' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "Handle",
    "ReduceOp",
    "Topology",
    "Traffic",
    "MpitpError",
    "CollectiveMismatchError",
    "UnsupportedOperation",
    "LlamaForCausalLM",
    "__version__",
]
