"""Activations quantized once per matmul input, as ggml quantizes them (Q8_0 blocks)::

    per 32 values:  d = amax / 127,  q = round(x / d) (half away from zero),  x ≈ d·q
    and             s = d · Σ q      (what a weight's minimum multiplies: Σ (d_w q_w + m) d q)

``q`` equals the ``gguf`` package's ``quantize(x, Q8_0)`` bit for bit (its reference
rounding, ``q = roundf(x · (1/d))``). ggml then stores d as float16; here d stays float32
(the value that quantized q), so small activations keep their scale.

With two digits (``int8x2``), what one digit leaves, ``x - d·q`` (at most d/2 per value),
is quantized the same way into a second int8 row: x ≈ d₁q₁ + d₂q₂, about 15 bits, the
matmul two int8 dot products per value. It costs the decode kernels about a second row
of x, and keeps the model's outputs within ~1e-5 KL of float32 activations.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import cpu, jit
from .ir.quantize import LIMIT, OUTLIERS, TWO_DIGITS, WHOLE  # noqa: F401  (LIMIT: int8o's rule, read by tests)

# no fastmath: x · (1/d) must round as the reference does, not become x / d
EXACT = dict(cache=True, nogil=True, boundscheck=False)


@njit(**EXACT)
def _block(v, q):
    """32 floats -> 32 int8 in ``q``; returns (d, Σq)."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(v[j]))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    total = 0
    for j in range(32):
        t = v[j] * inv
        a = abs(t)
        f = np.floor(a)
        r = f + np.floor(np.float32(2.0) * (a - f))  # gguf's np_roundf: half away from zero
        qi = np.int32(r) if t >= 0 else -np.int32(r)
        q[j] = qi
        total += qi
    return d, total


@njit(**EXACT)
def _sums(q, lo, d, xs, row, b, halves):
    """xs[row, b] = d·Σ q[lo:lo+32], or with ``halves`` xs[row, 2b + h] = d·Σ of each 16
    (Q6_K's scales are per 16: its minimum term multiplies per-16 sums)."""
    if not halves:
        return
    for h in range(2):
        t = 0
        for j in range(16):
            t += q[lo + 16 * h + j]
        xs[row, 2 * b + h] += d * np.float32(t)


@njit(**EXACT)
def quantize_rows(x, xq, xd, xs):
    """x [M, K] float32 -> xq [≥M, K] int8, xd [≥M, K/32] and xs [≥M, K/32] float32 (rows
    < M); xs [≥M, K/16] holds the sums per 16 instead."""
    M, K = x.shape
    halves = xs.shape[1] != K // 32
    for i in range(M):
        for b in range(K // 32):
            d, total = _block(x[i, 32 * b : 32 * b + 32], xq[i, 32 * b : 32 * b + 32])
            xd[i, b] = d
            if halves:
                xs[i, 2 * b] = xs[i, 2 * b + 1] = 0
                _sums(xq[i], 32 * b, d, xs, i, b, halves)
            else:
                xs[i, b] = d * np.float32(total)


def outlier_quantizer(isa: str | None = None):
    """``bind(xq, xd, xs)`` -> ``f(x)``: x quantized into those buffers by int8o's compiled
    quantizer (for ``isa``: its target CPU), bound once, so that a decode step's call costs
    x's pointer and one ctypes call."""
    return _binder(OUTLIERS, isa)


def two_digit_quantizer(isa: str | None = None, whole: bool = False):
    """As :func:`outlier_quantizer`, int8x2's two digits (:func:`quantize_rows2`; ``whole``:
    each digit's scale shared by a super-block of 256)."""
    return _binder(WHOLE if whole else TWO_DIGITS, isa)


def _binder(name: str, isa: str | None):
    fn = jit.quantizer(isa or cpu.isa(), name)

    def bind(xq: np.ndarray, xd: np.ndarray, xs: np.ndarray):
        K = xq.shape[1]
        if name == WHOLE and K % 256:
            raise ValueError(f"x's scales per 256 need K a multiple of 256, not {K}")
        fixed = (xq.ctypes.data, xd.ctypes.data, xs.ctypes.data)
        halves = int(xs.shape[1] != K // 32)

        rows = min(xq.shape[0], xd.shape[0], xs.shape[0]) // 2

        def f(x: np.ndarray) -> None:
            if x.dtype != np.float32 or not x.flags.c_contiguous:
                x = np.ascontiguousarray(x, np.float32)
            M, k = x.shape
            if k != K or M > rows:
                raise ValueError(f"x {x.shape} does not fit the buffers xq {xq.shape}, xd {xd.shape}, xs {xs.shape}")
            if M:
                fn(jit.address(x), *fixed, M, K, halves)

        return f

    return bind


def quantize_rows2(x, xq, xd, xs, isa: str | None = None, whole: bool = False) -> None:
    """Two digits: row i of x -> xq rows 2i (x's blocks as one digit quantizes them) and
    2i+1 (what is left, x - d·q in float32, quantized the same way); xd the two digits'
    scales, xs[2i] the sum over both digits (per 32, or per 16 where xs has K/16 columns).
    ``whole``: each digit's scale that of its super-block of 256 values (the largest of its
    8 blocks' amax / 127; xd still a scale a block, the 8 equal), as ggml's Q8_K: what the
    avx2 K-quant prefill kernels multiply. Compiled from IR (:mod:`.ir.quantize`): xq, xd
    and xs C-contiguous."""
    _check(xq, xd, xs)
    two_digit_quantizer(isa, whole)(xq, xd, xs)(x)


def _check(*buffers) -> None:
    for a in buffers:
        if not a.flags.c_contiguous:
            raise ValueError("the two-row quantizers write C-contiguous buffers only")


def quantize_rows_outliers(x, xq, xd, xs, isa: str | None = None) -> None:
    """One digit and x's outliers (``int8o``), as LLM.int8() splits them off: in each block
    of 32, the values above LIMIT × the root mean square of the block's other 31 (its
    largest left out) go to xq row 2i+1, quantized in their own block (a block without one
    is all zero, d = 0), the rest to row 2i, quantized as one digit is. An outlier then no
    longer sets d for the other 31 values of its block. The rule looks at one block only,
    so a tensor-parallel cut (on block boundaries) quantizes x as one rank does; xs[2i] =
    the sum over both rows. Compiled from IR (:mod:`.ir.quantize`): xq, xd and xs
    C-contiguous as laid out above."""
    _check(xq, xd, xs)
    outlier_quantizer(isa)(xq, xd, xs)(x)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, d, s) of a float32 [M, K] (K a multiple of 32)."""
    x = np.ascontiguousarray(x, np.float32)
    M, K = x.shape
    q = np.empty((M, K), np.int8)
    d = np.empty((M, K // 32), np.float32)
    s = np.empty_like(d)
    quantize_rows(x, q, d, s)
    return q, d, s
