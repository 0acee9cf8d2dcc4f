"""Float32 activations times planar block weights (numba, one thread): ``y = x @ Wᵀ``.

A weight ``[N, K]`` is held *planar* (:mod:`mpitp.kernels.formats`): the quants of all
rows in one array and the per-block scale (and minimum) as float32 beside it::

    q4:  qs [N, K/2] uint8   byte j of block b = weight 32b+j (low nibble), 32b+16+j (high)
         d, m [N, K/32]      w = d·q + m          (Q4_0 is the case m = -8d)
    q8:  qs [N, K] int8
         d [N, K/32]         w = d·q   (or [N, K/16]: Q6_K's scale per 16)

Decoding (few rows of x, ``M <= SMALL``) walks W once, row by row. With one row of x, one
running sum per output row over the whole row, the block's scale broadcast inside it
(x split once per call into the halves each nibble multiplies), the minimum term by
per-block sums of x. With 2-16 rows, each weight is decoded once in registers (d·q + m)
and applied to four (or two) rows of x at a time. x stays float32: the result is the
dequantized float32 product up to summation order. Prefill (more rows) dequantizes
tiles of W and hands them to BLAS. 16-bit float weights (F16, BF16) have their own
kernels in :mod:`.half`.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from numba import njit

from .weights.dequant import OPTS, SIXTEEN, SIXTEENTH, dequantize_rows, q4_dequantize, q4_take, q8_dequantize, q8_take

SMALL = 16  # rows of x up to which the decode kernels run; above, tiles + BLAS
HALF_SMALL = 8  # the same for 16-bit floats (docs/measurements.md: at 16 rows BLAS wins)
TILE = 2048  # weight rows dequantized per BLAS call in prefill


@njit(**OPTS)
def _split_x(x, xlo, xhi, xsum):
    """x [M, K] -> its block halves [M', K/2] (what the low and high nibbles multiply; rows
    M..M' stay zero) and per-block sums [M, K/32]."""
    M, K = x.shape
    for i in range(M):
        for b in range(K // 32):
            s = np.float32(0.0)
            for j in range(16):
                lo = x[i, 32 * b + j]
                hi = x[i, 32 * b + 16 + j]
                xlo[i, 16 * b + j] = lo
                xhi[i, 16 * b + j] = hi
                s += lo + hi
            xsum[i, b] = s


# A byte q holds two 4-bit weights. Integer shifts of numba's uint8 widen to 64-bit lanes
# (half the vector width); in float32 the split is exact and stays in 8-wide lanes:
#     hi = floor(q / 16),  lo = q - 16·hi


@njit(**OPTS)
def _q4_rows1(qs, d, m, xlo, xhi, xsum, y):
    """One row of x: y[n] = Σ_k d[n, k/16]·(lo·xlo[k] + hi·xhi[k]) + Σ_b m[n, b]·xsum[b]."""
    N, H = qs.shape
    B = d.shape[1]
    for n in range(N):
        s = np.float32(0.0)
        for k in range(H):
            qf = np.float32(qs[n, k])
            hi = np.floor(qf * SIXTEENTH)
            lo = qf - SIXTEEN * hi
            s += d[n, k >> 4] * (lo * xlo[0, k] + hi * xhi[0, k])
        t = np.float32(0.0)
        for b in range(B):
            t += m[n, b] * xsum[0, b]
        y[0, n] = s + t


@njit(**OPTS)
def _q4_rows2(qs, d, m, xlo, xhi, y, i):
    """Rows i, i+1 of x: each weight decoded once (d·q + m, in registers) for both."""
    N, H = qs.shape
    for n in range(N):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        for k in range(H):
            qf = np.float32(qs[n, k])
            hi = np.floor(qf * SIXTEENTH)
            lo = qf - SIXTEEN * hi
            sc, mn = d[n, k >> 4], m[n, k >> 4]
            a, b = sc * lo + mn, sc * hi + mn
            s0 += a * xlo[i, k] + b * xhi[i, k]
            s1 += a * xlo[i + 1, k] + b * xhi[i + 1, k]
        y[i, n] = s0
        y[i + 1, n] = s1


@njit(**OPTS)
def _q4_rows4(qs, d, m, xlo, xhi, y, i):
    """Rows i..i+3 of x, each weight decoded once for the four."""
    N, H = qs.shape
    for n in range(N):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for k in range(H):
            qf = np.float32(qs[n, k])
            hi = np.floor(qf * SIXTEENTH)
            lo = qf - SIXTEEN * hi
            sc, mn = d[n, k >> 4], m[n, k >> 4]
            a, b = sc * lo + mn, sc * hi + mn
            s0 += a * xlo[i, k] + b * xhi[i, k]
            s1 += a * xlo[i + 1, k] + b * xhi[i + 1, k]
            s2 += a * xlo[i + 2, k] + b * xhi[i + 2, k]
            s3 += a * xlo[i + 3, k] + b * xhi[i + 3, k]
        y[i, n] = s0
        y[i + 1, n] = s1
        y[i + 2, n] = s2
        y[i + 3, n] = s3


@njit(**OPTS)
def _q8_rows1(qs, d, sh, x, y):
    N, K = qs.shape
    for n in range(N):
        s = np.float32(0.0)
        for k in range(K):
            s += d[n, k >> sh] * (np.float32(qs[n, k]) * x[0, k])
        y[0, n] = s


@njit(**OPTS)
def _q8_rows2(qs, d, sh, x, y, i):
    N, K = qs.shape
    for n in range(N):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        for k in range(K):
            a = d[n, k >> sh] * np.float32(qs[n, k])
            s0 += a * x[i, k]
            s1 += a * x[i + 1, k]
        y[i, n] = s0
        y[i + 1, n] = s1


@njit(**OPTS)
def _q8_rows4(qs, d, sh, x, y, i):
    N, K = qs.shape
    for n in range(N):
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for k in range(K):
            a = d[n, k >> sh] * np.float32(qs[n, k])
            s0 += a * x[i, k]
            s1 += a * x[i + 1, k]
            s2 += a * x[i + 2, k]
            s3 += a * x[i + 3, k]
        y[i, n] = s0
        y[i + 1, n] = s1
        y[i + 2, n] = s2
        y[i + 3, n] = s3


@njit(**OPTS)
def q4_small(qs, d, m, x, y):
    """y [M, N] = x [M, K] @ Wᵀ for M <= SMALL: one row alone, else rows four and two at a
    time (an odd count gets a zero row). One call from Python: numba's dispatch costs
    microseconds per call and argument, and a decode step makes ~120 of these calls."""
    M, K = x.shape
    P = M + (M > 1 and M % 2)
    xlo = np.zeros((P, K // 2), np.float32)
    xhi = np.zeros((P, K // 2), np.float32)
    xsum = np.empty((M, K // 32), np.float32)
    _split_x(x, xlo, xhi, xsum)
    if M == 1:
        _q4_rows1(qs, d, m, xlo, xhi, xsum, y)
        return
    yp = np.empty((P, y.shape[1]), np.float32) if P > M else y
    for i in range(0, P - P % 4, 4):
        _q4_rows4(qs, d, m, xlo, xhi, yp, i)
    if P % 4:
        _q4_rows2(qs, d, m, xlo, xhi, yp, P - 2)
    if P > M:
        y[:, :] = yp[:M]


@njit(**OPTS)
def q8_small(qs, d, x, y):
    M, K = x.shape
    sh = 5 if d.shape[1] * 32 == K else 4  # a scale per 32 weights, or per 16
    if M == 1:
        _q8_rows1(qs, d, sh, x, y)
        return
    P = M + M % 2
    xp = x
    if P > M:
        xp = np.zeros((P, K), np.float32)
        xp[:M] = x
    yp = np.empty((P, y.shape[1]), np.float32) if P > M else y
    for i in range(0, P - P % 4, 4):
        _q8_rows4(qs, d, sh, xp, yp, i)
    if P % 4:
        _q8_rows2(qs, d, sh, xp, yp, P - 2)
    if P > M:
        y[:, :] = yp[:M]


def warm(kind: str) -> None:
    """Compile (or load from numba's cache) the kernels of one kind now, at load time,
    rather than inside the first forward."""
    if kind in ("f16", "bf16"):
        from . import half

        h = np.zeros((1, 32), np.uint16)
        for M in (1, 2):
            half.half_small(h, kind == "bf16", np.zeros((M, 32), np.float32), np.empty((M, 1), np.float32))
        half.half_dequantize(h, kind == "bf16", 0, 1, np.empty((1, 32), np.float32))
        half.half_take(h, kind == "bf16", np.zeros(1, np.int64), np.empty((1, 32), np.float32))
        return
    qs = np.zeros((1, 16 if kind == "q4" else 32), np.uint8 if kind == "q4" else np.int8)
    d = np.zeros((1, 1), np.float32)
    for M in (1, 2, 3, 4, 5):
        x, y = np.zeros((M, 32), np.float32), np.empty((M, 1), np.float32)
        q4_small(qs, d, d, x, y) if kind == "q4" else q8_small(qs, d, x, y)
    out = np.empty((1, 32), np.float32)
    if kind == "q4":
        q4_dequantize(qs, d, d, 0, 1, out)
        q4_take(qs, d, d, np.zeros(1, np.int64), out)
    else:
        q8_dequantize(qs, d, 0, 1, out)
        q8_take(qs, d, np.zeros(1, np.int64), out)


def bind(w):
    """``(f, rows)`` for a planar weight: ``f(x, y)`` with the kernel of its kind."""
    if w.kind in ("f16", "bf16"):
        from .half import half_small

        return partial(half_small, w.qs, w.kind == "bf16"), HALF_SMALL
    if w.kind == "q4":
        return partial(q4_small, w.qs, w.d, w.m), SMALL
    return partial(q8_small, w.qs, w.d), SMALL


def matmul(x2: np.ndarray, w) -> np.ndarray:
    """float32 [M, K] C-contiguous @ w.T -> [M, N] for a planar weight: the decode kernels up
    to SMALL rows (HALF_SMALL for 16-bit floats), else dequantized tiles of W through BLAS."""
    N = w.shape[0]
    M = x2.shape[0]
    y = np.empty((M, N), np.float32)
    half = w.kind in ("f16", "bf16")
    if M > (HALF_SMALL if half else SMALL):
        for r0 in range(0, N, TILE):
            r1 = min(N, r0 + TILE)
            np.matmul(x2, dequantize_rows(w, r0, r1).T, out=y[:, r0:r1])
    elif half:
        from .half import half_small

        half_small(w.qs, w.kind == "bf16", x2, y)
    elif w.kind == "q4":
        q4_small(w.qs, w.d, w.m, x2, y)
    else:
        q8_small(w.qs, w.d, x2, y)
    return y
