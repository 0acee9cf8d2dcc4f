"""Inference layouts across nodes: what one decode step sends, and what each rank holds.

P pipeline stages of T tensor-parallel ranks (:mod:`mpitp.models.pipeline`), ranks placed
in order on ``nodes`` nodes of P·T/nodes ranks. Per step (``batch`` rows, one new token
each; activations float32)::

    inside a stage of n layers     2n all-reduces of B·H·4 bytes over its T ranks (ring:
                                   2(T-1) messages of B·H·4/T each), the first stage's
                                   embedding one more, the last stage's head an all-gather
                                   of its vocabulary rows (B·V·4/T a rank, T-1 messages; with
                                   ``greedy``, of a (value, token) pair a row: B·16); OLMoE
                                   n more of B·8 bytes (its q/k norms' sums of squares)
    each stage boundary            each tp rank sends ⌈B·H/T⌉·4 bytes to its counterpart
    the tokens back                the last stage broadcasts B int64 over the P stages

A link is inter-node when its two ranks sit on different nodes. The stages run in turn for
one stream, so a step's communication time is the sum over the stages and boundaries
(alpha-beta, :mod:`.profiles`). ``pp_boundary_bytes_per_rank`` is what a real run's
point-to-point counters record per step (tests/mpi/test_pipeline.py).
"""

from __future__ import annotations

import math

from ..models.config import LlamaConfig
from ..models.pipeline import PipelineError, balance, layer_params
from .profiles import Profile
from .tp import WEIGHT_BYTES


def pp_boundary_bytes_per_rank(m: LlamaConfig, T: int, batch: int, tokens: int = 1) -> int:
    """Bytes one tp rank sends across a stage boundary per step (its padded 1/T)."""
    return -(-batch * tokens * m.hidden_size // T) * 4


def _ring(T: int, nbytes: float) -> tuple[int, float]:
    """(messages, bytes) one rank sends in a ring all-reduce of ``nbytes``."""
    return (2 * (T - 1), 2 * (T - 1) * nbytes / T) if T > 1 else (0, 0.0)


def plan(
    m: LlamaConfig,
    P: int,
    T: int,
    nodes: int,
    batch: int,
    context: int,
    prof: Profile,
    weights: str | None = None,
    greedy: bool = False,
) -> dict:
    world = P * T
    if nodes < 1 or world % nodes:
        raise PipelineError(f"{world} ranks (pp {P} × tp {T}) do not fill {nodes} node(s) evenly")
    per_node = world // nodes
    node = lambda rank: rank // per_node  # noqa: E731
    stages = balance(m, P)
    H, V, d = m.hidden_size, m.vocab_size, m.head_dim
    wbytes = WEIGHT_BYTES[weights.lower()] if weights else 4.0
    per_layer = layer_params(m)
    kv_local = max(1, m.num_key_value_heads // T)  # KV heads a rank holds (replicated when T > KV heads)
    links: dict[str, list[float]] = {"intra": [0, 0.0], "inter": [0, 0.0]}  # per step, all ranks: messages, bytes
    time_s, rows = 0.0, []
    memory = 0
    for s, (l0, l1) in enumerate(stages):
        ranks = list(range(s * T, (s + 1) * T))
        inside = len({node(r) for r in ranks}) == 1
        link = prof.intra if inside else prof.inter  # a ring's pace is its slowest hop
        crossing = sum(node(ranks[j]) != node(ranks[(j + 1) % T]) for j in range(T))  # ring hops between nodes
        ars = 2 * (l1 - l0) + (1 if s == 0 else 0)
        norms = (l1 - l0) if m.qk_norm_whole else 0  # OLMoE: q's and k's sums of squares, 8 bytes a row
        msgs, sent = _ring(T, batch * H * 4)
        nmsgs, nsent = _ring(T, batch * 8)
        row = 16 if greedy else V * 4 / T  # what the head sends a row: a pair, or its logits
        gmsgs, gsent = (T - 1, (T - 1) * batch * row) if s == P - 1 and T > 1 else (0, 0.0)
        for cls, senders in (("inter", crossing), ("intra", T - crossing)):  # each rank sends to its successor
            links[cls][0] += senders * (ars * msgs + norms * nmsgs + gmsgs)
            links[cls][1] += senders * (ars * sent + norms * nsent + gsent)
        t = ars * (2 * (T - 1) * link.time(batch * H * 4 / T) if T > 1 else 0.0)
        t += norms * (2 * (T - 1) * link.time(batch * 8 / T) if T > 1 else 0.0)
        t += (T - 1) * link.time(batch * row) if gmsgs else 0.0
        time_s += t
        held = (l1 - l0) * per_layer / T * wbytes
        held += (V * H / T * wbytes if s == 0 else 0) + (V * H / T * wbytes + H * 4 if s == P - 1 else 0)
        kv = 2 * (l1 - l0) * batch * context * kv_local * d * 4
        memory = max(memory, round(held) + kv)
        rows.append({"stage": s, "layers": [l0, l1], "ranks": ranks, "tp_inside_node": inside,
                     "allreduces": ars + norms, "weights_per_rank_bytes": round(held), "kv_cache_per_rank_bytes": kv,
                     "tp_time_s": t})  # fmt: skip
    bb = pp_boundary_bytes_per_rank(m, T, batch)
    crossings = 0
    for s in range(P - 1):
        inter = any(node(s * T + j) != node((s + 1) * T + j) for j in range(T))
        crossings += inter
        cls = "inter" if inter else "intra"
        links[cls][0] += T
        links[cls][1] += T * bb
        time_s += (prof.inter if inter else prof.intra).time(bb)
    if P > 1:  # the tokens back: a broadcast tree over the stages
        hops = math.ceil(math.log2(P))
        cls = "inter" if nodes > 1 else "intra"
        links[cls][0] += P - 1
        links[cls][1] += (P - 1) * batch * 8
        time_s += hops * (prof.inter if nodes > 1 else prof.intra).time(batch * 8)
    return {
        "pp": P,
        "tp": T,
        "nodes": nodes,
        "ranks_per_node": per_node,
        "batch": batch,
        "context": context,
        "weights": weights or "float32",
        "stages": rows,
        "pp_boundary_bytes_per_rank": bb if P > 1 else 0,
        "stage_boundaries_across_nodes": crossings,
        "messages_per_step": {k: int(v[0]) for k, v in links.items()},
        "bytes_per_step": {k: round(v[1]) for k, v in links.items()},
        "comm_time_s": time_s,
        "memory_per_rank_bytes": memory,
    }


def crossover(m: LlamaConfig, P: int, T: int, nodes: int, batch: int, prof: Profile) -> float | None:
    """The inter-node latency (s) above which P stages of T beat tensor parallelism over all
    P·T ranks on the same nodes, for one stream's communication time (None: never, or always)."""
    from dataclasses import replace

    def at(alpha: float, p: int, t: int) -> float:
        q = replace(prof, inter=replace(prof.inter, alpha=alpha))
        return plan(m, p, t, nodes, batch, 1, q)["comm_time_s"]

    a0, a1 = 0.0, 1e-3  # comm time is linear in alpha: solve the line
    pp0, pp1, tp0, tp1 = at(a0, P, T), at(a1, P, T), at(a0, 1, P * T), at(a1, 1, P * T)
    dpp, dtp = (pp1 - pp0) / a1, (tp1 - tp0) / a1
    if dtp <= dpp:
        return None
    return max(0.0, (pp0 - tp0) / (dtp - dpp))


def ranks_hit(experts_per_rank: list[int], k: int) -> list[float]:
    """For each rank, the chance that a token's k experts (chosen uniformly, without
    repeats, from all of them) include one it holds: 1 - C(E - n, k) / C(E, k)."""
    E = sum(experts_per_rank)
    return [1 - math.comb(E - n, k) / math.comb(E, k) for n in experts_per_rank]


def moe(m: LlamaConfig, ranks: int, nodes: int, batch: int, weights: str | None = None) -> dict:
    """A mixture of experts over ``ranks`` ranks on ``nodes`` nodes (ranks in order), a decode
    step of ``batch`` rows in all (activations float32), per generated token, all ranks::

        tp attention (--moe ep or tp)   2 all-reduces a layer (attention's, the experts' sum) of
                                        B·H·4 bytes (ring: 2(p-1)/p of it sent a rank; OLMoE's
                                        q/k norms one more of B·8), the
                                        embedding's one more, the head's all-gather (V·4 (p-1)/p
                                        a row; greedy rows, "tp_greedy": a (value, token) pair,
                                        16 bytes, to each other rank)
        dp attention (--dp-attention)   B/p rows a rank; each MoE layer sends each row once to
                                        every other rank holding one of its experts (H + 2k
                                        floats: x, the experts, their weights) and gets its sum
                                        back (H floats); the head's vocabulary cut: each row
                                        all-gathered (H + 5 floats to every other rank) and
                                        every rank's (max, token, mass) of every row, 24 bytes,
                                        to every other; no all-reduce

    Expected bytes under uniform routing (:func:`ranks_hit`); a run's traffic counters equal
    what its actual routes ask, to the byte (tests/mpi/test_llama.py)."""
    from ..models.moe import MoEPlan, choose

    if not m.num_experts:
        raise PipelineError("the model has no experts")
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise PipelineError(f"{ranks} ranks do not fill {nodes} node(s) evenly")
    H, k, V, p = m.hidden_size, m.num_experts_per_tok, m.vocab_size, ranks
    per_node = p // nodes
    sparse = sum(m.sparse(i) for i in range(m.num_hidden_layers))
    wbytes = WEIGHT_BYTES[weights.lower()] if weights else 4.0
    block = 256 if weights and weights.lower() in ("q4_k", "q6_k") else 32 if weights else 1
    ep = MoEPlan.of(m, p, "ep", block)
    hit = ranks_hit(ep.experts, k)
    links: dict[str, dict[str, float]] = {k: {"inter": 0.0, "intra": 0.0} for k in ("tp", "tp_greedy", "dp")}
    row = (H + 2 * k) * 4 + H * 4  # out and back
    picks = (H + 5) * 4 + 24 * p  # the head: the row to q, and q's answers for every row (p a row of r's)
    for r in range(p):  # dp: each rank's rows to the others (per row of its own)
        for q in range(p):
            if q != r:
                links["dp"]["inter" if q // per_node != r // per_node else "intra"] += sparse * hit[q] * row + picks
    _, ring = _ring(p, batch * H * 4)
    norms = m.num_hidden_layers * _ring(p, batch * 8)[1] if m.qk_norm_whole else 0.0  # OLMoE's q/k norms
    crossing = nodes if nodes > 1 else 0  # ring hops that leave a node, of p
    for mode, head in (("tp", V * 4 / p), ("tp_greedy", 16)):
        per_step = (2 * m.num_hidden_layers + 1) * ring + norms + ((p - 1) * batch * head if p > 1 else 0)
        links[mode]["inter"] = p * per_step * crossing / p / batch
        links[mode]["intra"] = p * per_step * (p - crossing) / p / batch
    for cls in links["dp"]:
        links["dp"][cls] /= p  # per row: each of the p ranks decodes batch / p rows
    expert = 3 * H * m.moe_intermediate_size * wbytes
    attention = sum(layer_params(m, i) for i in range(m.num_hidden_layers)) * wbytes - sparse * m.num_experts * (
        expert + H * 4
    )
    return {
        "ranks": p,
        "nodes": nodes,
        "batch": batch,
        "experts_per_rank_ep": ep.experts,
        "columns_per_rank_tp": MoEPlan.of(m, p, "tp", block).columns,
        "auto": choose(m, p, block, batch),
        "expert_weights_per_rank_bytes": round(sparse * max(ep.experts) * expert),
        "other_weights_per_rank_bytes": {"tp": round(attention / p), "dp": round(attention)},
        "bytes_per_token": {mode: {cls: round(v) for cls, v in d.items()} for mode, d in links.items()},
        "dp_rows_sent_per_token": sparse * sum(hit[1:]),
    }
