"""Which node each rank lives on.

Real nodes come from ``Split_type(COMM_TYPE_SHARED)`` (ranks that share memory).
``MPITP_RANKS_PER_NODE=k`` (or ``ranks_per_node=k``) simulates nodes of k consecutive
ranks on one machine, so two-level algorithms and the traffic counters' intra/inter
split can be exercised without a cluster. The last simulated node may be smaller::

    5 ranks, k=3:   node 0 = ranks 0 1 2     node 1 = ranks 3 4
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mpi4py import MPI


@dataclass(frozen=True)
class Topology:
    rank: int
    node_of: tuple[int, ...]  # node index of every rank of the communicator
    simulated: bool = False

    @classmethod
    def detect(cls, comm: MPI.Comm, ranks_per_node: int | None = None) -> Topology:
        if ranks_per_node is None:
            from .. import settings

            ranks_per_node = settings.current().ranks_per_node
        if ranks_per_node is not None:
            if ranks_per_node < 1:
                raise ValueError(f"ranks per node must be >= 1, got {ranks_per_node}")
            return cls(comm.rank, tuple(r // ranks_per_node for r in range(comm.size)), True)
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        try:
            # a node is named by the lowest communicator rank on it
            leader = shared.allreduce(comm.rank, op=MPI.MIN)
        finally:
            shared.Free()
        leaders = comm.allgather(leader)
        index = {l: i for i, l in enumerate(sorted(set(leaders)))}
        return cls(comm.rank, tuple(index[l] for l in leaders), False)

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @cached_property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of each node, in rank order."""
        n = max(self.node_of) + 1 if self.node_of else 0
        return tuple(tuple(r for r, nd in enumerate(self.node_of) if nd == i) for i in range(n))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node])

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.nodes)

    @property
    def uniform(self) -> bool:
        return len({len(r) for r in self.nodes}) <= 1

    def peer_class(self, peer: int) -> str:
        return "intra" if self.node_of[peer] == self.node else "inter"

    def describe(self) -> str:
        kind = "simulated" if self.simulated else "shared-memory"
        lines = [f"{self.num_nodes} node(s) ({kind}), {self.size} rank(s)"]
        for i, ranks in enumerate(self.nodes):
            lines.append(f"  node {i}: ranks {', '.join(map(str, ranks))}  (leader {ranks[0]})")
        return "\n".join(lines)
