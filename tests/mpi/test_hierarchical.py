"""Two-level all-reduce on simulated nodes (1, 2 and 3 of them, uneven ones included):
results against MPI's own call and NumPy, and traffic counters against the bytes the
algorithm sends by its description (chunks cut by numpy.array_split) — and mpitp.plan's
exact prediction equal to those."""

import numpy as np
import pytest
from helpers import (
    agree,
    bound,
    close,
    cma_permitted,
    mpi_reference,
    numpy_reference,
    rank_inputs,
    ring_sends,
    same_on_all_ranks,
    two_level_sends,
)
from mpi4py import MPI

import mpitp
from mpitp.comm.transport import shm
from mpitp.plan.allreduce import per_rank_elements

N = MPI.COMM_WORLD.size
LAYOUTS = sorted({-(-N // nodes) for nodes in (1, 2, 3)})  # ranks per node giving 1, 2, 3 nodes
ALGS = ["hierarchical", "hierarchical_leader"]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda k: f"{k}-per-node")
def ncomm(request):
    c = mpitp.Communicator(ranks_per_node=request.param)
    yield c
    c.free()


# 700k: pipelined pieces; 1000 and 65537 only at 1-4 ranks (the 5-8-rank launches keep the
# sizes whose cut the world size changes: empty, one element, N - 1, N + 1, and pipelined)
SIZES = [0, 1, max(N - 1, 1), N + 1, *([1000, 65537] if N <= 4 else []), 700_001]


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize(
    "dtype,op",
    [("int64", "sum"), ("int32", "max"), ("float32", "sum"), ("float64", "prod"), ("uint8", "sum"), ("float16", "min")],
)
@pytest.mark.parametrize("n", SIZES)
def test_matches_mpi(ncomm, alg, dtype, op, n):
    inputs = rank_inputs((n,), dtype, op, N, seed=n + len(dtype))
    x = inputs[ncomm.rank]
    y = ncomm.allreduce(x, op=op, algorithm=alg)
    tol, where = bound(inputs, op, dtype), f"{alg} {dtype} {op} n={n} nodes={ncomm.topology.nodes}"
    ref_mpi = mpi_reference(x, op)  # None: this MPI computes it wrongly; NumPy's below stands
    agree(ref_mpi is None or close(y, ref_mpi, tol), f"{where}: differs from MPI's own Allreduce")
    agree(close(y, numpy_reference(inputs, op), tol), f"{where}: differs from NumPy")
    agree(same_on_all_ranks(y), f"{alg}: ranks disagree bitwise")


@pytest.mark.parametrize("alg", ALGS)
def test_inplace_and_shapes(ncomm, alg):
    x = np.full((5, 7), ncomm.rank + 1, np.float64)
    r = ncomm.allreduce(x, out=x, algorithm=alg)
    agree(r is x and np.all(x == N * (N + 1) / 2), "in place")


@pytest.mark.parametrize("alg", ["ring"] + ALGS)
@pytest.mark.parametrize("n", [1, 999, 40000, 1_000_003])
def test_bytes_equal_the_plan(ncomm, alg, n):
    """Every rank's intra- and inter-node bytes equal what the algorithm sends by its
    description (4 MB: the sharded variant's pipelined pieces), and mpitp.plan's exact
    prediction equals that too."""
    ncomm.traffic.reset()
    ncomm.allreduce(np.ones(n, np.float32), algorithm=alg)
    sizes = [len(r) for r in ncomm.topology.nodes]
    if alg == "ring":  # the flat ring: each rank's link to its right neighbour is intra or inter
        node_of = {r: m for m, ranks in enumerate(ncomm.topology.nodes) for r in ranks}
        sends = [ring_sends(n, N, r, "ar") for r in range(N)]
        want = [(e, 0) if node_of[(r + 1) % N] == node_of[r] else (0, e) for r, e in enumerate(sends)]
    else:
        want = two_level_sends(alg, sizes, n, 4)
    intra, inter = want[ncomm.rank]
    t = ncomm.traffic.by_peer
    agree(
        (t.get("intra", 0), t.get("inter", 0)) == (intra * 4, inter * 4),
        f"{alg} n={n} nodes={sizes}: sent {dict(t)}, the algorithm sends intra {intra * 4} inter {inter * 4}",
    )
    agree(per_rank_elements(alg, sizes, n, 4) == want, f"{alg} n={n} nodes={sizes}: mpitp.plan differs")


@pytest.mark.parametrize("alg", ALGS)
def test_node_rings_over_shared_memory_match_mpi_transport(ncomm, alg):
    """The node's rings run over its shared-memory channel (the ranks of a simulated node
    share memory too); the results equal the MPI transport's bit for bit."""
    plain = mpitp.Communicator(ranks_per_node=len(ncomm.topology.nodes[0]))
    plain.shm, plain.cma, ncomm.shm = False, False, True
    try:
        x = rank_inputs((70001,), "float32", "sum", N, 9)[ncomm.rank]
        b = plain.allreduce(x, algorithm=alg)
        cases = [("intra", 1 << 30)] + ([("intra/cma", 0)] if cma_permitted() else [])
        for key, limit in cases:  # all by shared memory / all by CMA
            ncomm.shm_max_bytes = limit
            a = ncomm.allreduce(x, algorithm=alg)
            agree(np.array_equal(a, b), f"{alg} over {key}: transports differ")
            if ncomm.topology.num_nodes > 1:
                local = len(ncomm.topology.nodes[ncomm.topology.node])
                opened = ncomm._links.opened().get(key, False)
                agree(opened == (local > 1), f"{alg}: node of {local} ranks, {key} channel opened: {opened}")
    finally:
        ncomm.shm_max_bytes = shm.max_bytes()
        plain.free()


@pytest.mark.mpi(min_size=8)
def test_seed_example_two_nodes_of_four():
    """Seed 000: 2 nodes x 4 ranks, 8 MiB per rank. Inter-node bytes per node: flat ring
    (node-ordered ranks) 2(N-1)/N * B = 14 MiB, sent by the one rank at the node boundary;
    both two-level variants 2(M-1)/M * B = 8 MiB = B (naive would be 4 x 8 = 32 MiB)."""
    if N != 8:
        pytest.skip("the seed's example has exactly 8 ranks")
    c = mpitp.Communicator(ranks_per_node=4)
    try:
        x = np.ones(2 * 1024 * 1024, np.float32)  # 8 MiB
        per_node = {}
        for alg in ["ring"] + ALGS:
            c.traffic.reset()
            y = c.allreduce(x, algorithm=alg)
            agree(np.all(y == 8), f"{alg} values")
            inter = c.mpi.allgather(c.traffic.by_peer.get("inter", 0))
            per_node[alg] = [sum(inter[:4]), sum(inter[4:])]
        MiB = 1 << 20
        agree(
            per_node
            == {
                "ring": [14 * MiB, 14 * MiB],
                "hierarchical": [8 * MiB, 8 * MiB],
                "hierarchical_leader": [8 * MiB, 8 * MiB],
            },
            f"inter bytes per node {per_node}",
        )
    finally:
        c.free()


def test_auto_picks_two_level_across_nodes(ncomm):
    from mpitp.comm.algorithms import select

    alg = select.choose("allreduce", "auto", 64 << 20, N, mpitp.ReduceOp.SUM, ncomm.topology, {})
    want = "mpi" if N == 1 else ("hierarchical" if ncomm.topology.num_nodes > 1 else "ring")
    agree(alg == want, f"auto chose {alg}, expected {want}")
