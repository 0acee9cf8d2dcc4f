"""Compiled ``y = x @ Wᵀ`` for weights kept as 16-bit floats (F16, BF16), two bytes a weight.

The weight is held as its bits, ``qs [N, K] uint16``; numba has no float16 type, so each
weight is widened to float32 in registers, exactly, by integer moves and a bit cast
(:mod:`.bits`)::

    bf16:  bits << 16                                  (bf16 is float32's top half)
    f16:   (sign << 16 | (bits & 0x7fff) << 13) as float32, times 2^112
           (moves the 5-bit exponent into float32's 8-bit one; subnormals come out exact)

Inf and NaN (which weights do not hold) are not kept. With x of 1-16 rows, W is walked
once: each weight is widened once and applied to four (or two, or one) rows of x while it
is in a register. More rows widen tiles of W for BLAS, as the block formats do. x stays
float32, so the result is the float32 product of the file's values up to summation order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import f32_bits, h2f

OPTS = dict(cache=True, fastmath=True, nogil=True, boundscheck=False)


@njit(**OPTS)
def _widen(h, bf16):
    """One weight's bits (as uint32) -> its float32 value."""
    if bf16:
        return f32_bits(h << 16)
    return h2f(h)


@njit(**OPTS)
def _rows1(qs, bf16, x, y, i):
    K = qs.shape[1]
    x0 = x[i]
    for n in range(qs.shape[0]):
        q = qs[n]
        s0 = np.float32(0.0)
        if bf16:  # the branch outside the loop: LLVM keeps each loop vectorized
            for k in range(K):
                s0 += _widen(np.uint32(q[k]), True) * x0[k]
        else:
            for k in range(K):
                s0 += _widen(np.uint32(q[k]), False) * x0[k]
        y[i, n] = s0


@njit(**OPTS)
def _rows2(qs, bf16, x, y, i):
    K = qs.shape[1]
    x0, x1 = x[i], x[i + 1]
    for n in range(qs.shape[0]):
        q = qs[n]
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        for k in range(K):
            w = _widen(np.uint32(q[k]), bf16)
            s0 += w * x0[k]
            s1 += w * x1[k]
        y[i, n] = s0
        y[i + 1, n] = s1


@njit(**OPTS)
def _rows4(qs, bf16, x, y, i):
    K = qs.shape[1]
    x0, x1, x2, x3 = x[i], x[i + 1], x[i + 2], x[i + 3]
    for n in range(qs.shape[0]):
        q = qs[n]
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for k in range(K):
            w = _widen(np.uint32(q[k]), bf16)
            s0 += w * x0[k]
            s1 += w * x1[k]
            s2 += w * x2[k]
            s3 += w * x3[k]
        y[i, n] = s0
        y[i + 1, n] = s1
        y[i + 2, n] = s2
        y[i + 3, n] = s3


@njit(**OPTS)
def half_small(qs, bf16, x, y):
    """y [M, N] = x [M, K] @ Wᵀ for M <= 16: rows four at a time, then two, then one."""
    M = x.shape[0]
    i = 0
    while i + 4 <= M:
        _rows4(qs, bf16, x, y, i)
        i += 4
    if i + 2 <= M:
        _rows2(qs, bf16, x, y, i)
        i += 2
    if i < M:
        _rows1(qs, bf16, x, y, i)


@njit(**OPTS)
def half_dequantize(qs, bf16, r0, r1, out):
    """Rows [r0, r1) as float32 into out [r1-r0, K]."""
    K = qs.shape[1]
    for n in range(r0, r1):
        q = qs[n]
        o = out[n - r0]
        for k in range(K):
            o[k] = _widen(np.uint32(q[k]), bf16)


@njit(**OPTS)
def half_take(qs, bf16, ids, out):
    """Embedding lookup: out[t] = row ids[t] (a negative id gives zeros)."""
    for t in range(ids.shape[0]):
        if ids[t] < 0:
            out[t, :] = 0
        else:
            half_dequantize(qs, bf16, ids[t], ids[t] + 1, out[t : t + 1])
