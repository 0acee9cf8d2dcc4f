"""A mixture of experts' held experts for a decode step's rows, in one compiled call.

At batch 8 a rank of Qwen3-30B-A3B runs ~26 of its experts a layer, most for one row. Each
expert through Python was three bound kernel calls, a SwiGLU, a gather and a scatter: ~30 µs
of dispatch for ~70 µs of weights. Here one numba function walks the experts and calls the
same kernels by address (:mod:`.calls`), as :class:`.int8.Bound`'s fused call does::

    for e in the chosen experts, ascending, that this rank holds:
        rows = the rows routed to e, ascending            xe = x[rows]          [m, H]
        gu   = xe @ gate_up_eᵀ   (x quantized by the IR quantizer, then the kernel for m rows)
        act  = silu(gu[:, :I]) · gu[:, I:]                 (.decode.swiglu)      [m, I]
        out  = act @ down_eᵀ                                                     [m, H]
        y[rows] += out · w[rows, slot]

The same kernels on the same rows in the same order as the Python loop
(:meth:`mpitp.models.moe.SparseMoE._held_experts`), so the same bits. It serves a layer
whose experts are all int8 tiles of one format each (gate_up's and down's), one thread, and
at most :data:`.int8.SMALL` rows; anything else takes the Python loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .calls import kernel_at, quantizer_at
from .decode import swiglu
from .int8 import SMALL, Bound, pointer
from .weights.tiles import ROWS, TiledWeight

EXACT = dict(cache=True, nogil=True, boundscheck=False)  # no fastmath: out · w, then + y, as NumPy rounds


class Grouped:
    """The experts of one MoE layer on this rank, bound for :func:`run` (see the module)."""

    ROWS = SMALL  # the most rows of x a call takes (the kernels' decode row counts)

    def __init__(self, held: dict[int, tuple[TiledWeight, TiledWeight]], num_experts: int):
        self.slot = np.full(num_experts, -1, np.int64)  # expert -> its row in the pointer tables
        self.slot[list(held)] = np.arange(len(held))
        self.gate_up = _Side([p[0] for p in held.values()])
        self.down = _Side([p[1] for p in held.values()])

    @classmethod
    def of(cls, held: dict[int, tuple], num_experts: int) -> Grouped | None:
        """For each held expert's (gate_up, down) weights, a Grouped, or None where the
        compiled call cannot take them (not int8 tiles of an IR-quantized x, formats that
        differ between experts, padded tiles, threads). Shapes may differ (--moe tp turns
        an uneven cut from expert to expert: 512 or 256 of 768 columns)."""
        if not held or not all(isinstance(w, TiledWeight) for p in held.values() for w in p):
            return None
        first = next(iter(held.values()))
        if any(_key(a) != _key(b) for p in held.values() for a, b in zip(p, first)):
            return None
        if any(w.qs.shape[0] * ROWS != w.shape[0] for p in held.values() for w in p):
            return None  # padded tiles
        biggest = [max((p[i] for p in held.values()), key=lambda w: w.qs.size) for i in (0, 1)]
        if any(b.fused is None or b.threads != 1 for b in map(Bound, biggest)):  # threads: the most work's
            return None
        return cls(held, num_experts)

    def __call__(self, x, top, w, y) -> None:
        """``y += Σ`` over the held experts of the rows routed to them (x, y [N, H], N at
        most SMALL; top, w [N, k]; an expert -1: another rank's)."""
        g, d = self.gate_up, self.down
        run(x, top, w, y, self.slot, g.ptrs, g.kernels, g.fixed, g.xe, g.out, d.ptrs, d.kernels, d.fixed, d.xe, d.out)


def _key(w: TiledWeight) -> tuple:
    """What every held expert's weight on one side must share (its shape may differ)."""
    return (w.fmt, w.digits, w.group, w.outliers, w.xs_group)


class _Side:
    """One of the two matmuls of every held expert: each expert's weight pointers and shape
    (``fixed``: the quantizer and its buffers, then T, nb, N, K a row), the kernel of each
    row count, the buffers shared by the experts (sized for the widest; each expert's rows
    laid out at its own width)."""

    def __init__(self, weights: list[TiledWeight]):
        widest = max(weights, key=lambda w: w.shape[1])
        b = Bound(widest)  # its kernels, quantizer and buffers (every expert's format is the same: _key)
        self.ptrs = np.array([[pointer(w.qs), pointer(w.d), pointer(w.m)] for w in weights], np.int64)
        self.kernels = np.array(b.at_rows, np.int64)  # by rows of x, 1..SMALL
        self.buffers = (b.xq, b.xd, b.xs)  # kept alive: the kernels write and read them by address
        self.xe = np.empty(SMALL * widest.shape[1], np.float32)  # the expert's rows of its input, gathered
        self.out = np.empty(SMALL * max(w.shape[0] for w in weights), np.float32)
        assert b.fused is not None
        q = b.fused[:5]  # quantizer, halves, xq, xd, xs
        self.fixed = np.array([[*q, w.qs.shape[0], w.shape[1] // 32, *w.shape] for w in weights], np.int64)


@njit(**EXACT)
def _matmul(xe, m, ptrs, s, kernels, fixed, out):
    """out[:m] = xe[:m] @ W_sᵀ (xe [m, K], out [m, N] of expert s's shape): x quantized into
    the side's buffers, then the kernel."""
    q, halves, xq, xd, xs, T, nb, N, K = fixed[s]
    quantizer_at(q, xe.ctypes.data, xq, xd, xs, m, K, halves)
    kernel_at(kernels[m], ptrs[s, 0], ptrs[s, 1], ptrs[s, 2], xq, xd, xs, out.ctypes.data, T, nb, m, N)


@njit(**EXACT)
def run(x, top, w, y, slot, gptrs, gkern, gfixed, gxe, gout, dptrs, dkern, dfixed, dxe, dout):
    N, k = top.shape
    E = slot.shape[0]
    chosen = np.zeros(E, np.bool_)
    for r in range(N):
        for j in range(k):
            e = top[r, j]
            if e >= 0:
                chosen[e] = True
    rows = np.empty(N, np.int64)
    wts = np.empty(N, w.dtype)
    H = x.shape[1]
    for e in range(E):
        s = slot[e]
        if not chosen[e] or s < 0:  # no row chose it, or another rank holds it
            continue
        m = 0
        for r in range(N):
            for j in range(k):
                if top[r, j] == e:
                    rows[m], wts[m] = r, w[r, j]
                    m += 1
        I2, inter = gfixed[s, 7], dfixed[s, 8]  # its gate_up's outputs, its down's inputs
        xe, gu = gxe[: m * H].reshape(m, H), gout[: m * I2].reshape(m, I2)
        act, out = dxe[: m * inter].reshape(m, inter), dout[: m * H].reshape(m, H)
        for i in range(m):
            xe[i, :] = x[rows[i], :]
        _matmul(xe, m, gptrs, s, gkern, gfixed, gu)
        swiglu(gu, act)
        _matmul(act, m, dptrs, s, dkern, dfixed, out)
        combine(y, rows[:m], out, wts[:m])


@njit(**EXACT)
def combine(y, rows, out, wt) -> None:
    """``y[rows] += out · wt[:, None]`` (rows distinct) in one pass, NumPy's bits (the product
    rounded, then the sum): a prefill's experts' outputs, where NumPy's fancy ``+=`` made a
    product, a gather and a scatter of every row (~12 ms a layer of a 512-token prompt)."""
    for i in range(rows.shape[0]):
        r, v = rows[i], wt[i]
        for c in range(y.shape[1]):
            y[r, c] += out[i, c] * v
