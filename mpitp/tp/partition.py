"""How a model is cut over any number of ranks p: uneven, GQA-aware partitions.

Attention is cut by whole KV-head groups, so every rank's query heads use only its own
KV heads (g = query heads per KV head)::

    9 heads / 3 KV, p = 2:   rank 0: KV 0-1, q 0-5      rank 1: KV 2, q 6-8
    32 / 8, p = 3:           KV 3 + 3 + 2 -> q 12 + 12 + 8
    9 / 3, p = 4 (p > KV):   each rank one KV head; KV 0 on ranks 0-1 (q 0-1 | 2),
                             KV 1 on rank 2 (q 3-5), KV 2 on rank 3 (q 6-8)

The MLP's intermediate columns are cut evenly (in whole blocks of block weights), whatever
attention's cut: each all-reduce waits for the slowest rank of its own segment
(qkv · attention · o, then gate_up · down), so a rank with fewer heads would gain nothing
by taking more MLP columns; it would only become the MLP's slowest rank. (Balancing each
rank's bytes over the whole layer, as mpitp did first, made the default model decode 10%
slower at TP=2: 672 + 864 columns against 768 + 768, docs/measurements.md.) The vocabulary
is cut in blocks of ``PAD`` rows, as evenly as blocks allow. Every split is a list of
(start, size) per rank, computed the same way on every rank, so nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MpitpError
from ..split import even, offsets

PAD = 64  # vocabulary rows per block


class ShardingError(MpitpError, ValueError):
    """A layer cannot be cut over this many ranks, or a tensor has the wrong shape."""


starts = offsets  # where each rank's part begins (mpitp.split)


@dataclass(frozen=True)
class AttentionSplit:
    q: list[int]  # query heads per rank
    q_start: list[int]
    kv: list[int]  # KV heads each rank holds (1 when replicated)
    kv_start: list[int]

    def rank(self, r: int) -> tuple[int, int, int, int]:
        return self.q[r], self.q_start[r], self.kv[r], self.kv_start[r]


def attention(heads: int, kv_heads: int, p: int) -> AttentionSplit:
    if heads % kv_heads:
        raise ShardingError(f"number of attention heads = {heads} is not a multiple of the KV heads = {kv_heads}")
    if p > heads:
        raise ShardingError(
            f"tensor-parallel size {p} exceeds the number of attention heads = {heads}: some rank would hold no head"
        )
    g = heads // kv_heads
    if p <= kv_heads:
        kv = even(kv_heads, p)
        return AttentionSplit([k * g for k in kv], [s * g for s in starts(kv)], kv, starts(kv))
    q, q_start, kv_start = [], [], []
    for head, ranks in enumerate(even(p, kv_heads)):  # ranks sharing each KV head
        for size, off in zip(even(g, ranks), starts(even(g, ranks))):
            q.append(size)
            q_start.append(head * g + off)
            kv_start.append(head)
    return AttentionSplit(q, q_start, [1] * p, kv_start)


def vocab(vocab_size: int, p: int) -> tuple[int, list[int]]:
    """(padded vocabulary, rows per rank): padded to whole blocks of PAD, at least one per rank."""
    blocks = max(-(-vocab_size // PAD), p)
    return blocks * PAD, even(blocks * PAD, p, PAD)


def mlp(intermediate: int, p: int, block: int = 1) -> list[int]:
    """Intermediate columns per rank: as even as whole ``block``s allow (32 for block
    weights, so that down_proj's input columns split on whole blocks); single columns
    where ``intermediate`` is no multiple of ``block`` or has fewer blocks than ranks."""
    if p > intermediate:
        raise ShardingError(f"tensor-parallel size {p} exceeds intermediate_size = {intermediate}")
    if intermediate % block or intermediate // block < p:
        block = 1
    return [s * block for s in even(intermediate // block, p)]


def experts(num_experts: int, p: int) -> list[int]:
    """Whole experts per rank for expert parallelism, as even as counts allow (128 over 3:
    43, 43, 42); refused where a rank would hold none."""
    if p > num_experts:
        raise ShardingError(
            f"--moe ep: {p} ranks but {num_experts} experts; every rank must hold at least one "
            f"(run at most {num_experts} ranks, or --moe tp)"
        )
    return even(num_experts, p)
