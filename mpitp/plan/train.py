"""Training on a (dp, tp) mesh: memory per rank and bytes per step on each link class,
for every way to cut N ranks into tensor-parallel groups inside nodes and data-parallel
(ddp / ZeRO / FSDP) groups across them — the seeds' argument for TP inside the node, in
numbers, counted with ``mpitp train``'s own cut (:mod:`mpitp.train.tp_layout`), so a
run's traffic counters match them to the byte::

    N = nodes x ranks per node = dp x tp; tp groups = consecutive ranks (a mesh's
    innermost dimension), dp groups = the ranks with the same tp coordinate

    TP, per micro-batch of t tokens: 4L + 2 ring all-reduces of [t, hidden] (2 per layer
        forward, 2 backward: Megatron's f/g pair; the vocab-parallel embedding; the head's
        input gradient; + 2L with --recompute) and 2 for the vocab-parallel loss (the max,
        then Σexp and the target's logit: t and 2t elements); a ring all-reduce of P
        elements cut in chunks c (numpy.array_split) sends 2P - c[t] - c[t+1] from rank t.
        Once per step: the gradient norm's one float64 (MPI's call).
    DP, per step, over each rank's padded slices (:func:`mpitp.plan.fsdp.train_step_bytes`):
        ddp an all-reduce, zero1/zero2 a reduce-scatter and an all-gather, fsdp gathers in
        forward and backward and a reduce-scatter; the loss (and the norm) through MPI.

Memory per rank is mpitp's fp32 trainer's (parameters, gradients, AdamW moments) over the
most loaded tp rank's padded slices: ddp 16 Psi_t, zero1 8 Psi_t + 8 Psi_t/dp, zero2
4 Psi_t + 12 Psi_t/dp, fsdp 16 Psi_t/dp (activations not counted). Times are the
alpha-beta model with no overlap: a ring is paced by its slowest link.
"""

from __future__ import annotations

from ..models.config import LlamaConfig
from ..split import chunk_counts
from ..train.layout import llama_units
from ..train.tp_layout import TPCut
from .fsdp import fp32_memory, train_step_bytes
from .profiles import Profile


def _ring_allreduce(p: int, n: int, rank: int) -> int:
    """Elements rank ``rank`` sends in a ring all-reduce of ``p`` elements over ``n``."""
    if n == 1:
        return 0
    c = chunk_counts(p, n)
    return 2 * p - c[rank] - c[(rank + 1) % n]


def rank_bytes(
    cfg: LlamaConfig,
    tp: int,
    dp: int,
    mode: str,
    batch: int,
    seq: int,
    itemsize: int,
    *,
    tp_rank: int = 0,
    dp_rank: int = 0,
    accum: int = 1,
    recompute: bool = False,
    param_itemsize: int | None = None,
    reduce_itemsize: int | None = None,
) -> dict:
    """Bytes rank (dp_rank, tp_rank) sends in one training step with ring collectives, per
    group and kind: ``tp`` / ``dp`` (the rings), ``tp_mpi`` / ``dp_mpi`` (MPI's calls). The
    tp activations' all-reduces carry ``param_itemsize`` bytes an element, the loss's
    per-token numbers ``itemsize``."""
    cut = TPCut(cfg, tp, tp_rank, llama_units(cfg))
    L = cfg.num_hidden_layers
    padded = [u.padded(dp) for u in cut.units]
    kept = [i == len(padded) - 1 or (i == 0 and cfg.tie_word_embeddings) for i in range(len(padded))]
    bwd = [0 < i <= L for i in range(len(padded))]
    dp_all = train_step_bytes(
        padded, bwd, kept, dp, mode, itemsize, accum, param_itemsize=param_itemsize, reduce_itemsize=reduce_itemsize
    )
    dp_mpi = 0 if dp == 1 else (8 if mode == "ddp" else 16)
    acts, loss = 0, 0  # tp ring elements: activations (in param_dtype), the loss's numbers
    if tp > 1:
        rows = chunk_counts(batch, dp)[dp_rank]
        per_layer = 4 + (2 if recompute else 0)
        for r in chunk_counts(rows, accum):
            t = r * seq
            if t:
                acts += (per_layer * L + 2) * _ring_allreduce(t * cfg.hidden_size, tp, tp_rank)
                loss += _ring_allreduce(t, tp, tp_rank) + _ring_allreduce(2 * t, tp, tp_rank)
    return {
        "tp": acts * (param_itemsize or itemsize) + loss * itemsize,
        "tp_mpi": 8 if tp > 1 else 0,
        "dp": dp_all - dp_mpi,
        "dp_mpi": dp_mpi,
        "params": sum(u.numel for u in cut.units),
        "memory": fp32_memory(padded, dp, mode),
    }


def layout(
    cfg: LlamaConfig,
    tp: int,
    dp: int,
    nodes: int,
    mode: str,
    batch: int,
    seq: int,
    itemsize: int,
    prof: Profile,
    accum: int = 1,
    param_itemsize: int | None = None,
    reduce_itemsize: int | None = None,
) -> dict:
    """One (dp, tp) cut of ``nodes`` x (tp·dp/nodes) ranks: memory, bytes and time per step
    (the most loaded rank's), and the bytes the busiest node sends over each link class."""
    n = tp * dp
    if n % nodes:
        raise ValueError(f"{n} ranks do not fill {nodes} nodes evenly")
    per_node = n // nodes
    tp_inside = per_node % tp == 0
    every = {
        (d, t): rank_bytes(
            cfg,
            tp,
            dp,
            mode,
            batch,
            seq,
            itemsize,
            tp_rank=t,
            dp_rank=d,
            accum=accum,
            param_itemsize=param_itemsize,
            reduce_itemsize=reduce_itemsize,
        )  # fmt: skip
        for d in range(dp)
        for t in range(tp)
    }
    # each ring sends to its right neighbour: rank (d, t) is world rank d·tp + t, on node
    # rank // per_node; its tp bytes go to (d, t+1), its dp bytes to (d+1, t)
    inter_of, intra_of = [0] * nodes, [0] * nodes
    for (d, t), b in every.items():
        node = (d * tp + t) // per_node
        for nbytes, right in ((b["tp"], d * tp + (t + 1) % tp), (b["dp"], ((d + 1) % dp) * tp + t)):
            (intra_of if right // per_node == node else inter_of)[node] += nbytes
    top = {k: max(r[k] for r in every.values()) for k in every[(0, 0)]}
    tp_rank, dp_rank = top["tp"] + top["tp_mpi"], top["dp"] + top["dp_mpi"]
    tokens = -(-batch // dp) * seq
    tp_time = 0.0
    if tp > 1:
        link = prof.intra if tp_inside else prof.inter
        msg = tokens * cfg.hidden_size * (param_itemsize or itemsize)
        count = 4 * cfg.num_hidden_layers + 2
        tp_time = count * 2 * (tp - 1) * link.time(msg / tp) + 2 * 2 * (tp - 1) * link.time(
            1.5 * tokens * itemsize / tp
        )
    dp_time = 0.0
    if dp > 1:
        link = prof.inter if nodes > 1 else prof.intra
        ps, rs = param_itemsize or itemsize, reduce_itemsize or itemsize
        gathers, reductions = {"ddp": (0, 2), "zero1": (1, 1), "zero2": (1, accum), "fsdp": (2 * accum, accum)}[mode]
        dp_time = (dp - 1) * (
            gathers * link.time(top["params"] * ps / dp) + reductions * link.time(top["params"] * rs / dp)
        )
    return {
        "tp": tp,
        "dp": dp,
        "mode": mode,
        "params_per_tp_rank": top["params"],
        "memory_per_rank_bytes": top["memory"],
        "tp_bytes_per_rank": tp_rank,
        "tp_link": ("intra" if tp_inside else "inter") if tp > 1 else "-",
        "dp_bytes_per_rank": dp_rank,
        "dp_link": ("inter" if nodes > 1 else "intra") if dp > 1 else "-",
        "inter_bytes_per_node": max(inter_of),
        "intra_bytes_per_node": max(intra_of),
        "comm_time_s": tp_time + dp_time,
    }


def plan(
    cfg: LlamaConfig,
    ranks: int,
    nodes: int,
    mode: str,
    batch: int,
    seq: int,
    itemsize: int,
    prof: Profile,
    param_itemsize: int | None = None,
    reduce_itemsize: int | None = None,
) -> list[dict]:
    """Every tp dividing ``ranks`` up to the KV heads (training cuts attention by whole KV
    heads), tp inside dp."""
    rows = []
    for tp in range(1, ranks + 1):
        if ranks % tp == 0 and tp <= cfg.num_key_value_heads:
            rows.append(
                layout(
                    cfg,
                    tp,
                    ranks // tp,
                    nodes,
                    mode,
                    batch,
                    seq,
                    itemsize,
                    prof,
                    param_itemsize=param_itemsize,
                    reduce_itemsize=reduce_itemsize,
                )  # fmt: skip
            )
    return rows
