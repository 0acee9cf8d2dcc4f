"""auto's choice: the built-in crossovers per collective and MPI library, a tuning file
over them, and the same answer for every rank-independent input."""

import pytest

from mpitp.comm.algorithms import select
from mpitp.comm.mpi_types import ReduceOp
from mpitp.errors import UnsupportedOperation

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(params=["mpich", "openmpi", "other"])
def flavor(request, monkeypatch):
    monkeypatch.setattr(select.tuning, "mpi_flavor", lambda: request.param)
    return request.param


def test_allreduce_crossovers(flavor):
    two = {"mpich": 256 * KiB, "openmpi": 256 * KiB, "other": MiB}[flavor]
    more = {"mpich": 4 * MiB, "openmpi": 4 * MiB, "other": 16 * MiB}[flavor]
    assert select.crossover("allreduce", 2, None) == two
    assert select.crossover("allreduce", 3, None) == select.crossover("allreduce", 4, None) == more
    assert select.choose("allreduce", "auto", two - 1, 2, ReduceOp.parse("sum"), None) == "mpi"
    assert select.choose("allreduce", "auto", two, 2, ReduceOp.parse("sum"), None) == "ring"


def test_small_allreduces_take_the_oneshot_where_it_is_open(flavor):
    s = ReduceOp.parse("sum")
    assert select.choose("allreduce", "auto", 64 * KiB, 2, s, None, None, 64 * KiB) == "oneshot"
    assert select.choose("allreduce", "auto", 64 * KiB + 1, 2, s, None, None, 64 * KiB) == "mpi"
    assert select.choose("allreduce", "auto", 0, 2, s, None, None, 0) == "mpi"  # not open: MPI's
    assert select.choose("allreduce", "auto", 64, 1, s, None, None, 64 * KiB) == "mpi"  # alone
    assert select.choose("allreduce", "oneshot", 64, 4, s, None) == "oneshot"
    assert select.choose("reduce_scatter", "auto", 64, 2, s, None, None, 64 * KiB) == "mpi"


def test_reduce_scatter_crossovers(flavor):
    want = {"mpich": (256 * KiB, 64 * MiB), "openmpi": (256 * KiB, MiB), "other": (select.NEVER,) * 2}[flavor]
    assert (select.crossover("reduce_scatter", 2, None), select.crossover("reduce_scatter", 4, None)) == want
    big = 64 * MiB
    assert select.choose("reduce_scatter", "auto", big, 2, ReduceOp.parse("sum"), None) == (
        "mpi" if flavor == "other" else "ring"
    )


def test_others_stay_with_mpi(flavor):
    for coll in ("allgather", "broadcast", "reduce", "gather", "scatter", "alltoall"):
        assert select.crossover(coll, 2, None) == select.NEVER
        assert select.choose(coll, "auto", 1 << 30, 4, None, None) == "mpi"


def test_tuning_file_overrides(flavor):
    table = {"allreduce": {"2": 0, "4": 1 << 40}}
    assert select.crossover("allreduce", 2, table) == 0
    assert select.crossover("allreduce", 3, table) == 0  # nearest smaller size measured
    assert select.crossover("allreduce", 8, table) == 1 << 40
    assert select.choose("allreduce", "auto", 4, 2, ReduceOp.parse("sum"), None, table) == "ring"


def test_one_rank_and_bad_requests():
    assert select.choose("allreduce", "auto", 1 << 30, 1, ReduceOp.parse("sum"), None) == "mpi"
    with pytest.raises(UnsupportedOperation, match="no algorithm 'ring'"):
        select.choose("broadcast", "ring", 8, 2, None, None)


def test_tuned_crossover_across_nodes(flavor):
    """A tuning file's ``allreduce@2nodes`` entry (written by --tune on two nodes) decides
    across two nodes, where auto picks the two-level algorithm; one node keeps its own."""
    from mpitp.comm.topology import Topology

    table = {"allreduce": {"4": 8 * MiB}, "allreduce@2nodes": {"4": MiB}}
    two_nodes, one_node = Topology(0, (0, 0, 1, 1)), Topology(0, (0, 0, 0, 0))
    assert select.crossover("allreduce", 4, table, nodes=2) == MiB
    assert select.crossover("allreduce", 4, table, nodes=1) == 8 * MiB
    assert select.crossover("allreduce", 4, {"allreduce": {"4": 8 * MiB}}, nodes=2) == 8 * MiB  # no entry: one node's
    s = ReduceOp.parse("sum")
    assert select.choose("allreduce", "auto", MiB - 1, 4, s, two_nodes, table) == "mpi"
    assert select.choose("allreduce", "auto", MiB, 4, s, two_nodes, table) == "hierarchical"
    assert select.choose("allreduce", "auto", MiB, 4, s, one_node, table) == "mpi"
    assert select.choose("allreduce", "auto", 8 * MiB, 4, s, one_node, table) == "ring"
