"""Pipeline stages across nodes, tensor parallelism inside each (vLLM's multi-node layout:
``--tp`` = ranks per node, ``--pp`` = nodes).

The world is a P × T mesh (:meth:`mpitp.Communicator.mesh`, ``("pp", "tp")``): the T ranks
of a stage are consecutive in node order, so a stage sits inside a node where it fits,
and the stages line up across nodes::

    4 ranks, --pp 2 --tp 2, two nodes of two ranks

                     tp 0     tp 1
      stage 0     rank 0   rank 1      node 0   embedding, layers [0, 8)
      stage 1     rank 2   rank 3      node 1   layers [8, 16), norm, head
                     |        |
                     +-- one hidden state per row per step, stage 0 -> stage 1 --+
                         (each tp rank sends its 1/T of it; the next stage's ranks
                          all-gather it inside their node: Megatron's scatter-gather)
                     <-- the sampled tokens, last stage -> every rank (B int64) --

The decoder layers are cut into P contiguous runs balanced by the bytes each stage holds
(the first also holds the embedding table, the last the final norm and the head; a tied
head holds the table too), any layer count; each stage reads only its own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MpitpError
from .config import LlamaConfig


class PipelineError(MpitpError, ValueError):
    """A pipeline layout that cannot be built."""


def layer_params(c: LlamaConfig, layer: int | None = None) -> int:
    """Weights of decoder layer ``layer`` (None: a sparse one where the model has experts):
    q, k, v, o, its two norms, and the MLP's three, or every expert's three, the router and
    a shared expert with its gate."""
    h, d = c.hidden_size, c.head_dim
    attention = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * h
    if c.num_experts and (layer is None or c.sparse(layer)):
        shared = 3 * h * c.shared_expert_intermediate_size + h if c.shared_expert_intermediate_size else 0
        return attention + c.num_experts * (3 * h * c.moe_intermediate_size + h) + shared
    return attention + 3 * h * c.intermediate_size


def balance(c: LlamaConfig, P: int) -> list[tuple[int, int]]:
    """[l0, l1) of each of P stages: contiguous, at least one layer each, the largest
    stage's parameters (layers + the first's embedding, the last's norm and head) as small
    as a cut can make them; of equal cuts, the earliest."""
    L = c.num_hidden_layers
    if P < 1:
        raise PipelineError(f"--pp must be at least 1, got {P}")
    if P > L:
        raise PipelineError(f"--pp {P}: more pipeline stages than the model's {L} layers")
    table = c.vocab_size * c.hidden_size
    upto = [0]  # parameters of layers [0, l)
    for i in range(L):
        upto.append(upto[-1] + layer_params(c, i))
    extra_first, extra_last = table, table + c.hidden_size  # the head: its own table, or the tied one

    def cost(s: int, l0: int, l1: int) -> int:
        return upto[l1] - upto[l0] + (extra_first if s == 0 else 0) + (extra_last if s == P - 1 else 0)

    # best[s][l]: the least max-cost of stages 0..s covering layers [0, l)
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(P)]
    cut = [[0] * (L + 1) for _ in range(P)]
    for l1 in range(1, L + 1):
        best[0][l1] = cost(0, 0, l1)
    for s in range(1, P):
        for l1 in range(s + 1, L + 1):
            for l0 in range(s, l1):
                v = max(best[s - 1][l0], cost(s, l0, l1))
                if v < best[s][l1]:
                    best[s][l1], cut[s][l1] = v, l0
    bounds, l1 = [], L
    for s in range(P - 1, 0, -1):
        l0 = cut[s][l1]
        bounds.append((l0, l1))
        l1 = l0
    bounds.append((0, l1))
    return bounds[::-1]


@dataclass
class Stage:
    """This rank's pipeline stage: its layers, its index, and the two communicators."""

    index: int
    count: int
    layers: tuple[int, int]
    pp: Any  # Communicator over the ranks of this tp coordinate, one per stage (rank = stage)
    tp: Any  # Communicator over this stage's tensor-parallel ranks

    def _cut(self, n: int) -> tuple[int, int]:
        """(chunk, padded size) of a flat hidden state of ``n`` values over the tp ranks."""
        T = self.tp.size
        per = -(-n // T)
        return per, per * T

    def send(self, h) -> None:
        """The hidden states to the next stage: this tp rank's 1/T of them."""
        flat = np.ascontiguousarray(h, np.float32).reshape(-1)
        per, padded = self._cut(flat.size)
        j = self.tp.rank
        part = flat[j * per : min((j + 1) * per, flat.size)]
        if part.size < per:
            part = np.concatenate([part, np.zeros(per - part.size, np.float32)])
        self.pp.send(part, dest=self.index + 1, tag=7)

    def receive(self, shape: tuple[int, ...]):
        """The previous stage's hidden states [B, T, H]: each tp rank its 1/T, then all-gathered."""
        n = int(np.prod(shape))
        per, padded = self._cut(n)
        part = np.empty(per, np.float32)
        self.pp.recv(source=self.index - 1, out=part, tag=7)
        if self.tp.size == 1:
            return part.reshape(shape)
        full = np.empty(padded, np.float32)
        self.tp.allgather(part, out=full)
        return full[:n].reshape(shape)

    def tokens(self, tok: np.ndarray | None, batch: int) -> np.ndarray:
        """The last stage's sampled tokens, on every rank."""
        buf = np.asarray(tok, np.int64) if tok is not None else np.empty(batch, np.int64)
        return self.pp.broadcast(buf, root=self.count - 1)

    def free(self) -> None:
        for c in (self.pp, self.tp):
            c.free()


def check_layout(world: int, P: int, T: int | None = None) -> None:
    """pp × tp = the world size (``T`` None: whatever divides it), or a clear error."""
    if P < 1 or world % P:
        raise PipelineError(f"--pp {P} does not divide the {world} ranks (pp × tp must equal the world size)")
    if T is not None and T * P != world:
        raise PipelineError(f"--pp {P} × --tp {T} = {P * T}, but the world has {world} ranks")


def describe(world: int, stage: Stage | None) -> str:
    """ "TP=2" or "PP=2 × TP=2", for the [mpitp] line and the logs."""
    return f"TP={world}" if stage is None else f"PP={stage.count} × TP={stage.tp.size}"


def build(comm, P: int, c: LlamaConfig, inside_node: bool = False) -> Stage:
    """Collective over ``comm``: the P × (size / P) mesh and this rank's stage. With
    ``inside_node`` (``--tp`` given), a stage whose ranks the nodes cannot hold together is
    an error on every rank, not a tensor-parallel group across the slow link."""
    check_layout(comm.size, P)
    bounds = balance(c, P)
    T = comm.size // P
    if inside_node:
        counts: dict[int, int] = {}
        for n in comm.topology.node_of:
            counts[n] = counts.get(n, 0) + 1
        if any(k % T for k in counts.values()):
            raise PipelineError(
                f"--tp {T}: a stage's {T} ranks cannot be placed inside one node: the nodes hold "
                f"{', '.join(str(counts[n]) for n in sorted(counts))} rank(s) (give each node a multiple of {T}, "
                "or leave out --tp to allow stages across nodes)"
            )
    mesh = comm.mesh((P, T), ("pp", "tp"))
    s = mesh.coord("pp")
    return Stage(s, P, bounds[s], mesh["pp"], mesh["tp"])
