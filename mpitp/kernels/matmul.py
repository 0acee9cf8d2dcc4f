"""Compiled ``y = x @ Wᵀ`` for weights kept in their block formats (numba, one thread).

A weight ``[N, K]`` is held *planar* (:mod:`mpitp.kernels.formats`): the quants of all
rows in one array and the per-block scale (and minimum) as float32 beside it::

    q4:  qs [N, K/2] uint8   byte j of block b = weight 32b+j (low nibble), 32b+16+j (high)
         d, m [N, K/32]      w = d·q + m          (Q4_0 is the case m = -8d)
    q8:  qs [N, K] int8
         d [N, K/32]         w = d·q

Decoding (few rows of x, ``M <= SMALL``) walks W once, row by row. With one row of x, one
running sum per output row over the whole row, the block's scale broadcast inside it
(x split once per call into the halves each nibble multiplies), the minimum term by
per-block sums of x. With 2-16 rows, each weight row is decoded once into float32 in L1
and applied to every row of x, two at a time. x stays float32: the result is the
dequantized float32 product up to summation order. Prefill (more rows) dequantizes
tiles of W and hands them to BLAS.
"""

from __future__ import annotations

import numpy as np
from numba import njit

SMALL = 16  # rows of x up to which the decode kernels run; above, tiles + BLAS
TILE = 2048  # weight rows dequantized per BLAS call in prefill
LO, SH = np.uint8(15), np.uint8(4)  # uint8 nibbles convert to float32 in vector registers
OPTS = dict(cache=True, fastmath=True, nogil=True, boundscheck=False)


@njit(**OPTS)
def _split_x(x, xlo, xhi, xsum):
    """x [M, K] -> its block halves [M, K/2] (what the low and high nibbles multiply) and
    per-block sums [M, K/32]."""
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


@njit(**OPTS)
def _q4_rows1(qs, d, m, xlo, xhi, xsum, y):
    N, H = qs.shape
    B = d.shape[1]
    for n in range(N):
        s = np.float32(0.0)
        for k in range(H):
            q = qs[n, k]
            s += d[n, k >> 4] * (np.float32(q & LO) * xlo[0, k] + np.float32(q >> SH) * xhi[0, k])
        t = np.float32(0.0)
        for b in range(B):
            t += m[n, b] * xsum[0, b]
        y[0, n] = s + t


@njit(**OPTS)
def _q4_rowsM(qs, d, m, xlo, xhi, y):
    N, H = qs.shape
    M = xlo.shape[0]
    wl = np.empty(H, np.float32)
    wh = np.empty(H, np.float32)
    for n in range(N):
        for k in range(H):  # decode the row once
            q = qs[n, k]
            sc, mn = d[n, k >> 4], m[n, k >> 4]
            wl[k] = sc * np.float32(q & LO) + mn
            wh[k] = sc * np.float32(q >> SH) + mn
        i = 0
        while i + 1 < M:  # two rows of x share each load of the decoded weights
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for k in range(H):
                a, b = wl[k], wh[k]
                s0 += a * xlo[i, k] + b * xhi[i, k]
                s1 += a * xlo[i + 1, k] + b * xhi[i + 1, k]
            y[i, n] = s0
            y[i + 1, n] = s1
            i += 2
        if i < M:
            s0 = np.float32(0.0)
            for k in range(H):
                s0 += wl[k] * xlo[i, k] + wh[k] * xhi[i, k]
            y[i, n] = s0


@njit(**OPTS)
def _q8_rows1(qs, d, x, y):
    N, K = qs.shape
    for n in range(N):
        s = np.float32(0.0)
        for k in range(K):
            s += d[n, k >> 5] * (np.float32(qs[n, k]) * x[0, k])
        y[0, n] = s


@njit(**OPTS)
def _q8_rowsM(qs, d, x, y):
    N, K = qs.shape
    M = x.shape[0]
    w = np.empty(K, np.float32)
    for n in range(N):
        for k in range(K):
            w[k] = d[n, k >> 5] * np.float32(qs[n, k])
        i = 0
        while i + 1 < M:
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for k in range(K):
                a = w[k]
                s0 += a * x[i, k]
                s1 += a * x[i + 1, k]
            y[i, n] = s0
            y[i + 1, n] = s1
            i += 2
        if i < M:
            s0 = np.float32(0.0)
            for k in range(K):
                s0 += w[k] * x[i, k]
            y[i, n] = s0


@njit(**OPTS)
def q4_dequantize(qs, d, m, r0, r1, out):
    """Rows [r0, r1) of a q4 weight -> out [r1-r0, K] float32."""
    H = qs.shape[1]
    for n in range(r0, r1):
        for k in range(H):
            q = qs[n, k]
            b = k >> 4
            j = 32 * b + (k & 15)
            out[n - r0, j] = d[n, b] * np.float32(q & LO) + m[n, b]
            out[n - r0, j + 16] = d[n, b] * np.float32(q >> SH) + m[n, b]


@njit(**OPTS)
def q8_dequantize(qs, d, r0, r1, out):
    K = qs.shape[1]
    for n in range(r0, r1):
        for k in range(K):
            out[n - r0, k] = d[n, k >> 5] * np.float32(qs[n, k])


@njit(**OPTS)
def q4_take(qs, d, m, ids, out):
    """Embedding lookup: out[t] = row ids[t] of a q4 weight (a negative id gives zeros)."""
    H = qs.shape[1]
    for t in range(ids.shape[0]):
        n = ids[t]
        if n < 0:
            out[t, :] = 0
            continue
        for k in range(H):
            q = qs[n, k]
            b = k >> 4
            j = 32 * b + (k & 15)
            out[t, j] = d[n, b] * np.float32(q & LO) + m[n, b]
            out[t, j + 16] = d[n, b] * np.float32(q >> SH) + m[n, b]


@njit(**OPTS)
def q8_take(qs, d, ids, out):
    K = qs.shape[1]
    for t in range(ids.shape[0]):
        n = ids[t]
        if n < 0:
            out[t, :] = 0
            continue
        for k in range(K):
            out[t, k] = d[n, k >> 5] * np.float32(qs[n, k])


def dequantize_rows(w, r0: int, r1: int) -> np.ndarray:
    out = np.empty((r1 - r0, w.shape[1]), np.float32)
    if w.kind == "q4":
        q4_dequantize(w.qs, w.d, w.m, r0, r1, out)
    else:
        q8_dequantize(w.qs, w.d, r0, r1, out)
    return out


def take(w, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (1-D int64; -1 for a zero row) of ``w`` as float32 [len(ids), K]."""
    out = np.empty((ids.shape[0], w.shape[1]), np.float32)
    if w.kind == "q4":
        q4_take(w.qs, w.d, w.m, ids, out)
    else:
        q8_take(w.qs, w.d, ids, out)
    return out


def matmul(x: np.ndarray, w) -> np.ndarray:
    """``x [..., K] @ w.T`` -> float32 [..., N] for a planar weight ``w`` [N, K]."""
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)
    M = x2.shape[0]
    N = w.shape[0]
    if M > SMALL:
        y = np.empty((M, N), np.float32)
        for r0 in range(0, N, TILE):
            r1 = min(N, r0 + TILE)
            np.matmul(x2, dequantize_rows(w, r0, r1).T, out=y[:, r0:r1])
        return y.reshape(*lead, N)
    y = np.empty((M, N), np.float32)
    if w.kind == "q4":
        K = x2.shape[1]
        xlo = np.empty((M, K // 2), np.float32)
        xhi = np.empty((M, K // 2), np.float32)
        xsum = np.empty((M, K // 32), np.float32)
        _split_x(x2, xlo, xhi, xsum)
        if M == 1:
            _q4_rows1(w.qs, w.d, w.m, xlo, xhi, xsum, y)
        else:
            _q4_rowsM(w.qs, w.d, w.m, xlo, xhi, y)
    elif M == 1:
        _q8_rows1(w.qs, w.d, x2, y)
    else:
        _q8_rowsM(w.qs, w.d, x2, y)
    return y.reshape(*lead, N)
