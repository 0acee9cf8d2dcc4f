"""All-reduce plans: bytes per link class and predicted time, per algorithm.

Bytes are exact for the algorithms mpitp runs (the same chunk rounding as
:mod:`mpitp.comm.algorithms.ring`), so a run's traffic counters must equal them to the byte.
``naive`` and ``hierarchical_sharp`` are models only (the baseline of seed 000, the
study note in the README's "The seeds' numbers", and the in-network reduction mpitp
cannot run on a CPU cluster). Times use the alpha-beta model ``T_link(X) = alpha + X/beta``
with seed 000's formulas for the two model-only rows:

    naive:               T_slow(B*L)                       (every rank's B crosses the NIC)
    hierarchical_sharp:  T_fast(B*L) + T_slow(B)           (node sends B up, gets B down)
    ring (flat):         2(N-1) * T_slow(B/N)              (one link per node boundary)
    hierarchical:        2(L-1) * T_fast(B/L) + 2(M-1) * T_slow(B/M)   (L rings share a NIC)
    hierarchical_leader: 2(L-1) * T_fast(B/L) + 2 * T_fast(B(L-1)/L) + 2(M-1) * T_slow(B/M)

with B bytes per rank, L ranks per node, M nodes, N = L*M.
"""

from __future__ import annotations

from typing import Any

from ..comm.algorithms.hierarchical import pieces
from ..split import chunk_counts
from .profiles import Profile

ALGORITHMS = ("naive", "ring", "hierarchical", "hierarchical_leader", "hierarchical_sharp")
RUNNABLE = ("ring", "hierarchical", "hierarchical_leader")


def _ring_elems(n: int, parts: int, idx: int, *, sent_by: str) -> int:
    """Elements one ring member sends: reduce-scatter skips its own chunk, all-gather the
    right neighbour's."""
    if parts == 1:
        return 0
    c = chunk_counts(n, parts)
    if sent_by == "rs":
        return n - c[idx]
    if sent_by == "ag":
        return n - c[(idx + 1) % parts]
    return 2 * n - c[idx] - c[(idx + 1) % parts]  # all-reduce


def per_rank_elements(algorithm: str, node_sizes: list[int], n: int, itemsize: int = 1) -> list[tuple[int, int]]:
    """(intra, inter) elements sent by every rank, ranks numbered node by node, for ``n``
    elements of ``itemsize`` bytes (the sharded two-level variant cuts large buffers into
    pipelined pieces by bytes: :func:`mpitp.comm.algorithms.hierarchical.pieces`)."""
    N, M = sum(node_sizes), len(node_sizes)
    node_of = [m for m, L in enumerate(node_sizes) for _ in range(L)]
    local = [lr for L in node_sizes for lr in range(L)]
    out = []
    if algorithm == "ring":
        for r in range(N):
            e = _ring_elems(n, N, r, sent_by="ar")
            out.append((e, 0) if node_of[(r + 1) % N] == node_of[r] else (0, e))
        return out
    if algorithm == "hierarchical" and len(set(node_sizes)) > 1:
        algorithm = "hierarchical_leader"  # what the runtime falls back to
    for r in range(N):
        m, lr, L = node_of[r], local[r], node_sizes[node_of[r]]
        c = chunk_counts(n, L)
        if algorithm == "hierarchical":  # every piece: reduce-scatter, shard across, all-gather
            intra = inter = 0
            for size in pieces(n, itemsize):
                intra += _ring_elems(size, L, lr, sent_by="rs") + _ring_elems(size, L, lr, sent_by="ag")
                inter += _ring_elems(chunk_counts(size, L)[lr], M, m, sent_by="ar")
            out.append((intra, inter))
            continue
        intra = _ring_elems(n, L, lr, sent_by="rs") + _ring_elems(n, L, lr, sent_by="ag")
        if algorithm == "hierarchical_leader":
            if lr == 0:
                intra += n - c[0]  # shards back to the local ranks
                inter = _ring_elems(n, M, m, sent_by="ar")
            else:
                intra += c[lr]  # shard to the leader
                inter = 0
        else:
            raise ValueError(f"no exact byte count for {algorithm!r}")
        out.append((intra, inter))
    return out


def per_node_bytes(algorithm: str, node_sizes: list[int], nbytes: int, itemsize: int = 1) -> list[tuple[int, int]]:
    """(intra, inter) bytes sent by each node's ranks together."""
    n = nbytes // itemsize
    if algorithm == "naive":
        return [(0, L * nbytes) for L in node_sizes]
    if algorithm == "hierarchical_sharp":
        return [(L * nbytes, nbytes) for L in node_sizes]  # seed: B*L inside, B up
    ranks = per_rank_elements(algorithm, node_sizes, n, itemsize)
    out, r = [], 0
    for L in node_sizes:
        mine = ranks[r : r + L]
        out.append((sum(a for a, _ in mine) * itemsize, sum(b for _, b in mine) * itemsize))
        r += L
    return out


def predict_time(algorithm: str, nodes: int, per_node: int, nbytes: float, prof: Profile) -> tuple[float, str]:
    B, L, M = float(nbytes), per_node, nodes
    N = L * M
    fast, slow = prof.intra, prof.inter
    if algorithm == "naive":
        return slow.time(B * L), "T_slow(B*L)"
    if algorithm == "hierarchical_sharp":
        return fast.time(B * L) + slow.time(B), "T_fast(B*L) + T_slow(B)"
    if algorithm == "ring":
        link = slow if M > 1 else fast
        return 2 * (N - 1) * link.time(B / N), "2(N-1) T_slow(B/N)"
    intra = 2 * (L - 1) * fast.time(B / L)
    inter = 2 * (M - 1) * slow.time(B / M)
    if algorithm == "hierarchical":
        return intra + inter, "2(L-1) T_fast(B/L) + 2(M-1) T_slow(B/M)"
    if algorithm == "hierarchical_leader":
        funnel = 2 * fast.time(B * (L - 1) / L) if L > 1 else 0.0
        return intra + funnel + inter, "2(L-1) T_fast(B/L) + 2 T_fast(B(L-1)/L) + 2(M-1) T_slow(B/M)"
    raise ValueError(f"unknown algorithm {algorithm!r}")


def plan(nodes: int, per_node: int, nbytes: int, prof: Profile, itemsize: int = 1) -> dict:
    """Every algorithm for one all-reduce of ``nbytes`` per rank on ``nodes`` x ``per_node`` ranks."""
    sizes = [per_node] * nodes
    rows: list[dict[str, Any]] = []
    for alg in ALGORITHMS:
        by_node = per_node_bytes(alg, sizes, nbytes, itemsize)
        t, formula = predict_time(alg, nodes, per_node, nbytes, prof)
        rows.append(
            {
                "algorithm": alg,
                "runnable": alg in RUNNABLE,
                "intra_bytes_per_node": max(a for a, _ in by_node),
                "inter_bytes_per_node": max(b for _, b in by_node),
                "time_s": t,
                "formula": formula,
            }
        )
    naive = rows[0]["inter_bytes_per_node"]
    for row in rows:
        row["inter_reduction_vs_naive"] = naive / row["inter_bytes_per_node"] if row["inter_bytes_per_node"] else None
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "bytes_per_rank": nbytes,
        "profile": prof.to_dict(),
        "algorithms": rows,
    }
