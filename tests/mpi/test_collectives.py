"""Gather, reduce, broadcast, scatter, allgather, reduce_scatter, alltoall: against
NumPy (every rank computes the reference from every rank's inputs) and MPI's own call."""

import numpy as np
import pytest
from helpers import agree, rank_inputs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import mpitp

N = MPI.COMM_WORLD.size
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
DTYPES = st.sampled_from(["float16", "float32", "float64", "int8", "int32", "int64", "uint16", "uint64", "bool"])


def rows_of(r, seed):
    """Per-rank first dimension (some ranks contribute nothing)."""
    return (r * 7 + seed) % 4


@SETTINGS
@given(dtype=DTYPES, trailing=st.sampled_from([(), (3,), (2, 2)]), seed=st.integers(0, 1000), root=st.integers(0, 7))
def test_gather_allgather(comm, dtype, trailing, seed, root):
    root %= N
    pieces = [rank_inputs((rows_of(r, seed),) + trailing, dtype, "sum", 1, seed + r)[0] for r in range(N)]
    ref = np.concatenate(pieces)
    g = comm.gather(pieces[comm.rank], root=root)
    agree((g is None) if comm.rank != root else (g.shape == ref.shape and np.array_equal(g, ref)), "gather")
    for alg in ("mpi", "ring", "auto"):
        a = comm.allgather(pieces[comm.rank], algorithm=alg)
        agree(a.shape == ref.shape and a.dtype == ref.dtype and np.array_equal(a, ref), f"allgather {alg}")


@pytest.mark.parametrize("rows, uneven", [(1, False), (8, True), (3, False)])
def test_allgather_columns(comm, rows, uneven):
    """allgather_columns (a model's logits, cut by the vocabulary): every rank's [..., n_r]
    side by side along the last axis, ranks in order, against NumPy's concatenation bit for
    bit: through the one-shot window on one node (its slots straight into their columns),
    MPI's all-gather where the shared memory is off or the parts exceed the window."""
    from mpitp.comm import gathers

    sizes = [5 + 3 * r if uneven else 7 for r in range(N)]
    pieces = [np.random.default_rng(r).standard_normal((rows, 1, sizes[r])).astype(np.float32) for r in range(N)]
    ref = np.concatenate(pieces, axis=-1)
    for _ in range(3):  # the window's slots alternate by call
        got = comm.allgather_columns(pieces[comm.rank], None if not uneven else sizes)
        agree(got.shape == ref.shape and got.dtype == ref.dtype and np.array_equal(got, ref), "allgather_columns")
    shm = N > 1 and comm.oneshot_max > 0 and comm.topology.num_nodes == 1
    agree((comm._gathershot is not None) == shm, f"the one-shot window opened: {comm._gathershot}")
    wide = gathers.GATHER_MAX // 4 // rows + 1  # past the window: MPI's all-gather
    big = [np.full((rows, wide), r, np.float32) for r in range(N)]
    got = comm.allgather_columns(big[comm.rank], [wide] * N)
    agree(np.array_equal(got, np.concatenate(big, axis=-1)), "allgather_columns past the window")


def test_gather_scalars_and_mpi_reference(comm):
    g = comm.allgather(np.int32(comm.rank))
    agree(g.shape == (N,) and np.array_equal(g, np.arange(N)), "0-d arrays count as one row")
    x = np.arange(5, dtype=np.float64) + comm.rank
    ref = np.empty(5 * N)
    MPI.COMM_WORLD.Allgather(x, ref)
    agree(np.array_equal(comm.allgather(x), ref), "allgather vs MPI's Allgather")


@SETTINGS
@given(
    dtype=DTYPES,
    rows=st.sampled_from([0, 1, N - 1, N, N + 1, 3 * N + 2, 17]),
    seed=st.integers(0, 1000),
    root=st.integers(0, 7),
)
def test_scatter(comm, dtype, rows, seed, root):
    root %= N
    full = rank_inputs((rows, 3), dtype, "sum", 1, seed)[0]
    got = comm.scatter(full if comm.rank == root else None, root=root)
    want = np.array_split(full, N)[comm.rank]
    agree(got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want), "scatter")


@SETTINGS
@given(
    dtype=st.sampled_from(["float32", "float64", "int32", "int64", "uint8"]),
    op=st.sampled_from(["sum", "max", "min"]),
    rows=st.sampled_from([1, N - 1, N, N + 1, 2 * N + 1, 50]),
    seed=st.integers(0, 1000),
)
def test_reduce_scatter(comm, dtype, op, rows, seed):
    inputs = rank_inputs((rows, 2), dtype, op, N, seed)
    fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    total = inputs[0]
    for a in inputs[1:]:
        total = fn(total, a)
    want = np.array_split(total, N)[comm.rank]
    for alg in ("mpi", "ring", "auto"):
        got = comm.reduce_scatter(inputs[comm.rank], op=op, algorithm=alg)
        ok = got.shape == want.shape and (
            np.allclose(got, want, rtol=1e-5, atol=1e-5) if got.dtype.kind == "f" else np.array_equal(got, want)
        )
        agree(ok, f"reduce_scatter {alg} {dtype} {op} rows={rows}")


def test_reduce_scatter_auto_follows_the_crossover():
    """auto sends a reduce-scatter at or above its crossover (here a tuning table's 4 KiB)
    to the ring on every rank, below it to MPI's own call; both give the same result."""
    c = mpitp.Communicator()
    c.tuning = {"reduce_scatter": {"1": 4096}}
    try:
        for n, alg in ((1000, "mpi"), (1024, "ring")):  # float32: 4000 and 4096 bytes
            x = (np.arange(n) % 5 + c.rank).astype(np.float32)
            c.traffic.reset()
            got = c.reduce_scatter(x)
            want = np.array_split(sum((np.arange(n) % 5 + r).astype(np.float32) for r in range(N)), N)[c.rank]
            agree(np.array_equal(got, want), f"n={n}")
            ring_bytes = sum(v for k, v in c.traffic.by_peer.items() if k != "mpi")
            agree(
                (ring_bytes > 0) == (alg == "ring" and N > 1), f"n={n}: expected {alg}, sent {dict(c.traffic.by_peer)}"
            )
    finally:
        c.free()


@pytest.mark.parametrize("root", [0, N - 1])
def test_reduce(comm, root):
    inputs = rank_inputs((4, 3), "int64", "sum", N, 3)
    want = np.sum(inputs, axis=0)
    got = comm.reduce(inputs[comm.rank], root=root)
    agree(got is None if comm.rank != root else np.array_equal(got, want), "reduce")
    # MPI's own, directly
    ref = np.empty_like(want) if comm.rank == root else None
    MPI.COMM_WORLD.Reduce(inputs[comm.rank], ref, op=MPI.SUM, root=root)
    agree(comm.rank != root or np.array_equal(ref, got), "reduce vs MPI's Reduce")
    # in place on root, out= elsewhere ignored
    y = inputs[comm.rank].copy()
    got = comm.reduce(y, op="max", root=root, out=y)
    agree(comm.rank != root or (got is y and np.array_equal(y, np.max(inputs, axis=0))), "in-place reduce")


@pytest.mark.parametrize("root", [0, N - 1])
@pytest.mark.parametrize("dtype", ["float32", "int16", "bool"])
def test_broadcast(comm, root, dtype):
    src = rank_inputs((3, 4), dtype, "sum", 1, 99)[0]
    buf = src.copy() if comm.rank == root else np.zeros_like(src)
    got = comm.broadcast(buf, root=root)
    agree(got is buf and np.array_equal(buf, src), "broadcast fills the buffer in place")
    # non-contiguous receive buffer
    big = np.zeros((3, 8), dtype)
    if comm.rank == root:
        big[:, ::2] = src
    got = comm.broadcast(big[:, ::2], root=root)
    agree(np.array_equal(big[:, ::2], src), "broadcast into a strided view")


@pytest.mark.parametrize("dtype", ["float64", "uint32"])
def test_alltoall(comm, dtype):
    x = (np.arange(2 * N * 3).reshape(2 * N, 3) + 1000 * comm.rank).astype(dtype)
    got = comm.alltoall(x)
    blocks = [
        (np.arange(2 * N * 3).reshape(2 * N, 3) + 1000 * r).astype(dtype)[2 * comm.rank : 2 * comm.rank + 2]
        for r in range(N)
    ]
    agree(np.array_equal(got, np.concatenate(blocks)), "alltoall")
    ref = np.empty_like(x)
    MPI.COMM_WORLD.Alltoall(x, ref)
    agree(np.array_equal(got, ref), "alltoall vs MPI's Alltoall")
    if N > 1:
        with pytest.raises(ValueError, match="divisible"):
            comm.alltoall(np.zeros(N + 1))


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_alltoallv(comm, dtype):
    """Uneven rows to each rank, zero counts included (rank r sends (r + j) % 3 rows to rank
    j, so some pairs send nothing): the rows of every source in rank order, as MPI's own
    Alltoallv gives them and as NumPy assembles them; the counters hold the bytes this
    rank handed MPI for other ranks; bad counts are a ValueError. Again with the counts
    given (``sources``) and nonblocking, as data-parallel attention's combine calls it."""
    r = comm.rank
    counts = [(r + j) % 3 for j in range(N)]
    block = lambda src, dst: np.arange(3 * ((src + dst) % 3)).reshape(-1, 3) + 100 * src + 10 * dst  # noqa: E731
    x = np.concatenate([block(r, j) for j in range(N)]).astype(dtype)
    comm.traffic.reset()
    got, sources = comm.alltoallv(x, counts)
    want = np.concatenate([block(q, r) for q in range(N)]).astype(dtype)
    agree(sources == [(q + r) % 3 for q in range(N)] and np.array_equal(got, want), "alltoallv vs NumPy")
    recv = np.empty_like(want)
    rc = [(q + r) % 3 * 3 for q in range(N)]
    MPI.COMM_WORLD.Alltoallv([x, ([c * 3 for c in counts], None)], [recv, (rc, None)])
    agree(np.array_equal(got, recv), "alltoallv vs MPI's Alltoallv")
    sent = (sum(counts) - counts[r]) * 3 * x.itemsize
    counted = comm.traffic.by_collective.get("alltoallv", 0)
    agree(counted == sent, f"alltoallv counted {counted} bytes, sent {sent}")
    with pytest.raises(ValueError, match="counts"):
        comm.alltoallv(x, counts[:-1] + [counts[-1] + 1])
    # the counts known (sources given, no exchange of them) and in flight: the same rows
    h, known = comm.alltoallv(x, counts, sources=sources, nonblocking=True)
    agree(known == sources and np.array_equal(h.wait(), want), "nonblocking alltoallv with its sources given")
    with pytest.raises(ValueError, match="sources"):
        comm.alltoallv(x, counts, sources=sources[:-1])


def test_zero_size_everywhere(comm):
    e = np.zeros((0, 2), np.float32)
    agree(comm.allgather(e).shape == (0, 2), "allgather of empties")
    agree(comm.reduce_scatter(e).shape == (0, 2), "reduce_scatter of empty")
    agree(comm.alltoall(e).shape == (0, 2), "alltoall of empty")
    agree(comm.broadcast(e).shape == (0, 2), "broadcast of empty")
    g = comm.gather(e)
    agree(comm.rank != 0 or g.shape == (0, 2), "gather of empties")
