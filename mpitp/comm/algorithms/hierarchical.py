"""Two-level all-reduce: inside each node first, across nodes second, back inside last.

The picture of seed 000 (the study note in the README's "The seeds' numbers"), 2 nodes
x 4 ranks, B bytes per rank::

    sharded ("hierarchical", NCCL/Horovod style)     leader ("hierarchical_leader")
    1. intra reduce-scatter: local rank l owns        1. intra reduce-scatter, then every
       shard l of the node's sum (B/4)                   shard to local rank 0 (the leader)
    2. local rank l ring-all-reduces shard l with     2. leaders ring-all-reduce all B
       local rank l of every other node               3. leader scatters shards back,
    3. intra all-gather of the shards                    intra all-gather

Both cross the network with 2(M-1)/M * B bytes per node (M nodes) instead of the flat
ring's share of every rank's buffer; the sharded variant spreads them over all local
ranks (every NIC works), the leader variant funnels them through one rank per node.
Nodes with unequal rank counts have no common shard layout, so the sharded variant
falls back to the leader variant there.
"""

from __future__ import annotations

from mpi4py import MPI

from ... import split
from ..handle import Handle, Steps
from . import ring


class NodeComms:
    """Sub-communicators of one topology: intra-node, same-local-rank across nodes, leaders."""

    def __init__(self, comm: MPI.Comm, topology):
        t = topology
        self.intra = comm.Split(t.node, t.local_rank)
        self.inter = comm.Split(t.local_rank, t.node)  # peers: same local rank, other nodes
        self.leaders = comm.Split(0 if t.local_rank == 0 else MPI.UNDEFINED, t.node)
        group = comm.Get_group()
        self.intra_ranks = _translate(self.intra, group)  # sub-rank -> rank in ``comm``
        self.inter_ranks = _translate(self.inter, group)
        self.leader_ranks = _translate(self.leaders, group) if self.leaders != MPI.COMM_NULL else []
        group.Free()

    def free(self) -> None:
        for c in (self.intra, self.inter, self.leaders):
            if c != MPI.COMM_NULL:
                c.Free()


def _translate(sub: MPI.Comm, parent_group: MPI.Group) -> list[int]:
    g = sub.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(g, list(range(sub.size)), parent_group))
    finally:
        g.Free()


def _mapped(on_send, ranks: list[int]):
    """Report sub-communicator peers as ranks of the parent communicator."""
    return lambda nbytes, peer: on_send(nbytes, ranks[peer])


PIECE_BYTES = 1 << 20  # the sharded variant pipelines pieces of at least this size ...
MAX_PIECES = 16  # ... and at most this many (piece p's inter-node messages carry tag bits p)
IN_FLIGHT = 2  # pieces crossing the network while the next one is reduced inside the node


def pieces(n: int, itemsize: int) -> list[int]:
    """Element counts of the pieces a sharded two-level all-reduce of ``n`` elements runs
    as a pipeline (one piece below ``2 * PIECE_BYTES``). :mod:`mpitp.plan.allreduce`
    counts bytes with the same cut."""
    return split.chunk_counts(n, max(1, min(MAX_PIECES, n * itemsize // PIECE_BYTES)))


def scratch_slots(slots: int) -> int:
    """Elements of receive scratch a two-level all-reduce needs, given the flat ring's
    ``slots``: one set inside the node, one per piece crossing the network."""
    return slots * (IN_FLIGHT + 2)


def all_reduce(
    nc: NodeComms, src, dst, reduce, tmp, wire: ring.Wire, *, sharded: bool, intra=None, trace=None
) -> Steps:
    """Two-level all-reduce of flat ``src`` into flat ``dst`` (may be the same buffer).
    ``intra``: what the node's rings run over (its shared-memory channel), default
    ``nc.intra``; the leader variant's shard moves stay on ``nc.intra``. ``tmp`` holds
    :func:`scratch_slots` elements; ``trace`` (a :class:`~mpitp.comm.timeline.Timeline`)
    records the sharded variant's pieces. ``wire.on_send`` sees ranks of the whole
    communicator: each level's wire maps its own peers back to them."""
    link = nc.intra if intra is None else intra
    if sharded:
        return (yield from _sharded(nc, link, src, dst, reduce, tmp, wire, trace=trace))
    slots = tmp.size // (IN_FLIGHT + 2)
    tmp = tmp[:slots]
    L, lr = nc.intra.size, nc.intra.rank  # ranks on this node, local rank
    counts = split.chunk_counts(dst.size, L)
    offs = split.offsets(counts)
    node = wire.but(on_send=_mapped(wire.on_send, nc.intra_ranks))
    # 1. reduce-scatter inside the node: local rank lr owns shard lr of the node's sum
    yield from ring.reduce_scatter(link, src, dst, counts, reduce, tmp, node)
    # 2a. shards to the leader; 2b. leaders all-reduce everything; 2c. shards back
    yield from _to_leader(nc.intra, dst, counts, offs, node)
    if lr == 0:
        leaders = wire.but(on_send=_mapped(wire.on_send, nc.leader_ranks))
        yield from ring.all_reduce(nc.leaders, dst, dst, reduce, tmp, leaders)
    yield from _from_leader(nc.intra, dst, counts, offs, node)
    # 3. all-gather inside the node
    yield from ring.all_gather(link, dst, counts, node)
    return dst


def _sharded(nc: NodeComms, link, src, dst, reduce, tmp, wire: ring.Wire, trace=None) -> Steps:
    """The sharded variant as a pipeline over pieces of the buffer::

        step k:  intra reduce-scatter of piece k   (inside the node, while ...)
                 start piece k's shard across nodes (... pieces k-1, k-2 are on the wire)
                 finish piece k-IN_FLIGHT across nodes, intra all-gather of it

    Intra-node work on one piece overlaps the network transfer of the pieces before it,
    so the inter-node link stays busy. Intra operations run in the same order on every
    rank of a node (a channel is one stream); inter-node rings of different pieces run
    at once, each with its own tag and scratch. While a rank waits inside the node, its
    shared-memory channel polls the pieces in flight, so they keep moving."""
    L, lr = nc.intra.size, nc.intra.rank
    node = wire.but(on_send=_mapped(wire.on_send, nc.intra_ranks))
    across = wire.but(on_send=_mapped(wire.on_send, nc.inter_ranks))
    slots = tmp.size // (IN_FLIGHT + 2)
    cut = pieces(dst.size, wire.itemsize)
    starts = split.offsets(cut)
    inflight: dict[int, Handle] = {}
    started: dict[int, float] = {}

    def mark(name: str, start: float, tid: int = 2) -> None:  # timeline rows 2 (node) and 3 (network)
        if trace is not None:
            trace.span(name, "two-level", start, trace.now(), tid=tid)

    def poll() -> None:
        for h in inflight.values():
            h.test()

    def piece(p: int):
        lo = starts[p]
        return src[lo : lo + cut[p]], dst[lo : lo + cut[p]], split.chunk_counts(cut[p], L)

    if not isinstance(link, MPI.Comm):
        link.progress = poll  # the channel calls it while it waits
    try:
        for k in range(len(cut) + IN_FLIGHT):
            if k < len(cut):
                s, d, counts = piece(k)
                t = trace.now() if trace is not None else 0.0
                yield from ring.reduce_scatter(link, s, d, counts, reduce, tmp[:slots], node)
                mark(f"piece {k} reduce-scatter in node", t)
                started[k] = trace.now() if trace is not None else 0.0
                lo = split.offsets(counts)[lr]
                shard = d[lo : lo + counts[lr]]
                scratch = tmp[slots * (1 + k % (IN_FLIGHT + 1)) :][:slots]
                tagged = across.but(tag=(wire.tag << 4 | k) & 0x7FFF)
                steps = ring.all_reduce(nc.inter, shard, shard, reduce, scratch, tagged)
                inflight[k] = Handle(steps, None, f"piece {k} across nodes")  # type: ignore[arg-type]
            poll()
            j = k - IN_FLIGHT
            if j >= 0:
                h = inflight.pop(j)
                while not h.test():
                    yield h.pending
                mark(f"piece {j} across nodes", started.pop(j), tid=3)
                _, d, counts = piece(j)
                t = trace.now() if trace is not None else 0.0
                yield from ring.all_gather(link, d, counts, node)
                mark(f"piece {j} all-gather in node", t)
    finally:
        if not isinstance(link, MPI.Comm):
            link.progress = None
    return dst


def _to_leader(comm, buf, counts, offs, wire: ring.Wire) -> Steps:
    lr, dtype, tag = comm.rank, wire.dtype, wire.tag
    if lr == 0:
        yield [
            comm.Irecv([buf[offs[k] : offs[k] + counts[k]], dtype], source=k, tag=tag)
            for k in range(1, comm.size)
            if counts[k]
        ]
    elif counts[lr]:
        wire.on_send(counts[lr] * wire.itemsize, 0)
        yield comm.Isend([buf[offs[lr] : offs[lr] + counts[lr]], dtype], dest=0, tag=tag)


def _from_leader(comm, buf, counts, offs, wire: ring.Wire) -> Steps:
    lr, dtype, tag = comm.rank, wire.dtype, wire.tag
    if lr == 0:
        reqs = []
        for k in range(1, comm.size):
            if counts[k]:
                wire.on_send(counts[k] * wire.itemsize, k)
                reqs.append(comm.Isend([buf[offs[k] : offs[k] + counts[k]], dtype], dest=k, tag=tag))
        yield reqs
    elif counts[lr]:
        yield comm.Irecv([buf[offs[lr] : offs[lr] + counts[lr]], dtype], source=0, tag=tag)
