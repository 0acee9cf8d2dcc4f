"""A decode step's half layers, each one compiled call between two all-reduces.

Bound one op at a time (:mod:`mpitp.models.decode_step`), a layer makes ~16 calls from
Python (norms, two quantize-and-multiply calls, attention, swiglu, biases, residual adds,
buffers), ~1-4 µs of dispatch each. Here everything between two all-reduces is one call::

    attention_half:  h += r (+b) ─ rms_norm ─ qkv (+b) ─ RoPE, K/V into the cache, attention ─ o  -> out
    mlp_half:        h += r (+b) ─ rms_norm ─ gate_up (+b) ─ swiglu ─ down                        -> out

where ``r`` is the previous half's all-reduced output (``add``: 0 none, 1 r, 2 r + its bias,
rounded as ``r += b; h += r``). The same kernels on the same arrays in the same order as
the loop of single calls, so the same bits. A matmul travels as its :func:`plan`: per
piece of the weight (one, or one per format: :class:`mpitp.kernels.matmul.Pieces`) an
int64 row of the kernel's address for each row count, then the quantizer's, every pointer
and size the int8 kernels take (:class:`mpitp.kernels.int8.Bound`) and the piece's first
column of y, which its kernel writes in place (row stride: y's).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .calls import kernel_at, quantizer_at
from .decode import attend_core, attend_core_threads, rms_norm, swiglu
from .int8 import SMALL, Bound
from .matmul import Pieces
from .parallel import tile_ranges

# A plan row, one per piece of a weight: columns 0..16 the kernel's address for that many
# rows of x, then these (numba reads them as constants: the same code as raw offsets)
(QUANTIZER, HALVES, XQ, XD, XS, QS, D, MIN, TILES, BLOCKS, COLUMN, QS_STEP, D_STEP, MIN_STEP, THREADS) = range(
    SMALL + 1, SMALL + 16
)  # the quantizer's address and its sums' layout; x's buffers; the weight's arrays, its tiles
# and blocks a row; the piece's first column of y; bytes a tile advances qs, d and m; threads
PLAN = SMALL + 16


def plan(bound) -> np.ndarray | None:
    """The plan [pieces, PLAN] of a bound matmul, or None where it cannot run here: planar
    blocks or float32 weights, output rows padded to whole tiles, or x quantized by numba's
    one-digit quantizer."""
    parts, spans = (bound.parts, bound.spans) if type(bound) is Pieces else ([bound], [(0, 0)])
    rows = []
    for f, (a, _) in zip(parts, spans):
        if type(f) is not Bound or f.fused is None or f.pad is not None:
            return None
        rows.append([*f.at_rows, *f.fused, f.T, f.nb, a, *f.tile_bytes, f.threads])
        assert len(rows[-1]) == PLAN
    return np.array(rows, np.int64)


@njit(nogil=True, cache=True)
def _matmul(plan, x, y):
    M, K = x.shape
    for p in plan:  # each piece: x quantized for its kernel, which writes its columns of y
        quantizer_at(p[QUANTIZER], x.ctypes.data, p[XQ], p[XD], p[XS], M, K, p[HALVES])
        at = y.ctypes.data + p[COLUMN] * 4
        if p[THREADS] > 1:  # its tiles in that many ranges over numba's pool
            tile_ranges(p[M], p[THREADS], p[QS], p[D], p[MIN], p[XQ], p[XD], p[XS], at, p[TILES], p[BLOCKS], M,
                        y.shape[1], p[QS_STEP], p[D_STEP], p[MIN_STEP])  # fmt: skip
        else:
            kernel_at(p[M], p[QS], p[D], p[MIN], p[XQ], p[XD], p[XS], at, p[TILES], p[BLOCKS], M, y.shape[1])


@njit(nogil=True, cache=True)
def _residual(h, r, rb, add):
    if add == 0:
        return
    B, H = h.shape
    for i in range(B):
        for j in range(H):
            h[i, j] += (r[i, j] + rb[j]) if add == 2 else r[i, j]


@njit(nogil=True, cache=True)
def _bias(y, b, on):
    if on:
        for i in range(y.shape[0]):
            for j in range(y.shape[1]):
                y[i, j] += b[j]


@njit(nogil=True, cache=True)
def attention_half(h, r, rb, add, layer, heads, step, xn, y, att, out):
    """``h += r``; then the attention block of one layer into ``out`` (this rank's partial
    sums of o, before the all-reduce). Its arguments come in three records:

        layer  (w, eps, pq, yb, qb, po)   the norm's weight and eps, qkv's plan, its bias (and
                                          whether there is one), o's plan
        heads  (core, nh, nkv, d, scale, threads)   attention's IR core (an address), the
                                          query and KV heads, head dim, scale, threads: its
                                          (row, KV head) pairs over numba's pool
        step   (cos, sin, cache, valid, s, masked)   this step's RoPE rows, the cache's
                                          pointers, its valid columns, length and mask
    """
    w, eps, pq, yb, qb, po = layer
    core, nh, nkv, d, scale, threads = heads
    cos, sin, cache, valid, s, masked = step
    _residual(h, r, rb, add)
    rms_norm(h, w, eps, xn)
    _matmul(pq, xn, y)
    _bias(y, yb, qb)
    if threads:
        attend_core_threads(core, y, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, att)
    else:
        attend_core(core, y, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, att)
    _matmul(po, att, out)


@njit(nogil=True, cache=True)
def mlp_half(h, r, rb, add, w, eps, xn, pgu, g, gb, gbias, act, pd, out):
    """``h += r``; then the MLP block of one layer into ``out`` (partial sums of down)."""
    _residual(h, r, rb, add)
    rms_norm(h, w, eps, xn)
    _matmul(pgu, xn, g)
    _bias(g, gb, gbias)
    swiglu(g, act)
    _matmul(pd, act, out)
