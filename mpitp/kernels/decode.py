"""One compiled call for the small operations of a decode step (NumPy float32, CPU).

Decoding one token per row runs ~35 NumPy operations per layer besides the matmuls, each
a few microseconds of dispatch for a few hundred numbers. These do the same arithmetic
in one call each (float32, as :mod:`mpitp.models.ops`; only the summation order
differs)::

    rms_norm   x [R, H], w [H]                                   -> x / sqrt(mean(x²) + eps) · w
    rotate     qkv [R, W]: RoPE on its first heads (prefill's q and k, every row)
    attend_rows  prefill: each query row's softmax(q·kᵀ·scale)·v over the columns it may
               see (a packed prompt's own, causal), one call a layer
    swiglu     gu [R, 2I] (gate | up)                            -> silu(gate) · up   [R, I]
    attend     qkv [B, (nh + 2·nkv)·d] of one new token per row  -> [B, nh·d]
               RoPE (rotate-half) on q and k, k and v written into the cache at column s,
               softmax(q·kᵀ·scale) over columns 0..s that ``valid`` allows, · v

attend's scores, softmax and sum over values run in an IR core (:mod:`.attend`, one
call per row and KV head: its query heads in registers while the cache streams past
once, the new key and value stored by it) where the head dimension is a multiple of 16
and each head's row of the cache is contiguous; the cache float32 or float16. Else (a
float32 cache) in numba's loops here (:func:`_attend_group`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import cpu, jit
from .calls import address, attention_at
from .ir.attend import EXP_LN2, EXP_LOG2E, EXP_POLY
from .weights.dequant import OPTS

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


@njit(cache=True, nogil=True, boundscheck=False)  # no fastmath: rounded as NumPy's x·cos + rot·sin
def rotate(qkv, heads, cos, sin, out):
    """RoPE (rotate-half) on the first ``heads`` heads of each row of qkv [R, W] (q and k
    side by side), cos and sin [R, d] -> out [R, heads·d]: one pass, where NumPy's
    concatenate, two products and a sum (prefill: 5.8 ms of an 8-prompt forward) made four."""
    R = qkv.shape[0]
    d = cos.shape[1]
    half = d // 2
    for r in range(R):
        x, y, c, s = qkv[r], out[r], cos[r], sin[r]
        for h in range(heads):
            xa, xb = x[h * d : h * d + half], x[h * d + half : (h + 1) * d]
            ya, yb = y[h * d : h * d + half], y[h * d + half : (h + 1) * d]
            for i in range(half):
                ya[i] = xa[i] * c[i] + (-xb[i]) * s[i]
                yb[i] = xb[i] * c[half + i] + xa[i] * s[half + i]


# exp(x) = 2^k · p(r), k = round(x·log2 e), r = x - k·ln 2 (Cephes' expf, ir/attend.py's; relative
# error ~2e-7, as libm's): a polynomial LLVM vectorizes, where np.exp is a call per value
LOG2E, LN2HI, LN2LO = np.float32(EXP_LOG2E), np.float32(EXP_LN2[0]), np.float32(EXP_LN2[1])
P0, P1, P2, P3, P4, P5 = (np.float32(c) for c in EXP_POLY)


@njit(**OPTS)
def _exp_split(x):
    """exp(x) for x in [-87, 88] as (p, the bits of 2^k): exp(x) = p · 2^k. Kept apart so
    that a loop of these stores both and vectorizes; the caller multiplies by 2^k (an
    int32 array's float32 view) in a second loop."""
    k = np.floor(x * LOG2E + np.float32(0.5))
    t = x - k * LN2HI - k * LN2LO
    p = ((((P0 * t + P1) * t + P2) * t + P3) * t + P4) * t + P5
    return p * t * t + t + np.float32(1.0), (np.int32(k) + np.int32(127)) << 23


@njit(**OPTS)
def _exp_shifted(sc, n, m, bits, two_k):
    """sc[:n] = exp(sc[:n] - m) (scores at most m: a softmax's), with swiglu's exp
    (:func:`_exp_split`); returns their sum."""
    for i in range(n):
        sc[i], bits[i] = _exp_split(max(sc[i] - m, np.float32(-87.0)))
    tot = np.float32(0.0)
    for i in range(n):
        sc[i] *= two_k[i]
        tot += sc[i]
    return tot


@njit(**OPTS)
def attend_rows(qk, nh, g, k, v, indptr, cols, scale, out):
    """Prefill attention, every query row against the columns it may see: qk [B, T, nq, d]
    (its first nh heads the queries, grouped g to a KV head), k and v [B, S, nkv, d]
    float32, the columns of row (b, t) ``cols[indptr[bT + t] : indptr[bT + t + 1]]``
    (each prompt's own, causal); out [B, T, nh·d]. One call a layer, where NumPy took a
    call per part and head group; each key and value row is read once for its g heads."""
    B, T = qk.shape[0], qk.shape[1]
    d = qk.shape[3]
    S = k.shape[1]
    sc = np.empty((g, S), np.float32)
    bits = np.empty(S, np.int32)
    two_k = bits.view(np.float32)
    acc = np.empty((g, d), np.float32)
    for b in range(B):
        for t in range(T):
            lo, hi = indptr[b * T + t], indptr[b * T + t + 1]
            n = hi - lo
            for j in range(qk.shape[2] - nh):  # the KV heads (q's heads, then k's)
                q = qk[b, t, j * g : (j + 1) * g]
                for c in range(lo, hi):
                    kv = k[b, cols[c], j]
                    for h in range(g):
                        s = np.float32(0.0)
                        for i in range(d):
                            s += q[h, i] * kv[i]
                        sc[h, c - lo] = s * scale
                acc[:] = 0  # (a row that sees no column: zeros)
                for h in range(g if n else 0):
                    row = sc[h]
                    m = row[0]
                    for c in range(1, n):
                        m = max(m, row[c])
                    inv = np.float32(1.0) / _exp_shifted(row, n, m, bits, two_k)
                    for c in range(n):
                        row[c] *= inv
                for c in range(lo, hi):
                    vv = v[b, cols[c], j]
                    for h in range(g):
                        w = sc[h, c - lo]
                        for i in range(d):
                            acc[h, i] += w * vv[i]
                for h in range(g):
                    o = out[b, t, (j * g + h) * d : (j * g + h + 1) * d]
                    for i in range(d):
                        o[i] = acc[h, i]


@njit(**OPTS, error_model="numpy")  # a division that may not raise: the loop vectorizes (8x faster)
def swiglu(gu, out):
    R, I2 = gu.shape
    n = I2 // 2
    bits = np.empty(n, np.int32)
    two_k = bits.view(np.float32)
    for r in range(R):
        for i in range(n):  # p into out, 2^k's bits into two_k, of exp(-gate)
            out[r, i], bits[i] = _exp_split(min(max(-gu[r, i], np.float32(-87.0)), np.float32(88.0)))
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
def _rope_group(qkv, cos, sin, nh, nkv, d, scale, b, j, q, kn):
    """Row b, KV head j: its new key rotated into ``kn`` [d], and its query heads rotated,
    times ``scale``, into ``q`` [G, d]."""
    half = d // 2
    g = nh // nkv
    base = (nh + j) * d
    for i in range(half):
        x0, x1 = qkv[b, base + i], qkv[b, base + half + i]
        kn[i] = x0 * cos[b, i] - x1 * sin[b, i]
        kn[half + i] = x1 * cos[b, half + i] + x0 * sin[b, half + i]
    for hh in range(g):
        base = (j * g + hh) * d
        for i in range(half):
            x0, x1 = qkv[b, base + i], qkv[b, base + half + i]
            q[hh, i] = (x0 * cos[b, i] - x1 * sin[b, i]) * scale
            q[hh, half + i] = (x1 * cos[b, half + i] + x0 * sin[b, half + i]) * scale


@njit(**OPTS)
def _core_group(core, qkv, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, out, b, j, q, kn, sc):
    """Row b, KV head j through the IR core (at address ``core``). ``cache``: (k, v addresses, bytes a row b and
    a head j advance them, values a column advances), as numba cannot hold a float16 array;
    ``q``, ``kn``, ``sc``: scratch of [G, d], d and G·S16 floats."""
    _rope_group(qkv, cos, sin, nh, nkv, d, scale, b, j, q, kn)
    k, v, sb, sj, st = cache
    at = b * sb + j * sj  # bytes to [b, 0, j, 0] (k and v alike)
    o = (b * out.shape[1] + j * (nh // nkv) * d) * 4
    vnew = qkv.ctypes.data + (b * qkv.shape[1] + (nh + nkv + j) * d) * 4
    attention_at(core, q.ctypes.data, k + at, v + at, valid.ctypes.data + b * valid.shape[1], out.ctypes.data + o,
                 sc.ctypes.data, kn.ctypes.data, vnew, s + 1, st, 1 if masked else 0)  # fmt: skip


@njit(**OPTS)
def attend_core(core, qkv, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, out):
    g = nh // nkv
    q, kn = np.empty((g, d), np.float32), np.empty(d, np.float32)
    sc = np.empty(g * ((s + 16) // 16 * 16), np.float32)
    for b in range(qkv.shape[0]):
        for j in range(nkv):
            _core_group(core, qkv, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, out, b, j, q, kn, sc)


@njit(parallel=True, nogil=True, cache=True, fastmath=True, boundscheck=False)
def attend_core_threads(core, qkv, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, out):
    g = nh // nkv
    for task in prange(qkv.shape[0] * nkv):
        b = task // nkv
        q, kn = np.empty((g, d), np.float32), np.empty(d, np.float32)
        sc = np.empty(g * ((s + 16) // 16 * 16), np.float32)
        _core_group(core, qkv, cos, sin, cache, valid, s, nh, nkv, d, scale, masked, out, b, task - b * nkv, q, kn, sc)


_CORES: dict = {}
CACHE_TYPES = (np.float32, np.float16)  # what the core reads; numba's loops: float32 only


def core(d: int, g: int, dtype=np.float32):
    """The IR core for head dimension ``d``, ``g`` query heads a KV head and a cache of
    ``dtype``, or None where there is none: d not a multiple of 16, or float16 on the
    baseline x86-64 (``MPITP_ISA=portable``: no conversion instructions). Compiled once
    per process, for the instruction set the process chose first."""
    half = np.dtype(dtype) == np.float16
    if d % 16 or np.dtype(dtype) not in CACHE_TYPES:
        return None
    key = (d, g, half)
    f = _CORES.get(key, False)
    if f is False:
        isa = cpu.isa()
        f = _CORES[key] = None if half and not cpu.FACTS[isa].f16c else jit.attention(d, g, isa, half)
    return f


def rows_fit(kc, vc) -> bool:
    """A cache the core (or numba's loops, float32) can read: each head's row of d values
    contiguous, k and v alike (any order of the other axes)."""
    return (
        type(kc) is np.ndarray
        and kc.dtype == vc.dtype
        and kc.dtype in CACHE_TYPES
        and kc.strides == vc.strides
        and kc.strides[3] == kc.itemsize
    )


def usable(kc, vc, g: int) -> bool:
    """Whether :func:`attend` takes this cache: the core's, or float32 for numba's loops."""
    return rows_fit(kc, vc) and (kc.dtype == np.float32 or core(kc.shape[3], g, kc.dtype) is not None)


def cache_pointers(kc, vc) -> tuple[int, int, int, int, int]:
    """(K's and V's addresses, a row's and a head's byte strides, a column's stride in values)."""
    return jit.address(kc), jit.address(vc), kc.strides[0], kc.strides[2], kc.strides[1] // kc.itemsize


def bound_attend(d: int, g: int, threads: bool, dtype=np.float32):
    """:func:`attend` (or :func:`attend_threads`) with its core looked up once, for a
    decode loop over a cache of ``dtype`` that :func:`usable` takes."""
    f = core(d, g, dtype)
    if f is None:
        return attend_loops_threads if threads else attend_loops
    run = attend_core_threads if threads else attend_core
    f = address(f)  # an integer: numba types a ctypes function anew on every call (~1 µs)

    def attend(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out):
        run(f, qkv, cos, sin, cache_pointers(kc, vc), valid, s, nh, nkv, d, scale, masked, out)

    return attend


def _pick(qkv, kc, vc, valid, out, nh, nkv):
    """The core for these arrays, None for numba's loops, or an error where neither fits."""
    plain = all(a.flags.c_contiguous for a in (qkv, valid, out)) and qkv.dtype == out.dtype == np.float32
    f = core(kc.shape[3], nh // nkv, kc.dtype) if plain and rows_fit(kc, vc) else None
    if f is None and kc.dtype != np.float32:
        raise ValueError(f"decode attention over a {kc.dtype} cache needs the IR core (head dim a multiple of 16)")
    return f


def attend(qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out, *, threads: bool = False) -> None:
    """``cos``/``sin`` [B, d] of each row's position; ``kc``/``vc`` [B, L, nkv, d] (float32,
    or float16 for the core); ``masked``: apply ``valid`` (else every column 0..s counts).
    ``threads``: each (row, KV head) a task of numba's pool (``--threads``), every head's
    arithmetic the serial one's, so are its bits."""
    f = _pick(qkv, kc, vc, valid, out, nh, nkv)
    if f is None:
        (attend_loops_threads if threads else attend_loops)(
            qkv, cos, sin, kc, vc, valid, s, nh, nkv, scale, masked, out
        )
    else:
        run = attend_core_threads if threads else attend_core
        run(address(f), qkv, cos, sin, cache_pointers(kc, vc), valid, s, nh, nkv, kc.shape[3], scale, masked, out)


def attend_threads(*args) -> None:
    """:func:`attend` over numba's pool."""
    attend(*args, threads=True)


def warm(head_dim: int = 0, group: int = 1, kv_dtype=np.float32) -> None:
    """Compile (or load from numba's cache) these now, at load time, with the argument
    types a forward passes, rather than inside the first prefill or decode step."""
    x = np.zeros((1, 4), np.float32)
    rms_norm(x, np.ones(4, np.float32), 1e-5, np.empty_like(x))
    swiglu(x, np.empty((1, 2), np.float32))
    rotate(x, 1, x, x, np.empty_like(x))  # prefill's RoPE and short-row attention
    qk, kv, indptr = np.zeros((1, 1, 2, 2), np.float32), np.zeros((1, 1, 1, 2), np.float32), np.arange(2)
    attend_rows(qk, 1, 1, kv, kv, indptr, indptr[:1], np.float32(1), np.empty((1, 1, 2), np.float32))
    kc, vc = np.zeros((1, 2, 1, 2), np.float32), np.zeros((1, 2, 1, 2), np.float32)
    cos, sin, out = np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32), np.empty((1, 2), np.float32)
    args = (np.zeros((1, 6), np.float32), cos, sin, kc, vc, np.ones((1, 2), bool), 0, 1, 1, np.float32(1), True, out)
    attend_loops(*args)
    from .parallel import threads

    if threads() > 1:
        attend_loops_threads(*args)
    f = core(head_dim, group, kv_dtype) if head_dim else None
    if f is not None:  # the model's core, and numba's callers of it: one row, one KV head
        d = head_dim
        kc, vc = np.zeros((1, 2, 1, d), kv_dtype), np.zeros((1, 2, 1, d), kv_dtype)
        cos, sin, out = np.ones((1, d), np.float32), np.zeros((1, d), np.float32), np.empty((1, group * d), np.float32)
        qkv, valid = np.zeros((1, (group + 2) * d), np.float32), np.ones((1, 2), bool)
        core_args = (qkv, cos, sin, cache_pointers(kc, vc), valid, 0, group, 1, d, np.float32(1), True, out)
        attend_core(address(f), *core_args)
        if threads() > 1:
            attend_core_threads(address(f), *core_args)
