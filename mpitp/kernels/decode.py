"""One compiled call for the small operations of a decode step (NumPy float32, CPU).

Decoding one token per row runs ~35 NumPy operations per layer besides the matmuls, each
a few microseconds of dispatch for a few hundred numbers. These do the same arithmetic
in one call each (float32, as :mod:`mpitp.models.ops`; only the summation order
differs)::

    rms_norm   x [R, H], w [H]                                   -> x / sqrt(mean(x²) + eps) · w
    swiglu     gu [R, 2I] (gate | up)                            -> silu(gate) · up   [R, I]
    attend     qkv [B, (nh + 2·nkv)·d] of one new token per row  -> [B, nh·d]
               RoPE (rotate-half) on q and k, k and v written into the cache at column s,
               softmax(q·kᵀ·scale) over columns 0..s that ``valid`` allows, · v
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .matmul import OPTS

MASKED = np.float32(np.finfo(np.float32).min)


@njit(**OPTS)
def rms_norm(x, w, eps, out):
    R, H = x.shape
    for r in range(R):
        s = np.float32(0.0)
        for h in range(H):
            s += x[r, h] * x[r, h]
        inv = np.float32(1.0) / np.sqrt(s / np.float32(H) + np.float32(eps))
        for h in range(H):
            out[r, h] = x[r, h] * inv * w[h]


@njit(**OPTS)
def swiglu(gu, out):
    R, I2 = gu.shape
    n = I2 // 2
    for r in range(R):
        for i in range(n):
            g = gu[r, i]
            out[r, i] = g / (np.float32(1.0) + np.exp(-g)) * gu[r, n + i]


@njit(**OPTS)
def _attend_group(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, scores, acc):
    """Row b, KV head j: its new key and value into the cache, then its query heads'
    attention (``q``, ``scores``, ``acc``: scratch of d, s + 1 and d floats)."""
    d = kc.shape[3]
    half = d // 2
    g = nh // nkv
    base = (nh + j) * d  # the new key (rotated) and value into the cache
    for i in range(half):
        x0, x1 = qkv[b, base + i], qkv[b, base + half + i]
        kc[b, s, j, i] = x0 * cos[b, i] - x1 * sin[b, i]
        kc[b, s, j, half + i] = x1 * cos[b, half + i] + x0 * sin[b, half + i]
    vbase = (nh + nkv + j) * d
    for i in range(d):
        vc[b, s, j, i] = qkv[b, vbase + i]
    for h in range(j * g, (j + 1) * g):
        base = h * d
        for i in range(half):
            x0, x1 = qkv[b, base + i], qkv[b, base + half + i]
            q[i] = x0 * cos[b, i] - x1 * sin[b, i]
            q[half + i] = x1 * cos[b, half + i] + x0 * sin[b, half + i]
        top = MASKED
        for t in range(s + 1):
            if masked and not valid[b, t]:
                scores[t] = MASKED
            else:
                a = np.float32(0.0)
                for i in range(d):
                    a += q[i] * kc[b, t, j, i]
                scores[t] = a * scale
            top = max(top, scores[t])
        total = np.float32(0.0)
        for t in range(s + 1):
            scores[t] = np.exp(scores[t] - top)
            total += scores[t]
        acc[:] = 0
        for t in range(s + 1):
            if masked and not valid[b, t]:
                continue  # its weight is exactly 0 (exp of MASKED - top), unless all are masked
            p = scores[t] / total
            for i in range(d):
                acc[i] += p * vc[b, t, j, i]
        for i in range(d):
            out[b, base + i] = acc[i]


@njit(**OPTS)
def attend(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
    """``cos``/``sin`` [B, d] of each row's position; ``kc``/``vc`` [B, L, nkv, d];
    ``masked``: apply ``valid`` (else every column 0..s counts)."""
    d = kc.shape[3]
    q = np.empty(d, np.float32)
    scores = np.empty(s + 1, np.float32)
    acc = np.empty(d, np.float32)
    for b in range(qkv.shape[0]):
        for j in range(nkv):
            _attend_group(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, scores, acc)


@njit(parallel=True, nogil=True, cache=True, fastmath=True, boundscheck=False)
def attend_threads(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
    """:func:`attend` with each (row, KV head) a task of numba's thread pool (``--threads``):
    every head's arithmetic is :func:`attend`'s, so are its bits."""
    d = kc.shape[3]
    for task in prange(qkv.shape[0] * nkv):
        b = task // nkv
        j = task - b * nkv
        q = np.empty(d, np.float32)
        scores = np.empty(s + 1, np.float32)
        acc = np.empty(d, np.float32)
        _attend_group(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, scores, acc)


def warm() -> None:
    """Compile (or load from numba's cache) these now, at load time, with the argument
    types a forward passes, rather than inside the first prefill or decode step."""
    x = np.zeros((1, 4), np.float32)
    rms_norm(x, np.ones(4, np.float32), 1e-5, np.empty_like(x))
    swiglu(x, np.empty((1, 2), np.float32))
    kc, vc = np.zeros((1, 2, 1, 2), np.float32), np.zeros((1, 2, 1, 2), np.float32)
    cos, sin, out = np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32), np.empty((1, 2), np.float32)
    args = (np.zeros((1, 6), np.float32), cos, sin, kc, vc, np.ones((1, 2), bool), 0, 1, 1, np.float32(1), True, out)
    attend(*args)
    from .parallel import threads

    if threads() > 1:
        attend_threads(*args)
