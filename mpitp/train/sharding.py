"""Who holds what, per mode, on N data-parallel ranks (Ψ = parameter elements)::

    mode    parameters      gradients                          AdamW moments   traffic per step
    ddp     full            full, all-reduced per unit          full            2Ψ (all-reduce)
    zero1   full            full, reduce-scattered at the end   own shard       2Ψ (reduce-scatter + all-gather)
    zero2   full            own shard, reduce-scattered per     own shard       2Ψ
                            unit as soon as backward leaves it
    fsdp    own shard;      own shard (as zero2)                own shard       3Ψ (gather fwd + gather bwd
            a unit is gathered before use and freed after                       + reduce-scatter)

fsdp prefetches the next unit's all-gather (nonblocking) while the current one computes.
A tied embedding is gathered once per step and kept until the embedding's backward has
run (the head uses it in between), as torch FSDP keeps its root unit.

Mixed precision (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``): the
optimizer's parameters (``master``) and AdamW state stay in ``dtype``; the values forward
and backward use are the masters rounded to ``param_dtype`` (fsdp gathers the shards in
``param_dtype``, half the bytes for bfloat16, and widens a unit when it is used; zero1/2
gather the updated shards in ``param_dtype``; ddp rounds its copy), computed on in
``dtype`` (NumPy's BLAS has no bfloat16). Gradients are rounded to ``reduce_dtype`` and
reduced in it (the Communicator's bfloat16 path adds in float32 and rounds each sum), then
accumulated in ``dtype``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .layout import UnitLayout

MODES = ("ddp", "zero1", "zero2", "fsdp")


class Unit:
    def __init__(self, layout: UnitLayout, n: int, rank: int, mode: str, dtype, keep: bool, mixed: bool = False):
        self.layout, self.keep = layout, keep
        self.padded = layout.padded(n)
        self.lo, self.hi = layout.owned(n, rank)
        sharded_params = mode == "fsdp"
        # Which arrays exist depends on the mode (None where it keeps none); each code path
        # below runs in the modes that have its arrays, so they are typed Any, not Optional.
        self.full: Any = None  # the whole unit as forward/backward use it
        self.shard: Any = np.zeros(self.hi - self.lo, dtype)
        if not sharded_params:
            self.full = np.zeros(self.padded, dtype)
            if not mixed:  # the values used are the masters themselves
                self.shard = self.full[self.lo : self.hi]
        # what AdamW updates, loads and saves: ddp the whole unit, the others their shard
        self.master: Any = self.shard if mode != "ddp" else (np.zeros(self.padded, dtype) if mixed else self.full)
        self.grad: Any = np.zeros(self.padded, dtype) if mode in ("ddp", "zero1") else None  # persistent full grads
        self.gshard: Any = None if mode == "ddp" else np.zeros(self.hi - self.lo, dtype)
        self.pending: Any = None  # a nonblocking gather or reduction in flight


class Sharding:
    """Parameters, gradients and the optimizer's slice of both, for one mode."""

    def __init__(
        self,
        comm,
        layouts: list[UnitLayout],
        mode: str,
        dtype=np.float32,
        algorithm: str = "auto",
        keep: tuple[int, ...] = (),
        param_dtype=None,
        reduce_dtype=None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.comm, self.mode, self.dtype, self.algorithm = comm, mode, np.dtype(dtype), algorithm
        self.param_dtype = _dtype(param_dtype, self.dtype)
        self.reduce_dtype = _dtype(reduce_dtype, self.dtype)
        self.mixed = self.param_dtype != self.dtype
        self.n = comm.size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        self.units = [
            Unit(lay, self.n, self.rank, mode, self.dtype, i in keep, self.mixed) for i, lay in enumerate(layouts)
        ]
        self._reductions: list = []
        self.comm_wait = 0.0  # seconds spent waiting for communication (exposed)
        self.peak_gathered = 0  # fsdp: most bytes of gathered parameters held at once

    # ---------------------------------------------------------------- parameters
    def owned_params(self, i: int):
        """The parameter elements this rank initialises, loads and saves: its range."""
        return self.units[i].shard

    def loaded(self) -> None:
        """After the masters were filled (fresh, loaded, resumed): make the values forward
        uses from them (rounded to ``param_dtype`` where it differs)."""
        for u in self.units:
            if self.mode in ("zero1", "zero2") and self.mixed:
                u.shard[...] = u.full[u.lo : u.hi]  # loaded whole: keep this rank's masters
                u.full[...] = self._rounded(u.full)
            elif self.mode == "ddp" and self.mixed:
                u.master[...] = u.full
                u.full[...] = self._rounded(u.full)

    def _rounded(self, x):
        return x.astype(self.param_dtype).astype(self.dtype)

    def params(self, i: int, prefetch: int | None = None):
        """Unit i's whole (padded) parameter buffer; fsdp gathers it (or waits for the
        prefetch) and starts gathering unit ``prefetch``."""
        u = self.units[i]
        if self.mode == "fsdp":
            if u.full is None:
                self._start_gather(u)
            if u.pending is not None:
                self._wait(u.pending)
                u.pending = None
            if u.full.dtype != self.dtype:  # gathered in param_dtype: widened for use
                u.full = u.full.astype(self.dtype)
            if prefetch is not None and self.units[prefetch].full is None:
                self._start_gather(self.units[prefetch])
        return u.full

    def _start_gather(self, u: Unit) -> None:
        u.full = np.empty(u.padded, self.param_dtype)
        held = sum(x.full.nbytes for x in self.units if x.full is not None)
        self.peak_gathered = max(self.peak_gathered, held)
        mine = u.shard.astype(self.param_dtype) if self.mixed else u.shard
        if self.n == 1:
            u.full[...] = mine
            return
        u.pending = self.comm.allgather(mine, out=u.full, algorithm=self.algorithm, nonblocking=True)

    def release(self, i: int, force: bool = False) -> None:
        """fsdp: free unit i's gathered parameters (kept units only when ``force``)."""
        u = self.units[i]
        if self.mode == "fsdp" and (force or not u.keep) and u.pending is None:
            u.full = None

    def sync_params(self) -> None:
        """After the optimizer updated the masters: zero1/zero2 gather the full parameters
        (in ``param_dtype``); ddp with mixed precision rounds its copy."""
        if self.mode == "ddp" and self.mixed:
            for u in self.units:
                u.full[...] = self._rounded(u.master)
        if self.mode not in ("zero1", "zero2") or (self.n == 1 and not self.mixed):
            return
        if not self.mixed:
            handles = [
                self.comm.allgather(u.full[u.lo : u.hi].copy(), out=u.full, algorithm=self.algorithm, nonblocking=True)
                for u in self.units
            ]
            for h in handles:
                self._wait(h)
            return
        bufs = [np.empty(u.padded, self.param_dtype) for u in self.units]
        handles = []
        for u, b in zip(self.units, bufs):
            mine = u.shard.astype(self.param_dtype)
            if self.n == 1:
                b[...] = mine
            else:
                handles.append(self.comm.allgather(mine, out=b, algorithm=self.algorithm, nonblocking=True))
        for h in handles:
            self._wait(h)
        for u, b in zip(self.units, bufs):
            u.full[...] = b

    # ---------------------------------------------------------------- gradients
    def zero_grads(self) -> None:
        for u in self.units:
            if u.grad is not None:
                u.grad[...] = 0
            if u.gshard is not None:
                u.gshard[...] = 0

    def grad(self, i: int):
        """Unit i's whole gradient buffer to accumulate into (zero2/fsdp: a fresh one that
        :meth:`reduce` hands back)."""
        u = self.units[i]
        if u.grad is None:
            u.grad = np.zeros(u.padded, self.dtype)
        return u.grad

    def _to_reduce(self, g):
        """The gradient as it is reduced: rounded to ``reduce_dtype`` where that differs."""
        return g if self.reduce_dtype == self.dtype else g.astype(self.reduce_dtype)

    def reduce(self, i: int, last_micro: bool) -> None:
        """Backward is done with unit i for this micro-batch: start its reduction."""
        u = self.units[i]
        if self.mode in ("zero2", "fsdp"):
            if self.n == 1:
                u.gshard += self._to_reduce(u.grad)
                u.grad = None
            else:
                g = self._to_reduce(u.grad)
                self._reductions.append((u, self.comm.reduce_scatter(g, algorithm=self.algorithm, nonblocking=True)))
        elif last_micro and self.n > 1:
            g = self._to_reduce(u.grad)
            if self.mode == "ddp":
                self._reductions.append((u, self.comm.allreduce(g, out=g, algorithm=self.algorithm, nonblocking=True)))
            else:
                self._reductions.append((u, self.comm.reduce_scatter(g, algorithm=self.algorithm, nonblocking=True)))
        elif last_micro:  # one rank: nothing to reduce, but the gradient is rounded as the policy says
            if self.reduce_dtype != self.dtype:
                u.grad[...] = self._to_reduce(u.grad)
            if self.mode == "zero1":
                u.gshard[...] = u.grad

    def finish(self) -> None:
        """Wait for every reduction started this micro-batch."""
        for u, h in self._reductions:
            res = self._wait(h)
            if self.mode == "ddp" and res is not u.grad:  # reduced in reduce_dtype
                u.grad[...] = res
            if self.mode != "ddp":
                u.gshard += res
            if self.mode in ("zero2", "fsdp"):
                u.grad = None
        self._reductions.clear()

    def _wait(self, handle):
        t0 = time.perf_counter()
        res = handle.wait()
        self.comm_wait += time.perf_counter() - t0
        return res

    # ---------------------------------------------------------------- the optimizer's view
    def opt_range(self, i: int) -> tuple[int, int]:
        u = self.units[i]
        return (0, u.padded) if self.mode == "ddp" else (u.lo, u.hi)

    def opt_params(self, i: int):
        return self.units[i].master

    def opt_grads(self, i: int):
        u = self.units[i]
        return u.grad if self.mode == "ddp" else u.gshard

    def grad_sq_sum(self, skip: list[list[tuple[int, int]]] | None = None) -> float:
        """Σ g² over the model as this dp group holds it: owned shards all-reduced (padding
        is zero), or, for ddp, every rank's identical full gradients counted once.
        ``skip[i]``: runs of unit i (its padded buffer) this rank leaves out because
        another rank counts them (tensors replicated over a tp group)."""
        local = 0.0
        for i in range(len(self.units)):
            g = self.opt_grads(i)
            local += float(np.dot(g, g))
            a, b = self.opt_range(i)
            for s, e in skip[i] if skip else ():
                s, e = max(s, a), min(e, b)
                if s < e:
                    local -= float(np.dot(g[s - a : e - a], g[s - a : e - a]))
        if self.mode == "ddp" or self.n == 1:
            return local
        return float(self.comm.allreduce(np.array([local]), algorithm="mpi")[0])

    def persistent_bytes(self) -> dict:
        """Bytes of the arrays this rank keeps between steps (AdamW moments: see optim)."""
        fsdp = self.mode == "fsdp"
        params = sum((u.shard if fsdp else u.full).nbytes for u in self.units)
        if self.mixed and not fsdp:  # the masters beside the values used
            params += sum(u.master.nbytes for u in self.units)
        grads = sum((u.grad if self.mode in ("ddp", "zero1") else u.gshard).nbytes for u in self.units)
        return {"params": params, "grads": grads}


def _dtype(name, default: np.dtype) -> np.dtype:
    if name is None:
        return default
    if str(name) in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
