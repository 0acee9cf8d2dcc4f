"""Communicator.split, .group and .mesh: membership and order against MPI's own
arithmetic, results of collectives on the sub-communicators against NumPy, and the node
map (real or simulated) carried into them so traffic still splits intra / inter."""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

import mpitp
from mpitp.comm.mesh import MeshError

N = MPI.COMM_WORLD.size
DIVISORS = [t for t in range(1, N + 1) if N % t == 0]


def test_split_by_color_and_key(comm):
    sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each color
    members = [r for r in range(N) if r % 2 == comm.rank % 2]
    agree(sub.size == len(members) and sub.rank == members[::-1].index(comm.rank), f"rank {sub.rank}/{sub.size}")
    total = sub.allreduce(np.array([comm.rank], np.int64))[0]
    agree(total == sum(members), f"sum over the color: {total}")
    sub.free()
    none = comm.split(None if comm.rank == 0 else 1)
    agree((none is None) == (comm.rank == 0), "color None: no communicator")
    agree(none is None or none.size == N - 1, "the others")  # agree() is collective: every rank calls it
    if none is not None:
        none.free()


def test_group_of_listed_ranks(comm):
    ranks = sorted({0, N - 1})[::-1]  # given order is the new rank order
    g = comm.group(ranks)
    agree((g is not None) == (comm.rank in ranks), "membership")
    got = g.allgather(np.array([comm.rank])).tolist() if g is not None else ranks
    agree(g is None or (g.rank == ranks.index(comm.rank) and g.size == len(ranks)), "order")
    agree(got == ranks, f"allgather {got}")
    if g is not None:
        g.free()
    for bad in ([], [0, 0], [N]):
        with pytest.raises(ValueError):
            comm.group(bad)


@pytest.mark.parametrize("tp", DIVISORS)
def test_mesh_groups(comm, tp):
    dp = N // tp
    m = comm.mesh((dp, tp), ("dp", "tp"))
    d, t = m.coords
    agree(m.rank_at((d, t)) == comm.rank and m.coord("tp") == t and m["tp"].rank == t and m["dp"].rank == d, "coords")
    agree(m["tp"].size == tp and m["dp"].size == dp, "sizes")
    tp_members = [m.rank_at((d, j)) for j in range(tp)]
    dp_members = [m.rank_at((i, t)) for i in range(dp)]
    agree(m["tp"].allgather(np.array([comm.rank])).tolist() == tp_members, "tp group = a row of the grid")
    agree(m["dp"].allgather(np.array([comm.rank])).tolist() == dp_members, "dp group = a column")
    x = np.full(1001, comm.rank + 1.0)
    agree(np.array_equal(m["tp"].allreduce(x, algorithm="ring"), np.full(1001, sum(r + 1.0 for r in tp_members))), "tp")
    m.free()
    with pytest.raises(MeshError):
        comm.mesh((N + 1, 1), ("dp", "tp"))
    with pytest.raises(KeyError):
        comm.mesh((N,), ("dp",))["tp"]


@pytest.mark.skipif(N != 4, reason="two simulated nodes of two ranks")
def test_mesh_keeps_tp_inside_simulated_nodes():
    c = mpitp.Communicator(ranks_per_node=2)
    m = c.mesh((2, 2), ("dp", "tp"))
    agree(m["tp"].topology.num_nodes == 1 and m["dp"].topology.num_nodes == 2, "tp inside a node, dp across")
    for name, peer in (("tp", "intra"), ("dp", "inter")):
        sub = m[name]
        sub.traffic.reset()
        sub.allreduce(np.ones(1000, np.float32), algorithm="ring")
        t = sub.traffic.by_peer
        agree(set(t) == {peer} and t[peer] == 2 * 1000 // 2 * 4, f"{name}: {dict(t)}")  # ring of 2: half out, half back
    m.free()
    c.free()
