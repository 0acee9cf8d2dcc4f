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

from ..handle import Steps
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


def all_reduce(
    nc: NodeComms,
    src,
    dst,
    reduce,
    tmp,
    *,
    sharded: bool,
    dtype,
    itemsize: int,
    seg: int,
    tag: int,
    on_send,
    intra=None,
) -> Steps:
    """Two-level all-reduce of flat ``src`` into flat ``dst`` (may be the same buffer).
    ``intra``: what the node's rings run over (its shared-memory channel), default
    ``nc.intra``; the leader variant's shard moves stay on ``nc.intra``."""
    link = nc.intra if intra is None else intra
    kw = dict(dtype=dtype, itemsize=itemsize, seg=seg, tag=tag)
    L, lr = nc.intra.size, nc.intra.rank  # ranks on this node, local rank
    counts = ring.chunk_counts(dst.size, L)
    offs = ring.offsets(counts)
    intra_send = _mapped(on_send, nc.intra_ranks)
    # 1. reduce-scatter inside the node: local rank lr owns shard lr of the node's sum
    yield from ring.reduce_scatter(link, src, dst, counts, reduce, tmp, on_send=intra_send, **kw)
    if sharded:
        # 2. shard lr across nodes, among the ranks with local rank lr
        shard = dst[offs[lr] : offs[lr] + counts[lr]]
        yield from ring.all_reduce(nc.inter, shard, shard, reduce, tmp, on_send=_mapped(on_send, nc.inter_ranks), **kw)
    else:
        # 2a. shards to the leader; 2b. leaders all-reduce everything; 2c. shards back
        yield from _to_leader(nc.intra, dst, counts, offs, dtype, itemsize, tag, intra_send)
        if lr == 0:
            yield from ring.all_reduce(
                nc.leaders, dst, dst, reduce, tmp, on_send=_mapped(on_send, nc.leader_ranks), **kw
            )
        yield from _from_leader(nc.intra, dst, counts, offs, dtype, itemsize, tag, intra_send)
    # 3. all-gather inside the node
    yield from ring.all_gather(link, dst, counts, on_send=intra_send, **kw)
    return dst


def _to_leader(comm, buf, counts, offs, dtype, itemsize, tag, on_send) -> Steps:
    lr = comm.rank
    if lr == 0:
        yield [
            comm.Irecv([buf[offs[k] : offs[k] + counts[k]], dtype], source=k, tag=tag)
            for k in range(1, comm.size)
            if counts[k]
        ]
    elif counts[lr]:
        on_send(counts[lr] * itemsize, 0)
        yield comm.Isend([buf[offs[lr] : offs[lr] + counts[lr]], dtype], dest=0, tag=tag)


def _from_leader(comm, buf, counts, offs, dtype, itemsize, tag, on_send) -> Steps:
    lr = comm.rank
    if lr == 0:
        reqs = []
        for k in range(1, comm.size):
            if counts[k]:
                on_send(counts[k] * itemsize, k)
                reqs.append(comm.Isend([buf[offs[k] : offs[k] + counts[k]], dtype], dest=k, tag=tag))
        yield reqs
    elif counts[lr]:
        yield comm.Irecv([buf[offs[lr] : offs[lr] + counts[lr]], dtype], source=0, tag=tag)
