"""A mixture-of-experts MLP (Qwen3-MoE; Qwen2-MoE's shared expert) cut over ranks, two ways.

Every rank holds the router whole and routes every token the same way (softmax, top-k,
renormalized where ``norm_topk_prob``); what it then multiplies depends on the cut::

    ep: rank r holds whole experts [s_r, s_r + n_r)       tp: every expert's intermediate columns
        (128 experts over 3 ranks: 43 + 43 + 42)              cut over the ranks (as a dense MLP)

        e0 e1 e2 │ e3 e4 │ e5 e6                              e0 e1 e2 e3 e4 e5 e6
        ─rank 0─   ─ r1 ─   ─ r2 ─                             ─── r0's columns of each ───
                                                               ─── r1's columns of each ───

    y_r = Σ over its experts e, over the tokens t routed to e:  w[t, e] · down_e(SiLU(gate_e x_t) · up_e x_t)
    y   = all-reduce(y_r)                                       (one per layer, as the dense MLP's)

In a batch (prefill, several sequences decoding) the tokens are grouped by expert, so each
expert's weights are read once per step for all its tokens. ep reads whole experts (big
matmuls, a rank idle when none of its experts is chosen); tp reads a slice of every chosen
expert (balanced at batch 1). A shared expert (Qwen2-MoE) is cut as the dense MLP is, its
sigmoid gate replicated; its partial sums ride the same all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..tp import ReplicatedLinear, partition
from .config import LlamaConfig
from .layers import MLP, decode_kernels, fast

MODES = ("ep", "tp")


@dataclass(frozen=True)
class MoEPlan:
    """How a model's experts are cut over ``p`` ranks: ``mode`` ep or tp; ``experts``: whole
    experts per rank (ep; every expert on every rank under tp); ``columns``: expert 0's
    intermediate columns per rank (tp; whole under ep; expert e's: :meth:`cut`);
    ``shared``: the shared expert's."""

    mode: str
    experts: list[int]
    columns: list[int]
    shared: list[int]

    @classmethod
    def of(cls, c: LlamaConfig, p: int, mode: str, block: int = 1) -> MoEPlan:
        if mode not in MODES:
            raise partition.ShardingError(f"--moe {mode!r}: one of {', '.join(MODES)}")
        shared = partition.mlp(c.shared_expert_intermediate_size, p, block) if c.shared_expert_intermediate_size else []
        if mode == "ep":
            return cls("ep", partition.experts(c.num_experts, p), [c.moe_intermediate_size] * p, shared)
        return cls("tp", [c.num_experts] * p, partition.mlp(c.moe_intermediate_size, p, block), shared)

    def cut(self, e: int) -> list[int]:
        """Expert ``e``'s intermediate columns per rank: ``columns`` turned by e. Where whole
        blocks cannot split evenly (768 columns in super-blocks of 256 over 2 ranks: 512 +
        256), each rank takes the bigger share of every p-th expert instead of all of them,
        so the ranks hold and read alike (a token's 8 experts: ~4 whole experts' columns a
        rank, not 5.3 on one)::

            expert   0    1    2    3          rank 0: 512  256  512  256
                                               rank 1: 256  512  256  512
        """
        p = len(self.columns)
        return [self.columns[(r + e) % p] for r in range(p)] if self.mode == "tp" else self.columns

    def held(self, r: int) -> range:
        """The experts rank ``r`` holds (all of them under tp)."""
        if self.mode == "tp":
            return range(self.experts[r])
        s = partition.starts(self.experts)[r]
        return range(s, s + self.experts[r])


class Router(ReplicatedLinear):
    """The router (and a shared expert's gate): whole on every rank, kept in float32 whatever
    ``--weights`` says, so that every rank, and transformers, choose the same experts."""

    keep_float = True


def route(logits, k: int, renormalize: bool, xp=np):
    """(experts [N, k], weights [N, k], probabilities [N, E]) from router logits [N, E]:
    softmax in float32, the k largest probabilities (largest first; a tie goes to the lower
    expert), renormalized to sum to 1 where ``renormalize``."""
    z = logits.astype(np.float32, copy=False)
    z = xp.exp(z - z.max(axis=-1, keepdims=True))
    probs = z / z.sum(axis=-1, keepdims=True)
    top = xp.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = xp.take_along_axis(probs, top, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return top, w, probs


class SparseMoE:
    """The MoE block of one decoder layer on this rank (see the module's picture)."""

    def __init__(self, cfg: LlamaConfig, comm, dtype, xp, plan: MoEPlan, dispatch: bool = False):
        """``dispatch``: data-parallel attention (:func:`dispatch_rows`): each rank's tokens are
        its own, sent to their experts' ranks by all-to-all and their sums returned the same
        way; the shared expert then whole on every rank."""
        self.xp, self.comm, self.plan, self.dispatch = xp, comm, plan, dispatch
        self.k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        H, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.inter = inter
        self.gate = Router(H, cfg.num_experts, bias=False, comm=None, dtype=dtype, xp=xp)
        r = comm.rank if comm is not None else 0
        cut = comm if plan.mode == "tp" else None  # ep: each expert whole on its rank
        # each expert a SwiGLU MLP: whole on this rank (ep), or its columns of it (tp), unreduced
        self.experts = {
            e: MLP(H, inter, cut, dtype, xp, plan.cut(e) if cut else None, reduce=False) for e in plan.held(r)
        }
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Router | None = None
        if cfg.shared_expert_intermediate_size:
            shared_comm = None if dispatch else comm  # data-parallel: whole, for this rank's own tokens
            self.shared_expert = MLP(
                H, cfg.shared_expert_intermediate_size, shared_comm, dtype, xp, None if dispatch else plan.shared,
                reduce=False,
            )  # fmt: skip
            self.shared_expert_gate = Router(H, 1, bias=False, comm=None, dtype=dtype, xp=xp)
        self.owner = np.repeat(np.arange(len(plan.experts)), plan.experts) if plan.mode == "ep" else None
        self.last_routes: tuple | None = None  # (experts [N, k], probabilities [N, E]) of the last call, for tests
        self._bound: dict = {}  # expert -> its weights' bound kernels (made at its first call after loading)
        self._group: Any = None  # the held experts in one compiled call, False where they cannot be (_grouped)
        self.log: list | None = None  # a list: every call's routes appended (tests compare two models')

    def __call__(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        top, w, probs = route(self.gate(flat), self.k, self.renormalize, self.xp)
        self.last_routes = (top, probs)
        if self.log is not None:
            self.log.append(self.last_routes)
        w = w.astype(flat.dtype, copy=False)
        if self.dispatch and self.comm is not None and self.comm.size > 1:
            y = self._dispatched(flat, top, w)
        else:
            y = self._held_experts(flat, top, w)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            g = self.shared_expert_gate(flat)
            y += self.shared_expert(flat) / (1.0 + self.xp.exp(-g))
        if not self.dispatch and self.comm is not None and self.comm.size > 1:  # a rank with no expert still joins
            self.comm.allreduce(y, out=y)
        return y.reshape(shape)

    def _held_experts(self, x, top, w):
        """Σ over this rank's experts e and the rows routed to e of w · e(x): [N, H]."""
        y = self.xp.zeros_like(x)
        host = type(x) is np.ndarray and x.dtype == np.float32
        if host and (group := self._grouped()) is not None:
            if x.shape[0] <= group.ROWS:  # the loop below in one compiled call (decode steps); it
                group(x, top, w, y)  # gathers each expert's rows itself, so x may be a view
                return y
        if host:
            from ..kernels.experts import combine  # numba's: imported where it runs
        for e in self.xp.unique(top).tolist():  # the experts some row chose, each once
            expert = self.experts.get(e)
            if expert is None:  # another rank's (ep)
                continue
            rows, slot = self.xp.nonzero(top == e)  # the rows routed to e, each once
            out = self._expert(e, expert, x[rows])
            if host and out.dtype == np.float32:
                combine(y, rows, out, w[rows, slot])
            else:
                y[rows] += out * w[rows, slot][:, None]
        return y

    def _dispatched(self, x, top, w):
        """Data-parallel attention's exchange (see :func:`dispatch_rows`): this rank's rows to
        the ranks holding their experts, one all-to-all out and one back (its counts known:
        those sent out), summed here. The rows that came here run in one call with this rank's
        own, so an expert chosen by both reads its weights once."""
        H, k = x.shape[1], self.k
        assert self.owner is not None  # dispatch: experts cut ep
        owner = self.owner[top]  # [N, k] the rank holding each chosen expert
        order, counts, mine = dispatch_rows(owner, self.comm.size)
        # one buffer a row: x, then the k chosen experts (-1 where another rank holds it), then the weights
        out = np.empty((order.size, H + 2 * k), np.float32)
        out[:, :H] = x[order]
        out[:, H : H + k] = np.where(mine, top[order], -1)
        out[:, H + k :] = w[order]
        got, sources = self.comm.alltoallv(out, counts)
        experts = got[:, H : H + k].astype(np.int64)  # -1 where another rank holds it
        y = self._held_experts(got[:, :H], experts, got[:, H + k :])
        back, _ = self.comm.alltoallv(y, sources, sources=counts)  # each row's sum to the rank it came from
        total = np.zeros_like(x)
        np.add.at(total, order, back)
        return total

    def _grouped(self):
        """The held experts bound for one compiled call (:class:`mpitp.kernels.experts.Grouped`),
        made at the first decode step after loading; False where they are not int8 tiles."""
        if self._group is None:
            held = {e: (ex.gate_up_proj.qweight, ex.down_proj.qweight) for e, ex in self.experts.items()}
            group = None
            if self.xp is np and all(w is not None for p in held.values() for w in p):
                from ..kernels.experts import Grouped

                group = Grouped.of(held, self.gate.out_features)
            self._group = group or False
        return self._group or None

    def _expert(self, e: int, expert: MLP, x):
        """``expert(x)``; for a few rows of NumPy float32, through the weights' bound kernels
        (:meth:`mpitp.tp.linear.LinearBase.kernel`: chosen once per expert, as the decode loop
        binds a dense layer's), which spares each call the kernel's lookup."""
        bound = self._bound.get(e)
        if bound is None:
            bound = self._bound[e] = (expert.gate_up_proj.kernel(), expert.down_proj.kernel())
        (gate_up, r1), (down, r2) = bound
        M = x.shape[0]
        if M > min(r1, r2) or not fast(x):
            return expert(x)
        gu = np.empty((M, expert.gate_up_proj.out_features), np.float32)
        gate_up(x, gu)
        half = gu.shape[1] // 2
        act = np.empty((M, half), np.float32)
        decode_kernels().swiglu(gu, act)
        out = np.empty((M, expert.down_proj.out_features), np.float32)
        down(act, out)
        return out

    def all_expert_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every expert's tensors of this layer, held here or not:
        every rank checks them all at load, so a missing or mis-shaped expert fails on every
        rank with the same message."""
        H, inter = self.gate.in_features, self.inter
        out: dict[str, tuple[int, ...]] = {}
        for e in range(self.gate.out_features):
            for part, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
                out[f"{prefix}experts.{e}.{part}.weight"] = shape
        return out

    def named_modules(self, prefix: str):
        """(checkpoint prefix, module) of its weights, in reading order."""
        yield prefix + "gate", self.gate
        for e, ex in self.experts.items():
            yield f"{prefix}experts.{e}.gate_up_proj", ex.gate_up_proj
            yield f"{prefix}experts.{e}.down_proj", ex.down_proj
        if self.shared_expert is not None:
            yield prefix + "shared_expert.gate_up_proj", self.shared_expert.gate_up_proj
            yield prefix + "shared_expert.down_proj", self.shared_expert.down_proj
            yield prefix + "shared_expert_gate", self.shared_expert_gate


def dispatch_rows(owner, p: int):
    """How data-parallel attention sends its rows to their experts: ``owner`` [N, k] the rank
    of each row's chosen experts. Returns (order, counts, mine): the rows to send grouped by
    destination rank (a row once to each rank that holds any of its experts, in row order),
    how many go to each rank, and for each sent row which of its k experts that rank holds::

        row 0 chose experts on ranks [0, 1, 1]   ->  to rank 0: row 0 (mine [T, F, F])
        row 1 chose experts on ranks [1, 1, 1]       to rank 1: rows 0, 1 (mine [F, T, T], [T, T, T])
    """
    order, counts, mine = [], [], []
    for q in range(p):
        hit = owner == q
        rows = np.flatnonzero(hit.any(axis=1))
        order.append(rows)
        counts.append(int(rows.size))
        mine.append(hit[rows])
    k = owner.shape[1] if owner.ndim == 2 else 0
    return np.concatenate(order), counts, np.concatenate(mine) if mine else np.zeros((0, k), bool)


def expected_reads(c: LlamaConfig, p: int, mode: str, block: int = 1, batch: int = 1, samples: int = 512) -> float:
    """Expert weights (in columns of one expert's 3·hidden) the slowest rank reads in one
    step of ``batch`` tokens, averaged over uniform routings (a fixed seed: the same on every
    rank): under ep, the distinct chosen experts it holds times their whole width; under tp,
    its columns of every distinct chosen expert (:meth:`MoEPlan.cut`)."""
    plan = MoEPlan.of(c, p, mode, block)
    E, k = c.num_experts, c.num_experts_per_tok
    rng = np.random.default_rng(0)
    owner = np.repeat(np.arange(p), plan.experts) if mode == "ep" else None
    cuts = np.array([plan.cut(e) for e in range(E)]) if owner is None else None  # [E, p] columns
    total = 0.0
    for _ in range(samples):
        chosen = np.zeros(E, bool)
        for _ in range(batch):
            chosen[rng.choice(E, k, replace=False)] = True
        if owner is not None:
            total += np.bincount(owner[chosen], minlength=p).max() * c.moe_intermediate_size
        elif cuts is not None:
            total += cuts[chosen].sum(axis=0).max()
    return total / samples


def choose(c: LlamaConfig, p: int, block: int = 1, batch: int = 1) -> str:
    """``--moe auto``: ep or tp, whichever has its slowest rank read fewer expert weights per
    step (:func:`expected_reads`); ep where they tie (bigger matmuls, no column cut) or tp
    cannot cut an expert's columns this many ways."""
    if p == 1 or p > c.moe_intermediate_size:
        return "ep"
    if p > c.num_experts:
        return "tp"
    ep, tp = (expected_reads(c, p, m, block, batch) for m in MODES)
    return "ep" if ep <= tp else "tp"
