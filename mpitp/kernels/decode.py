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

attend's scores, softmax and sum over values run in an IR core (:mod:`.attend_ir`, one
call per row and KV head: its query heads in registers while the cache streams past
once) where the head dimension is a multiple of 16 and the arrays are C-contiguous; else
in numba's loops here (:func:`_attend_group`).
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit, prange

from . import cpu, jit
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


# exp(x) = 2^k · p(r), k = round(x·log2 e), r = x - k·ln 2 (Cephes' expf; relative error
# ~2e-7, as libm's): a polynomial LLVM vectorizes, where np.exp is a call per value
LOG2E, LN2HI, LN2LO = np.float32(1.44269504088896341), np.float32(0.693359375), np.float32(-2.12194440e-4)


@njit(**OPTS)
def swiglu(gu, out):
    R, I2 = gu.shape
    n = I2 // 2
    bits = np.empty(n, np.int32)
    two_k = bits.view(np.float32)
    for r in range(R):
        for i in range(n):  # p(r) into out, 2^k's bits into two_k, of x = -gate
            x = min(max(-gu[r, i], np.float32(-87.0)), np.float32(88.0))
            k = np.floor(x * LOG2E + np.float32(0.5))
            t = x - k * LN2HI - k * LN2LO
            p = np.float32(1.9875691500e-4)
            p = p * t + np.float32(1.3981999507e-3)
            p = p * t + np.float32(8.3334519073e-3)
            p = p * t + np.float32(4.1665795894e-2)
            p = p * t + np.float32(1.6666665459e-1)
            p = p * t + np.float32(0.5)
            out[r, i] = p * t * t + t + np.float32(1.0)
            bits[i] = (np.int32(k) + np.int32(127)) << 23
        for i in range(n):  # silu(gate) · up = gate / (1 + exp(-gate)) · up
            out[r, i] = gu[r, i] / (np.float32(1.0) + out[r, i] * two_k[i]) * gu[r, n + i]


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
def attend_loops(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
    """:func:`attend` in numba's loops throughout (any head dimension, any strides)."""
    d = kc.shape[3]
    q = np.empty(d, np.float32)
    scores = np.empty(s + 1, np.float32)
    acc = np.empty(d, np.float32)
    for b in range(qkv.shape[0]):
        for j in range(nkv):
            _attend_group(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, scores, acc)


@njit(parallel=True, nogil=True, cache=True, fastmath=True, boundscheck=False)
def attend_loops_threads(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
    """:func:`attend_loops` with each (row, KV head) a task of numba's thread pool."""
    d = kc.shape[3]
    for task in prange(qkv.shape[0] * nkv):
        b = task // nkv
        j = task - b * nkv
        q = np.empty(d, np.float32)
        scores = np.empty(s + 1, np.float32)
        acc = np.empty(d, np.float32)
        _attend_group(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, scores, acc)


@njit(**OPTS)
def _rope_group(qkv, cos, sin, kc, vc, s, nh, nkv, scale, b, j, q):
    """Row b, KV head j: its new key (rotated) and value into the cache at column s, and
    its query heads rotated, times ``scale``, into ``q`` [G, d]."""
    d = kc.shape[3]
    half = d // 2
    g = nh // nkv
    base = (nh + j) * d
    for i in range(half):
        x0, x1 = qkv[b, base + i], qkv[b, base + half + i]
        kc[b, s, j, i] = x0 * cos[b, i] - x1 * sin[b, i]
        kc[b, s, j, half + i] = x1 * cos[b, half + i] + x0 * sin[b, half + i]
    vbase = (nh + nkv + j) * d
    for i in range(d):
        vc[b, s, j, i] = qkv[b, vbase + i]
    for hh in range(g):
        base = (j * g + hh) * d
        for i in range(half):
            x0, x1 = qkv[b, base + i], qkv[b, base + half + i]
            q[hh, i] = (x0 * cos[b, i] - x1 * sin[b, i]) * scale
            q[hh, half + i] = (x1 * cos[b, half + i] + x0 * sin[b, half + i]) * scale


@njit(**OPTS)
def _core_group(core, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, sc):
    """Row b, KV head j through the IR core (``q``, ``sc``: scratch of [G, d] and G·S16 floats)."""
    _rope_group(qkv, cos, sin, kc, vc, s, nh, nkv, scale, b, j, q)
    L, d = kc.shape[1], kc.shape[3]
    at = (b * L * nkv + j) * d * 4  # bytes to [b, 0, j, 0] of the cache
    o = (b * out.shape[1] + j * (nh // nkv) * d) * 4
    core(q.ctypes.data, kc.ctypes.data + at, vc.ctypes.data + at, valid.ctypes.data + b * valid.shape[1],
         out.ctypes.data + o, sc.ctypes.data, s + 1, nkv * d, 1 if masked else 0)  # fmt: skip


@njit(**OPTS)
def _attend_core(core, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
    d, g = kc.shape[3], nh // nkv
    q = np.empty((g, d), np.float32)
    sc = np.empty(g * ((s + 16) // 16 * 16), np.float32)
    for b in range(qkv.shape[0]):
        for j in range(nkv):
            _core_group(core, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, j, q, sc)


@njit(parallel=True, nogil=True, cache=True, fastmath=True, boundscheck=False)
def _attend_core_threads(core, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
    d, g = kc.shape[3], nh // nkv
    for task in prange(qkv.shape[0] * nkv):
        b = task // nkv
        q = np.empty((g, d), np.float32)
        sc = np.empty(g * ((s + 16) // 16 * 16), np.float32)
        _core_group(core, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, b, task - b * nkv, q, sc)


_CORES: dict = {}


def core(d: int, g: int):
    """The IR core for head dimension ``d`` and ``g`` query heads a KV head, or None where
    d is not a multiple of 16 (compiled once per process and ``MPITP_ISA``)."""
    if d % 16:
        return None
    key = (d, g, os.environ.get("MPITP_ISA", ""))
    f = _CORES.get(key)
    if f is None:
        f = _CORES[key] = jit.attention(d, g, cpu.isa())
    return f


def bound_attend(d: int, g: int, threads: bool):
    """:func:`attend` (or :func:`attend_threads`) with its core looked up once, for a
    decode loop whose arrays are C-contiguous (``f(qkv, cos, ..., out)``)."""
    f = core(d, g)
    if f is None:
        return attend_loops_threads if threads else attend_loops
    run = _attend_core_threads if threads else _attend_core
    return lambda *args: run(f, *args)


def _fits(qkv, kc, vc, valid, out) -> bool:
    return all(a.flags.c_contiguous for a in (qkv, kc, vc, valid, out)) and valid.dtype == np.bool_


def attend(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out) -> None:
    """``cos``/``sin`` [B, d] of each row's position; ``kc``/``vc`` [B, L, nkv, d];
    ``masked``: apply ``valid`` (else every column 0..s counts)."""
    f = core(kc.shape[3], nh // nkv) if _fits(qkv, kc, vc, valid, out) else None
    if f is None:
        attend_loops(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out)
    else:
        _attend_core(f, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out)


def attend_threads(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out) -> None:
    """:func:`attend` with each (row, KV head) a task of numba's thread pool (``--threads``):
    every head's arithmetic is :func:`attend`'s, so are its bits."""
    f = core(kc.shape[3], nh // nkv) if _fits(qkv, kc, vc, valid, out) else None
    if f is None:
        attend_loops_threads(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out)
    else:
        _attend_core_threads(f, qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out)


def warm(head_dim: int = 0, group: int = 1) -> None:
    """Compile (or load from numba's cache) these now, at load time, with the argument
    types a forward passes, rather than inside the first prefill or decode step."""
    x = np.zeros((1, 4), np.float32)
    rms_norm(x, np.ones(4, np.float32), 1e-5, np.empty_like(x))
    swiglu(x, np.empty((1, 2), np.float32))
    kc, vc = np.zeros((1, 2, 1, 2), np.float32), np.zeros((1, 2, 1, 2), np.float32)
    cos, sin, out = np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32), np.empty((1, 2), np.float32)
    args = (np.zeros((1, 6), np.float32), cos, sin, kc, vc, np.ones((1, 2), bool), 0, 1, 1, np.float32(1), True, out)
    attend_loops(*args)
    from .parallel import threads

    if threads() > 1:
        attend_loops_threads(*args)
    f = core(head_dim, group) if head_dim else None
    if f is not None:  # the model's core, and numba's callers of it: one row, one KV head
        d = head_dim
        kc, vc = np.zeros((1, 2, 1, d), np.float32), np.zeros((1, 2, 1, d), np.float32)
        cos, sin, out = np.ones((1, d), np.float32), np.zeros((1, d), np.float32), np.empty((1, group * d), np.float32)
        qkv, valid = np.zeros((1, (group + 2) * d), np.float32), np.ones((1, 2), bool)
        args = (qkv, cos, sin, kc, vc, valid, 0, group, 1, np.float32(1), True, out)
        _attend_core(f, *args)
        if threads() > 1:
            _attend_core_threads(f, *args)
