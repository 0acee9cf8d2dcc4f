"""``y = x @ Wᵀ`` with int8 activations, for weights in tiles (:mod:`.tiles`).

x is quantized once per call (:mod:`.quantize`), then one compiled kernel (:mod:`.jit`,
:mod:`.vector`; with ``amx``, 8 rows and more on the tiles, :mod:`.ir.amx`) per row
count R in 1, 2, 4, 8, 16 walks the weights once for all rows
(a row count in between runs the next R up; its extra rows are not stored). More than 16
rows (prefill) go a chunk at a time (16 rows, 8 with avx512, avx2: :func:`chunk`) over column
tiles of the weight small enough to stay in the cache while every chunk of rows passes
over them (an int8 GEMM in tiles)::

    for each span of TILES×8 output rows:      weights read from memory once
        for each chunk of rows of x:           ... and reused from cache M/chunk times
            kernel(span, rows) -> y[rows, span]

The result equals the float64 product of the dequantized int8 x and the weights up to
float32 summation order (tests/test_int8.py).

int8o (one digit, the outliers apart) holds in decode, up to 16 rows a call. Past 16 rows
(prefill) its weights are multiplied with two full digits, as int8x2 (on avx2 against
K-quants each digit's scale per super-block of 256: :func:`whole`): on real activations
the union of a chunk's outliers covers most blocks (the default model: 58% of blocks at
K = 576, 98% at K = 1536, for some row of 8), so the outlier digit was multiplied nearly
everywhere already and two digits cost no more (measured: prefill faster, docs/
measurements.md); and the prompt's logits, which pick the first token, and its keys and
values, which every later token attends to, are then float32's up to ~1e-7 KL. With one
digit the first token of README's question was a coin toss between "The" and "L" (0.08
apart in float32): it flipped with the kernels' summation order, by machine and TP size.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numba
import numpy as np
from numba import njit

from . import cpu, jit, parallel
from .calls import address, kernel_at, quantizer_at
from .ir.quantize import OUTLIERS, TWO_DIGITS
from .quantize import outlier_quantizer, quantize_rows, quantize_rows2, two_digit_quantizer
from .weights.tiles import ROWS, TiledWeight

KERNEL_ROWS = (1, 2, 4, 8, 16)
SMALL = KERNEL_ROWS[-1]
SPAN = 64  # tiles (of 8 rows) per column span in prefill: 512 rows


def pointer(a) -> int:
    """Where an array's data starts (0 for None: a weight without minimums)."""
    return 0 if a is None else a.ctypes.data


def kernels(
    kind: str, digits: int = 1, isa: str | None = None, group: int = 32, outliers: bool = False, whole: bool = False
) -> dict[int, Any]:
    """The compiled kernels of one weight kind, digits of x and scale group, by row count
    (``outliers``: the second digit is x's outliers, multiplied only where there are any;
    ``whole``: x a scale per super-block, :func:`whole`)."""
    isa = isa or cpu.isa()
    extra = (False, True) if whole else (True,) if outliers else ()
    tiles_from = cpu.FACTS[isa].tiles_from  # amx: from 8 rows of x on the tiles (docs/measurements.md)
    vector = [r for r in KERNEL_ROWS if tiles_from is None or r < tiles_from]
    out = dict(zip(vector, jit.functions([(kind, lanes(isa, r), r, digits, group) + extra for r in vector])))
    tiles = [r for r in KERNEL_ROWS if r not in out]
    out.update(zip(tiles, jit.functions([(kind, "amx", r, digits, group) + extra for r in tiles])))
    return out


def lanes(isa: str, rows: int) -> str:
    """The vector kernels for ``rows`` rows of x (:data:`.cpu.FACTS`): avx512's 16 lanes from
    WIDE_ROWS rows up; with fewer the step is bound by memory and one tile a step (one
    stream of weights) reads faster. ``amx`` decodes with avx512's kernels."""
    f = cpu.FACTS[isa]
    return f.narrow if rows < cpu.WIDE_ROWS else f.vector


def chunk(isa: str, digits: int = 1, K: int = 0) -> int:
    """Rows of x each prefill kernel call takes (:data:`.cpu.FACTS`): 16, or 8 with avx512
    (16 rows of 16 lanes spill their accumulators) and avx2 (16 rows of 8 lanes spill an
    AVX2 CPU's 16 registers: on Zen 5 compiled as for one, prefill of the 12-layer
    Qwen3-30B-A3B 2.85-3.00 -> 2.54-2.61 s, the 1B Q4_K_M 4.24-4.40 -> 3.99-4.05 s); amx's
    16 rows of x in one tile, or with two digits in two tiles that share each block's weights
    as long as those 32 rows of xq (32·K bytes) stay in L1 (``K`` at most AMX_WIDE_K), past
    that 8 (docs/measurements.md)."""
    rows = cpu.FACTS[isa].prefill_rows
    return rows if isa != "amx" or digits == 1 or K <= AMX_WIDE_K else 8


AMX_WIDE_K = 1024


def whole(fmt: str, digits: int, isa: str) -> bool:
    """Whether prefill multiplies weights of layout ``fmt`` with x's two digits a scale per
    super-block of 256 (:func:`.quantize.quantize_rows2`'s ``whole``, ggml's Q8_K grouping)
    and kernels that add a super-block's sums as integers: K-quants on avx2
    (:attr:`.cpu.Facts.whole_k`; on a Xeon Q4_K 4-8%, Q6_K 15-23% faster, where the
    conversion, multiply and multiply-add a block, row and digit were ~15% of the work).
    x keeps ~15 bits a super-block: its error ~1.5e-5 of the super-block's largest value,
    where a scale per 32 keeps it of each block's."""
    return digits == 2 and cpu.FACTS[isa].whole_k and fmt.removesuffix("h") in ("q4k", "q6k")


def prefill_kernel(kind: str, digits: int, isa: str, group: int, K: int = 0):
    """The kernel prefill calls for :func:`chunk` rows of x: AMX's where ``isa`` is amx."""
    if isa == "amx":
        return jit.functions([(kind, "amx", chunk(isa, digits, K), digits, group)])[0]
    return kernels(kind, digits, isa, group, False, whole(kind, digits, isa))[chunk(isa)]


def prefill_kernels(kind: str, digits: int, isa: str, group: int, K: int = 0) -> np.ndarray:
    """Addresses of the kernels prefill calls by the rows of a chunk (index 0..chunk): a full
    chunk's (:func:`prefill_kernel`), and for a last chunk of fewer rows the kernel of the
    next row count up where that is smaller (1, 2, 4, 8): a kernel computes all its R rows,
    and a MoE prompt's experts take ~30 rows each, so padding every tail to 16 (avx2) had
    multiplied ~8 rows an expert for nothing. ``[0]`` nonzero: a tail that would still pad 2
    rows or more goes in powers of two (14 = 8 + 4 + 2: :func:`.parallel._span`). AMX: its one
    kernel for every count, no split."""
    return _prefill_kernels(kind, digits, isa, group, isa == "amx" and digits == 2 and K > AMX_WIDE_K)


@cache
def _prefill_kernels(kind: str, digits: int, isa: str, group: int, wide_k: bool) -> np.ndarray:
    K = AMX_WIDE_K + 1 if wide_k else 0  # amx: its chunk, as prefill_kernel picks it
    rows = chunk(isa, digits, K)
    out = np.full(rows + 1, address(prefill_kernel(kind, digits, isa, group, K)), np.int64)
    if isa != "amx":
        k = kernels(kind, digits, isa, group, False, whole(kind, digits, isa))
        for m in range(1, rows):
            out[m] = address(k[rows_for(m)])
        out[0] = 1  # a tail may go in powers of two (parallel._span)
    else:
        out[0] = 0
    return out


def _bound_quantizer(w: TiledWeight, isa: str | None, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray):
    """``f(x)``: x quantized into these buffers (the two-row quantizers compiled from IR,
    bound to them)."""
    if w.outliers:
        return outlier_quantizer(isa)(xq, xd, xs)
    if w.digits == 2:
        return two_digit_quantizer(isa)(xq, xd, xs)
    return lambda x: quantize_rows(x, xq, xd, xs)


def rows_for(m: int) -> int:
    return next(r for r in KERNEL_ROWS if r >= m)


def lined(shape: tuple[int, int], dtype) -> np.ndarray:
    """Zeros whose data starts on a cache line (numpy's own start only on 16 bytes). The
    AMX kernels load x's quantized rows as tiles, 32 bytes a row at every 32nd byte of a
    row: from 64-byte aligned rows those never straddle two lines. From numpy's arrays one
    in four did (a start at 48 mod 64), and a tile load of 8 rows that each straddle two
    lines took 8.1 instead of 1.3 ns (measured on a Xeon), ~6.8 ns more a block of every
    weight in that matmul."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 64, np.uint8)
    at = -raw.ctypes.data % 64
    return raw[at : at + n].view(dtype).reshape(shape)


class Bound:
    """``f(x, y)`` for one weight: quantization buffers allocated once, the kernel of each
    row count looked up once, every pointer but x's quantized rows and y fixed. Where x
    is quantized by an IR quantizer (int8o, int8x2), one compiled call (:func:`_quantized`)
    runs the quantizer and the kernel by address: ~10.6 µs for the default model's qkv
    where two ctypes calls and their Python took ~14.2."""

    def __init__(self, w: TiledWeight, isa: str | None = None):
        k = kernels(w.fmt, w.digits, isa, w.group, w.outliers)
        # the kernel for M rows, by M (looked up once: a decode step makes ~120 calls)
        self.w, self.by_rows = w, [None] + [k[rows_for(m)] for m in range(1, SMALL + 1)]
        self.at_rows = [0] + [address(f) for f in self.by_rows[1:]]
        N, K = w.shape
        self.T, self.nb = w.qs.shape[0], K // 32
        P = SMALL * w.digits
        self.xq = lined((P, K), np.int8)  # rows past M may hold old values: not stored
        self.xd = np.zeros((P, self.nb), np.float32)
        self.xs = np.zeros((P, K // w.xs_group), np.float32)
        self.quantize = _bound_quantizer(w, isa, self.xq, self.xd, self.xs)
        self.wp = (pointer(w.qs), pointer(w.d), pointer(w.m))
        self.xp = (pointer(self.xq), pointer(self.xd), pointer(self.xs))
        self.pad = np.empty((SMALL, self.T * ROWS), np.float32) if self.T * ROWS != N else None
        self.threads = parallel.threads()
        if self.T * self.nb < self.threads * parallel.MIN_WORK:
            self.threads = 1
        self.tile_bytes = _tile_bytes(w)
        q = _ir_quantizer(w, isa)
        # (quantizer, its last argument, the kernel's fixed pointers, T, nb) for _quantized
        self.fused = None if q is None else (address(q), int(self.xs.shape[1] != K // 32), *self.xp, *self.wp)

    def __call__(self, x: np.ndarray, y: np.ndarray) -> None:
        M = x.shape[0]
        if M == 0:  # no rows (a prefill chunk with no position's logits wanted): nothing to do
            return
        out = y if self.pad is None else self.pad
        if (
            self.fused is not None
            and self.threads == 1
            and M <= SMALL
            and x.dtype == np.float32
            and x.flags.c_contiguous
            and out.flags.c_contiguous
            and x.shape[1] == self.xq.shape[1]
        ):
            _quantized(self.at_rows[M], x, out, *self.fused, self.T, self.nb)
        else:
            self._call(x, out, M)
        if self.pad is not None:
            y[:, :] = self.pad[:M, : y.shape[1]]

    def _call(self, x, out, M: int) -> None:
        """The quantizer's Python binding, then the kernel (with threads: over numba's pool)."""
        self.quantize(x)
        if self.threads > 1:
            parallel.run_tiles(
                self.at_rows[M], self.threads, self.wp, self.tile_bytes, self.xp, out.ctypes.data,
                self.T, self.nb, M, out.shape[1],
            )  # fmt: skip
        else:
            self.by_rows[M](*self.wp, *self.xp, jit.address(out), self.T, self.nb, M, out.shape[1])


@njit(nogil=True, cache=True)
def _quantized(kernel, x, y, quantizer, halves, xq, xd, xs, qs, d, m, T, nb):
    """x [M, K] quantized by the IR quantizer at ``quantizer`` into xq, xd, xs, then
    ``y = x @ Wᵀ`` by the kernel at ``kernel`` (addresses: :mod:`.calls`)."""
    M, K = x.shape
    quantizer_at(quantizer, x.ctypes.data, xq, xd, xs, M, K, halves)
    kernel_at(kernel, qs, d, m, xq, xd, xs, y.ctypes.data, T, nb, M, y.shape[1])


def _ir_quantizer(w: TiledWeight, isa: str | None):
    """The IR quantizer's ctypes function for this weight's x, None for numba's one digit."""
    if w.outliers:
        return jit.quantizer(isa or cpu.isa(), OUTLIERS)
    if w.digits == 2:
        return jit.quantizer(isa or cpu.isa(), TWO_DIGITS)
    return None


def _tile_bytes(w: TiledWeight) -> tuple[int, int, int]:
    """Bytes one tile of 8 output rows takes in qs, d and m."""
    return w.qs[0].nbytes, w.d[0].nbytes, 0 if w.m is None else w.m[0].nbytes


def matmul(x2: np.ndarray, w: TiledWeight, isa: str | None = None) -> np.ndarray:
    """float32 [M, K] C-contiguous @ w.T -> float32 [M, N], any M."""
    M, K = x2.shape
    N = w.shape[0]
    T, nb = w.qs.shape[0], K // 32
    if M == 0:
        return np.empty((0, N), np.float32)
    if M <= SMALL:  # a decode step: the bound kernel kept with the weight (the head's, every step)
        y = np.empty((M, N), np.float32)
        key = (isa or cpu.isa(), parallel.threads())
        f = w.bound.get(key)
        if f is None:
            f = w.bound[key] = Bound(w, key[0])
        f(x2, y)
        return y
    D = w.digits
    isa = isa or cpu.isa()
    rows = chunk(isa, D, K)
    # int8o's prefill multiplies two full digits, as int8x2 (the module's docstring says why)
    P = -(-M // rows) * rows * D
    xq = lined((P, K), np.int8)
    xd = np.zeros((P, nb), np.float32)
    ns = K // w.xs_group  # x's sums per row (per 32, or per 16 for q6k)
    xs = np.zeros((P, ns), np.float32)
    if D == 1:
        quantize_rows(x2, xq, xd, xs)
    else:
        quantize_rows2(x2, xq, xd, xs, isa, whole(w.fmt, D, isa))
    Y = np.empty((M, T * ROWS), np.float32)
    n = parallel.threads()
    if n > 1 and T * nb < n * parallel.MIN_WORK:
        n = 1
    span = SPAN if n == 1 else min(SPAN, -(-T // n))  # every thread a span at least
    wp = (pointer(w.qs), pointer(w.d), pointer(w.m))
    xp = (pointer(xq), pointer(xd), pointer(xs))
    parallel.run_spans(
        prefill_kernels(w.fmt, D, isa, w.group, K),
        n,
        span,
        rows,
        wp,
        _tile_bytes(w),
        xp,
        (D * K, D * nb * 4, D * ns * 4),
        Y.ctypes.data,
        T,
        nb,
        M,
        T * ROWS,
    )
    return Y if T * ROWS == N else np.ascontiguousarray(Y[:, :N])


def warm(kind: str, digits: int = 1, group: int = 32, outliers: bool = False) -> None:
    """Compile the kernels of this layout (:attr:`TiledWeight.fmt`) now (at load), not in
    the first forward: decode's, and with ``outliers`` prefill's two-digit ones too."""
    k = kernels(kind, digits, None, group, outliers)
    parallel.warm(address(k[1]), parallel.threads())
    if outliers or digits == 2:  # decode's one call, compiled (or loaded) for the types it is given
        x = numba.typeof(np.zeros((1, 32), np.float32))
        _quantized.compile((numba.int64, x, x) + (numba.int64,) * 10)
    if outliers:
        outlier_quantizer()
    for K in (AMX_WIDE_K, AMX_WIDE_K + 1):  # both of amx's chunks, and the tails' kernels
        prefill_kernels(kind, digits, cpu.isa(), group, K)
    if digits == 2:
        two_digit_quantizer()  # decode's (int8x2), and prefill's
        two_digit_quantizer(None, whole(kind, digits, cpu.isa()))
        return
    x = np.zeros((1, 32), np.float32)
    for sums in (1, 2):  # one digit's numba quantizer, sums per 32 and per 16 (q6k)
        quantize_rows(x, np.zeros((2, 32), np.int8), np.zeros((2, 1), np.float32), np.zeros((2, sums), np.float32))
