"""Compiled ``y = x @ Wᵀ`` for weights kept as 16-bit floats (F16, BF16), two bytes a weight.

The weight is held as its bits, ``qs [N, K] uint16``; numba has no float16 type, so a row
is widened to float32 in a scratch row (in L1) by integer moves alone, exactly::

    bf16:  bits << 16                                  (bf16 is float32's top half)
    f16:   (sign << 16 | (bits & 0x7fff) << 13) as float32, times 2^112
           (moves the 5-bit exponent into float32's 8-bit one; subnormals come out exact)

Inf and NaN (which weights do not hold) are not kept. With x of 1-16 rows, each weight
row is widened once and applied to every row of x while it is in cache; more rows widen
tiles of W for BLAS, as the block formats do. x stays float32, so the result is the
float32 product of the file's values up to summation order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

SCALE = np.float32(2.0**112)
OPTS = dict(cache=True, fastmath=True, nogil=True, boundscheck=False)


@njit(**OPTS)
def widen(qs, n, bf16, bits, row):
    """Row ``n`` of ``qs`` as float32 into ``row`` (``bits`` is ``row`` viewed as uint32)."""
    q = qs[n]  # 1-D views: loops LLVM vectorizes
    K = q.shape[0]
    if bf16:
        for k in range(K):
            bits[k] = np.uint32(q[k]) << 16
    else:
        for k in range(K):
            h = np.uint32(q[k])
            bits[k] = ((h & np.uint32(0x8000)) << 16) | ((h & np.uint32(0x7FFF)) << 13)
        for k in range(K):
            row[k] = row[k] * SCALE


@njit(**OPTS)
def half_small(qs, bf16, x, y):
    """y [M, N] = x [M, K] @ Wᵀ: each row of W widened once, then dotted with every row of x."""
    M, K = x.shape
    bits = np.empty(K, np.uint32)
    row = bits.view(np.float32)
    for n in range(qs.shape[0]):
        widen(qs, n, bf16, bits, row)
        for i in range(M):
            xi = x[i]
            s = np.float32(0.0)
            for k in range(K):
                s += row[k] * xi[k]
            y[i, n] = s


@njit(**OPTS)
def half_dequantize(qs, bf16, r0, r1, out):
    """Rows [r0, r1) as float32 into out [r1-r0, K]."""
    K = qs.shape[1]
    bits = np.empty(K, np.uint32)
    row = bits.view(np.float32)
    for n in range(r0, r1):
        widen(qs, n, bf16, bits, row)
        out[n - r0, :] = row


@njit(**OPTS)
def half_take(qs, bf16, ids, out):
    """Embedding lookup: out[t] = row ids[t] (a negative id gives zeros)."""
    for t in range(ids.shape[0]):
        if ids[t] < 0:
            out[t, :] = 0
        else:
            half_dequantize(qs, bf16, ids[t], ids[t] + 1, out[t : t + 1])
