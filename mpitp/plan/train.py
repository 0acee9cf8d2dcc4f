"""Training on a (dp, tp) mesh: memory per rank and bytes per step on each link class,
for every way to cut N ranks into tensor-parallel groups inside nodes and data-parallel
(ddp / ZeRO / FSDP) groups across them — the seeds' argument for TP inside the node, in
numbers::

    N = nodes x ranks per node = dp x tp; tp groups = consecutive ranks (a mesh's
    innermost dimension), dp groups = the ranks with the same tp coordinate

    TP, per step: 4 all-reduces of [batch/dp, seq, hidden] per layer (2 forward, 2 backward:
        Megatron's f/g pair), 1 for the vocab-parallel embedding, 1 for the head's input
        gradient, 3 of one number per token for the vocab-parallel cross-entropy
    DP, per step, on each rank's TP shard of Psi_t parameters: ddp an all-reduce,
        zero1/zero2 a reduce-scatter and an all-gather, fsdp two all-gathers and a
        reduce-scatter; a ring collective of P elements sends (n-1)/n P per rank

Memory per rank is mpitp's fp32 trainer's (parameters, gradients, AdamW moments):
ddp 16 Psi_t, zero1 8 Psi_t + 8 Psi_t/dp, zero2 4 Psi_t + 12 Psi_t/dp, fsdp 16 Psi_t/dp
(activations not counted). Psi_t is the largest TP rank's share (the inference cut of
:func:`mpitp.plan.tp.shard_shapes`: attention by KV groups, vocabulary in 64-row blocks).
Times are the alpha-beta model with no overlap: a ring is paced by its slowest link.
"""

from __future__ import annotations

from .profiles import Profile
from .tp import ModelShape, shard_shapes

MODES = ("ddp", "zero1", "zero2", "fsdp")
DP_PASSES = {"ddp": 2, "zero1": 2, "zero2": 2, "fsdp": 3}  # ring passes over Psi_t per step


def shard_params(m: ModelShape, tp: int) -> int:
    """Parameters the most loaded TP rank holds."""
    if tp == 1:
        return m.params()
    return max(r["weights"] for r in shard_shapes(m, tp)["per_rank"])


def memory(psi_t: int, dp: int, mode: str) -> float:
    return {
        "ddp": 16 * psi_t,
        "zero1": 8 * psi_t + 8 * psi_t / dp,
        "zero2": 4 * psi_t + 12 * psi_t / dp,
        "fsdp": 16 * psi_t / dp,
    }[mode]


def layout(
    m: ModelShape, tp: int, dp: int, nodes: int, mode: str, batch: int, seq: int, itemsize: int, prof: Profile
) -> dict:
    """One (dp, tp) cut of ``nodes`` x (tp·dp/nodes) ranks: memory, bytes and time per step."""
    n = tp * dp
    if n % nodes:
        raise ValueError(f"{n} ranks do not fill {nodes} nodes evenly")
    per_node = n // nodes
    tp_inside = per_node % tp == 0
    psi_t = shard_params(m, tp)
    tokens = -(-batch // dp) * seq  # per dp group
    msg = tokens * m.hidden * itemsize
    count = 4 * m.layers + 2
    tp_rank = 0.0
    tp_time = 0.0
    if tp > 1:
        tp_rank = (count * msg + 3 * tokens * 8) * 2 * (tp - 1) / tp
        link = prof.intra if tp_inside else prof.inter
        tp_time = count * 2 * (tp - 1) * link.time(msg / tp) + 3 * 2 * (tp - 1) * link.time(tokens * 8 / tp)
    dp_rank = 0.0
    dp_time = 0.0
    if dp > 1:
        passes = DP_PASSES[mode]
        dp_rank = passes * (dp - 1) / dp * psi_t * itemsize
        link = prof.inter if nodes > 1 else prof.intra
        dp_time = passes * (dp - 1) * link.time(psi_t * itemsize / dp)
    # per node: tp rings inside the node (or all inter when a tp group spans nodes); each dp
    # ring crosses every node boundary once, so per node tp of its ranks send their dp bytes out
    dp_out = min(tp, per_node) if nodes > 1 else 0
    inter = (per_node * tp_rank if not tp_inside else 0.0) + dp_out * dp_rank
    intra = (per_node * tp_rank if tp_inside else 0.0) + (per_node - dp_out) * dp_rank
    return {
        "tp": tp,
        "dp": dp,
        "mode": mode,
        "params_per_tp_rank": psi_t,
        "memory_per_rank_bytes": memory(psi_t, dp, mode),
        "tp_bytes_per_rank": tp_rank,
        "tp_link": ("intra" if tp_inside else "inter") if tp > 1 else "-",
        "dp_bytes_per_rank": dp_rank,
        "dp_link": ("inter" if nodes > 1 else "intra") if dp > 1 else "-",
        "inter_bytes_per_node": inter,
        "intra_bytes_per_node": intra,
        "comm_time_s": tp_time + dp_time,
    }


def plan(
    m: ModelShape, ranks: int, nodes: int, mode: str, batch: int, seq: int, itemsize: int, prof: Profile
) -> list[dict]:
    """Every tp dividing ``ranks`` (up to the attention heads), tp inside dp."""
    rows = []
    for tp in range(1, ranks + 1):
        if ranks % tp == 0 and tp <= m.heads:
            rows.append(layout(m, tp, ranks // tp, nodes, mode, batch, seq, itemsize, prof))
    return rows
