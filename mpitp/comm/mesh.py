"""A device mesh: the ranks of a communicator as an N-dimensional grid, one
sub-communicator per dimension (torchtitan's ``init_device_mesh``, Megatron's TP x DP
groups). The last dimension is the innermost: its ranks are consecutive in node order,
so a tensor-parallel group stays inside a node when the node has room for it::

    comm.mesh((2, 2), ("dp", "tp")) on 2 nodes x 2 ranks

                 tp 0      tp 1
        dp 0   rank 0    rank 1      node 0      mesh["tp"]: {0, 1} and {2, 3}  (inside nodes)
        dp 1   rank 2    rank 3      node 1      mesh["dp"]: {0, 2} and {1, 3}  (across nodes)

Ranks are placed in (node, local rank) order, from the real topology or
``MPITP_RANKS_PER_NODE``; each sub-communicator keeps the parent's node map, so its
traffic counters still split bytes into intra- and inter-node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MpitpError


class MeshError(MpitpError, ValueError):
    """A mesh shape that does not fit the communicator."""


@dataclass
class Mesh:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    coords: tuple[int, ...]  # this rank's place in the grid
    comms: dict  # name -> Communicator over the ranks that differ only in that coordinate
    order: tuple[int, ...]  # grid position (row-major) -> rank of the parent communicator

    def __getitem__(self, name: str):
        if name not in self.comms:
            raise KeyError(f"mesh has no dimension {name!r}; it has {', '.join(self.names)}")
        return self.comms[name]

    def coord(self, name: str) -> int:
        return self.coords[self.names.index(name)]

    def rank_at(self, coords: tuple[int, ...]) -> int:
        """The parent communicator's rank at grid position ``coords``."""
        flat = 0
        for c, n in zip(coords, self.shape):
            flat = flat * n + c
        return self.order[flat]

    def free(self) -> None:
        for c in self.comms.values():
            c.free()


def build(comm, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """Collective over ``comm`` (see :meth:`mpitp.Communicator.mesh`)."""
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(shape) != len(names) or len(set(names)) != len(names) or not shape:
        raise MeshError(f"mesh shape {shape} and names {names}: one distinct name per dimension")
    if any(s < 1 for s in shape) or math.prod(shape) != comm.size:
        raise MeshError(f"mesh shape {shape} holds {math.prod(shape)} ranks; the communicator has {comm.size}")
    topo = comm.topology
    order = tuple(sorted(range(comm.size), key=lambda r: (topo.node_of[r], r)))
    flat = order.index(comm.rank)
    coords: list[int] = []
    rest = flat
    for n in reversed(shape):
        coords.append(rest % n)
        rest //= n
    coords.reverse()
    comms = {}
    for d, name in enumerate(names):
        color = 0  # the position in the other dimensions: equal for the members of this group
        for i, c in enumerate(coords):
            if i != d:
                color = color * shape[i] + c
        comms[name] = comm.split(color, key=coords[d])
    inner = shape[-1]
    fits = all(len(ranks) % inner == 0 for ranks in topo.nodes) or topo.num_nodes == 1
    if not fits and comm.rank == 0:
        from ..log import get_logger

        get_logger("mesh").warning(
            f"the innermost mesh dimension {names[-1]}={inner} does not divide every node "
            f"({[len(r) for r in topo.nodes]} ranks): some {names[-1]} groups span nodes"
        )
    return Mesh(shape, names, tuple(coords), comms, order)
