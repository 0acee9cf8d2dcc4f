"""Byte counters: exact figures for the hand-written ring, per peer class and phase."""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

import mpitp

N = MPI.COMM_WORLD.size


def split_sizes(n):
    return [len(c) for c in np.array_split(np.arange(n), N)]


@pytest.mark.parametrize("n", [0, 1, max(N - 1, 1), 1000, 1001, 65537])
@pytest.mark.parametrize("dtype", ["float32", "int8", "float64"])
def test_ring_allreduce_bytes(fresh_comm, n, dtype):
    c, r = fresh_comm.traffic, fresh_comm.rank
    x = np.ones(n, dtype)
    fresh_comm.allreduce(x, algorithm="ring")
    sizes = split_sizes(n)
    # reduce-scatter sends every chunk but its own, all-gather every chunk but the right neighbour's
    want = 0 if N == 1 else (2 * n - sizes[r] - sizes[(r + 1) % N]) * np.dtype(dtype).itemsize
    agree(c.total == want and c.by_collective["allreduce"] == want, f"sent {c.total}, expected {want}")
    right = "intra" if fresh_comm.topology.peer_class((r + 1) % N) == "intra" else "inter"  # the ring sends right
    other = "inter" if right == "intra" else "intra"
    agree(c.by_peer.get(right, 0) == want and c.by_peer.get(other, 0) == 0, f"by_peer {dict(c.by_peer)}")
    agree(c.calls["allreduce"] == 1, "call count")


def test_ring_reduce_scatter_and_allgather_bytes(fresh_comm):
    r, n = fresh_comm.rank, 4 * N + 3
    sizes = split_sizes(n)
    fresh_comm.reduce_scatter(np.ones(n, np.float32), algorithm="ring")
    want_rs = 0 if N == 1 else (n - sizes[r]) * 4
    agree(fresh_comm.traffic.by_collective["reduce_scatter"] == want_rs, "reduce_scatter bytes")
    fresh_comm.allgather(np.ones(sizes[r], np.float32), algorithm="ring")
    want_ag = 0 if N == 1 else (n - sizes[(r + 1) % N]) * 4
    agree(fresh_comm.traffic.by_collective["allgather"] == want_ag, "allgather bytes")


def test_phases_and_mpi_payload(fresh_comm):
    x = np.ones(1000, np.float64)
    with fresh_comm.phase("forward"):
        fresh_comm.allreduce(x, algorithm="ring")
        with fresh_comm.phase("backward"):
            fresh_comm.allreduce(x, algorithm="mpi")
    fresh_comm.allreduce(x, algorithm="mpi")
    t = fresh_comm.traffic
    ring_bytes = (
        0 if N == 1 else (2000 - sum(split_sizes(1000)[i % N] for i in (fresh_comm.rank, fresh_comm.rank + 1))) * 8
    )
    mpi_bytes = 0 if N == 1 else 8000
    agree(t.by_phase["forward"] == ring_bytes, f"forward {t.by_phase}")
    agree(t.by_phase["backward"] == mpi_bytes and t.by_phase[None] == mpi_bytes, f"phases {t.by_phase}")
    agree(t.by_peer.get("mpi", 0) == 2 * mpi_bytes, "MPI's own calls are counted as payload under 'mpi'")
    agree(t.calls["allreduce"] == 3, "calls")
    snap = t.snapshot()
    t.reset()
    agree(snap["total"] == ring_bytes + 2 * mpi_bytes and t.total == 0, "snapshot/reset")


@pytest.mark.mpi(min_size=2)
def test_simulated_nodes_classify_peers():
    c = mpitp.Communicator(ranks_per_node=2)
    try:
        r = c.rank
        c.allreduce(np.ones(12 * N, np.float32), algorithm="ring")
        right = (r + 1) % N
        cls = "intra" if right // 2 == r // 2 else "inter"
        agree(
            c.traffic.by_peer[cls] == c.traffic.total > 0,
            f"rank {r}->{right} should be {cls}: {dict(c.traffic.by_peer)}",
        )
        agree(c.topology.nodes == tuple(tuple(range(i, min(i + 2, N))) for i in range(0, N, 2)), "node layout")
    finally:
        c.free()


def test_fast_path_counts_like_the_slow_path():
    """Small all-reduces that take the fast path (no watchdog, no validation) are counted
    exactly like the slow path: calls, MPI payload, the current phase, and after reset."""
    hot = mpitp.Communicator(timeout=0, validate=False)
    try:
        x = np.ones(100, np.float32)
        hot.allreduce(x)  # opens the one-shot all-reduce where it runs: each peer reads x
        hot.traffic.reset()
        peers = N - 1 if hot._oneshot and not hot._oneshot.oversubscribed else min(N - 1, 1)
        payload = 400 * peers
        for _ in range(3):
            hot.allreduce(x)
        with hot.phase("decode"):
            for _ in range(2):
                hot.allreduce(x)
        hot.allreduce(x)
        t = hot.traffic
        agree(t.calls["allreduce"] == 6, f"calls {dict(t.calls)}")
        agree(t.by_phase[None] == 4 * payload and t.by_phase.get("decode", 0) == 2 * payload, f"phases {t.by_phase}")
        agree(t.messages == 6 * peers, f"messages {t.messages}")
        t.reset()
        hot.allreduce(x)
        agree(t.calls["allreduce"] == 1 and t.total == payload, "counts after reset")
        # persistent buffers (out= and in place), across phases and a reset
        out = np.empty_like(x)
        t.reset()
        for _ in range(3):
            hot.allreduce(x, out=out)
        agree(t.calls["allreduce"] == 3 and t.total == 3 * payload, f"persistent out=: {t.snapshot()}")
        with hot.phase("decode"):
            for _ in range(2):
                hot.allreduce(out, out=out)
        hot.allreduce(x, out=out)
        agree(
            t.calls["allreduce"] == 6
            and t.by_phase.get("decode", 0) == 2 * payload
            and t.by_phase[None] == 4 * payload,
            f"persistent, phases: {t.snapshot()}",
        )
        agree(t.messages == 6 * peers, f"messages {t.messages}")
        hot.allreduce(x, out=out)
        t.reset()
        hot.allreduce(x, out=out)
        agree(t.calls["allreduce"] == 1 and t.total == payload, f"persistent after reset: {t.snapshot()}")
    finally:
        hot.free()
