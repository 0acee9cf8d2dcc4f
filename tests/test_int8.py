"""The int8 kernels (:mod:`mpitp.kernels.int8`): the activation quantizer against the
``gguf`` package's Q8_0 quantizer, the tiles against the planar weights bit for bit, and
every instruction set this CPU runs against the float64 product of the dequantized int8
x and the dequantized weights, for shapes that are multiples of nothing convenient (rows
of x 1-16: the decode kernels; more: prefill in tiles). The VNNI kernels, where this CPU
lacks VNNI, are compiled for CPUs that have it and their machine code checked."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from int8_reference import dequantized, k_blocks  # noqa: E402

from mpitp.kernels import cpu, int8, jit  # noqa: E402
from mpitp.kernels.quantize import LIMIT, quantize, quantize_rows2, quantize_rows_outliers  # noqa: E402
from mpitp.kernels.weights import formats, tiles  # noqa: E402

NATIVE = ["Q4_0", "Q4_1", "Q8_0"]
RUNNABLE = list(cpu.supported())  # this CPU's instruction sets (portable always)


def dequantized_x(q, d):
    m, k = q.shape
    return (q.reshape(m, k // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)).reshape(m, k)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 9),
    blocks=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    scale=st.sampled_from([1e-6, 1e-2, 1, 300]),
)
def test_quantizer_equals_gguf_q8_0(m, blocks, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, 32 * blocks)) * scale).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0, q = 0
    x[-1, 5] = x[-1, 5:37].max() * 1.0000001 if blocks > 1 else x[-1, 5]
    q, d, s = quantize(x)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(m, blocks, 34)
    assert np.array_equal(q.reshape(m, blocks, 32), raw[:, :, 2:].view(np.int8))  # q bit for bit
    assert np.array_equal(d.astype(np.float16), raw[:, :, :2].copy().view(np.float16)[..., 0])  # gguf stores d in fp16
    assert np.allclose(s, d * q.reshape(m, blocks, 32).sum(-1, dtype=np.int64), rtol=1e-6, atol=0)


def test_outliers_leave_the_other_values_their_own_scale():
    """int8o: values above LIMIT × the root mean square of the rest of their block go to the
    second row; the first row is ggml's Q8_0 of x without them (bit for bit), and the two
    rows add up to x within each one's quantization step."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[0, 7] = 80.0  # block 0 of row 0
    x[2, 100] = -60.0  # block 3 of row 2
    xq, xd, xs = np.zeros((6, 128), np.int8), np.zeros((6, 4), np.float32), np.zeros((6, 4), np.float32)
    quantize_rows_outliers(x, xq, xd, xs)
    b = np.abs(x.astype(np.float64)).reshape(3, 4, 32)
    rest = np.sqrt(((b**2).sum(-1) - b.max(-1) ** 2) / 31)
    big = (b > LIMIT * rest[..., None]).reshape(3, 128)
    assert big.sum() == 2 and big[0, 7] and big[2, 100]
    q1, d1, _ = quantize(np.where(big, 0, x))
    assert np.array_equal(xq[0::2], q1) and np.array_equal(xd[0::2], d1)
    assert np.count_nonzero(xd[1::2]) == 2 and xd[1, 0] > 0 and xd[5, 3] > 0
    assert np.count_nonzero(xq[1::2]) == 2
    both = dequantized_x(xq[0::2], xd[0::2]) + dequantized_x(xq[1::2], xd[1::2])
    assert np.all(np.abs(both - x) <= np.maximum(xd[0::2], xd[1::2]).repeat(32, 1) / 2 * (1 + 1e-6))
    assert abs(both[0, 7] - 80.0) <= 80.0 / 254 and np.abs(both - x)[~big].max() <= d1.max() / 2 * (1 + 1e-6)
    sums = xd[0::2] * xq[0::2].reshape(3, 4, 32).sum(-1) + xd[1::2] * xq[1::2].reshape(3, 4, 32).sum(-1)
    assert np.allclose(xs[0::2], sums, rtol=1e-6)
    # compiled from IR for each instruction set: the same bits (the portable one for a
    # baseline x86-64); sums per 16 (K-quants' minimum) as the two digits' own
    halves = np.zeros((6, 8), np.float32)
    for isa in RUNNABLE:
        q2, d2, s2 = np.zeros_like(xq), np.zeros_like(xd), np.zeros_like(xs)
        quantize_rows_outliers(x, q2, d2, s2, isa)
        assert np.array_equal(q2, xq) and np.array_equal(d2, xd) and np.array_equal(s2, xs), isa
        quantize_rows_outliers(x, q2, d2, halves, isa)
        per16 = [xd[r::2].repeat(2, 1) * xq[r::2].reshape(3, 8, 16).sum(-1).astype(np.float32) for r in (0, 1)]
        assert np.array_equal(halves[0::2], per16[0] + per16[1]), isa
        assert np.array_equal(q2, xq) and np.array_equal(d2, xd)
    ro = x.copy()  # read-only x (a mapped file's): its address taken the other way
    ro.setflags(write=False)
    q2, d2, s2 = np.zeros_like(xq), np.zeros_like(xd), np.zeros_like(xs)
    quantize_rows_outliers(ro, q2, d2, s2)
    assert np.array_equal(q2, xq) and np.array_equal(d2, xd) and np.array_equal(s2, xs)
    with pytest.raises(ValueError, match="does not fit"):
        quantize_rows_outliers(x, xq[:4], xd[:4], xs[:4])


@pytest.mark.parametrize("nb", [19, 24])  # two steps of 8 (GROUP) and 3 one at a time; three steps
def test_outliers_eight_blocks_a_step_are_the_block_loops_bits(nb):
    """int8o's quantizer takes 8 blocks a step (their Σv², cut, d and Σq 8 to a vector);
    each block alone (a row of 32: the one-block loop) gives the same bits, for every
    instruction set, with values a hair either side of their block's cut."""
    rng = np.random.default_rng(nb)
    M, K = 5, 32 * nb
    x = (rng.standard_normal((M, K)) * np.exp(rng.standard_normal((1, K)) * 1.5)).astype(np.float32)
    x[1, 40:72] = 0.0  # a block of zeros
    for b in range(nb):  # row 2: value 0 of each block at LIMIT x the rest's rms, nudged by -1, 0, +1e-7
        blk = x[2, 32 * b : 32 * b + 32].astype(np.float64)
        x[2, 32 * b] = np.float32(LIMIT * np.sqrt(((blk**2).sum() - blk[0] ** 2) / 31)) * (1 + (b % 3 - 1) * 1e-7)
    for isa in RUNNABLE:
        for per in (1, 2):  # x's sums per 32, per 16
            got = [
                np.zeros((2 * M, K), np.int8),
                np.zeros((2 * M, nb), np.float32),
                np.zeros((2 * M, per * nb), np.float32),
            ]
            quantize_rows_outliers(x, *got, isa)
            one = [
                np.zeros((2 * M * nb, 32), np.int8),
                np.zeros((2 * M * nb, 1), np.float32),
                np.zeros((2 * M * nb, per), np.float32),
            ]
            quantize_rows_outliers(x.reshape(M * nb, 32), *one, isa)
            back = [a.reshape(M, nb, 2, -1).transpose(0, 2, 1, 3).reshape(2 * M, -1) for a in one]
            assert all(np.array_equal(g, o) for g, o in zip(got, back)), (isa, per)
            assert np.count_nonzero(got[1][1::2]) > nb // 3, isa  # outliers found, in row 2 and elsewhere


@pytest.mark.parametrize("nb", [3, 19])  # blocks a row: one at a time; two steps of 8 (GROUP) and 3
def test_two_digits_hold_what_one_leaves(nb):
    rng = np.random.default_rng(3)
    K = 32 * nb
    x = (rng.standard_normal((5, K)) * np.exp(rng.standard_normal((1, K)) * 2)).astype(np.float32)
    x[1, 40:72] = 0.0  # a block of zeros (d = 0)
    x[2, 3] = x[2, 5] = 0.0
    x[3, :8] = [127.0, 2.5, -3.5, 0.5, -0.5, 1.4999999, -126.5, 0.49999997]  # d = 1: ties round away from 0
    xq, xd, xs = np.zeros((10, K), np.int8), np.zeros((10, nb), np.float32), np.zeros((10, nb), np.float32)
    quantize_rows2(x, xq, xd, xs)
    one = dequantized_x(xq[0::2], xd[0::2])
    two = one + dequantized_x(xq[1::2], xd[1::2])
    q1, d1, _ = quantize(x)
    assert np.array_equal(xq[0::2], q1) and np.array_equal(xd[0::2], d1)  # digit 1 is the one-digit quantization
    assert list(xq[6, :8]) == [127, 3, -4, 1, -1, 1, -127, 0]
    q2, d2, _ = quantize(x - d1.repeat(32, 1) * q1.astype(np.float32))  # digit 2: Q8_0 of what it leaves, bit for bit
    assert np.array_equal(xq[1::2], q2) and np.array_equal(xd[1::2], d2)
    err1, err2 = np.abs(one - x).max(), np.abs(two - x).max()
    assert err2 <= np.repeat(xd[1::2], 32, axis=1).max() / 2 * 1.001 + 1e-12 and err2 < err1 / 100, (err1, err2)
    assert np.allclose(
        xs[0::2],
        (xd[0::2] * xq[0::2].reshape(5, nb, 32).sum(-1) + xd[1::2] * xq[1::2].reshape(5, nb, 32).sum(-1)),
        rtol=1e-5,
    )
    # compiled from IR for each instruction set: the same bits; sums per 16 as each digit's own
    halves = np.zeros((10, 2 * nb), np.float32)
    for isa in RUNNABLE:
        b = [np.zeros_like(a) for a in (xq, xd, xs)]
        quantize_rows2(x, *b, isa)
        assert all(np.array_equal(u, v) for u, v in zip(b, (xq, xd, xs))), isa
        quantize_rows2(x, b[0], b[1], halves, isa)
        per16 = [xd[r::2].repeat(2, 1) * xq[r::2].reshape(5, 2 * nb, 16).sum(-1).astype(np.float32) for r in (0, 1)]
        assert np.array_equal(halves[0::2], per16[0] + per16[1]), isa
    with pytest.raises(ValueError, match="does not fit"):
        quantize_rows2(x, xq[:8], xd[:8], xs[:8])


@settings(max_examples=20, deadline=None)
@given(t=st.sampled_from(NATIVE), n=st.integers(1, 70), blocks=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_tiles_hold_the_planar_values(t, n, blocks, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, 32 * blocks)).astype(np.float32)
    bw = formats.from_ggml(gguf.quants.quantize(w, gguf.GGMLQuantizationType[t]), t)
    tw = tiles.repack(bw)
    assert tw.shape == bw.shape and tw.qs.shape[0] == -(-n // 8)
    assert np.array_equal(tw.dequantize(), bw.dequantize())
    a = int(rng.integers(0, n))
    b = int(rng.integers(a, n)) + 1
    assert np.array_equal(tw.planar(a, b).dequantize(), bw.rows(a, b).dequantize())


def _weight(rng, t, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3)
    return formats.from_ggml(gguf.quants.quantize(w, gguf.GGMLQuantizationType[t]), t)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("scales", ["file", "formed"])
@settings(max_examples=8, deadline=None)
@given(
    t=st.sampled_from(NATIVE),
    digits=st.sampled_from([1, 2, "outliers"]),
    n=st.integers(1, 300),
    blocks=st.integers(1, 23),
    m=st.one_of(st.integers(1, 16), st.integers(17, 40)),
    seed=st.integers(0, 2**31),
)
def test_kernels_equal_the_float64_product_of_what_they_multiply(isa, scales, t, digits, n, blocks, m, seed):
    """The file's scales are held as float16 (Q4_0's minimum not at all); scales formed at
    load (products that are no float16) as float32: both layouts' kernels, on every
    instruction set this CPU runs (the whole grid of the file's layouts, every cell a
    parameter: tests/test_kernel_grid.py)."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    bw = _weight(rng, t, n, k)
    if scales == "formed":
        bw.d = bw.d * np.float32(1 + 2**-13)
        if bw.m is not None:
            bw.m = bw.m * np.float32(1 - 2**-13)
    outliers = digits == "outliers"
    tw = tiles.repack(bw, 2 if outliers else digits, outliers)
    want = {"Q4_0": "q40", "Q4_1": "q4", "Q8_0": "q8"}[t] if scales == "file" else {"Q8_0": "q8"}.get(t, "q4")
    assert tw.fmt == want + ("h" if scales == "file" else "")
    x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal((1, k)))).astype(np.float32)
    if outliers:  # a few values far out, in some rows' blocks only: the sparse digit's branch both ways
        at = rng.integers(0, k, size=rng.integers(0, 4))
        x[rng.integers(0, m, size=at.size), at] *= 40
    sparse = outliers and m <= int8.SMALL  # past 16 rows (prefill) int8o multiplies two full digits
    if digits == 1:
        q, d, _ = quantize(x)
        xf = dequantized_x(q, d)
    else:
        xq, xd = np.zeros((2 * m, k), np.int8), np.zeros((2 * m, blocks), np.float32)
        (quantize_rows_outliers if sparse else quantize_rows2)(x, xq, xd, np.zeros_like(xd))
        xf = dequantized_x(xq[0::2], xd[0::2]) + dequantized_x(xq[1::2], xd[1::2])
    ref = xf @ bw.dequantize().astype(np.float64).T
    y = int8.matmul(x, tw, isa)
    assert y.dtype == np.float32 and y.shape == (m, n)
    assert int8.matmul(x[:0], tw, isa).shape == (0, n)  # no rows (a prefill chunk wanting no logits)
    scale = np.abs(ref).max() + 1e-30
    assert np.abs(y - ref).max() <= 1e-5 * scale, np.abs(y - ref).max() / scale
    if isa == "amx":  # from 8 rows on AMX's tiles (int8o's too): avx512's numbers, bit for bit
        assert np.array_equal(y, int8.matmul(x, tw, "avx512"))
        if m > int8.SMALL and tw.digits == 2:  # prefill's chunk of 8 rows (long rows of x) too
            wide, int8.AMX_WIDE_K = int8.AMX_WIDE_K, 0
            try:
                assert int8.chunk("amx", 2, k) == 8 and np.array_equal(y, int8.matmul(x, tw, isa))
            finally:
                int8.AMX_WIDE_K = wide
    if m <= int8.SMALL:  # the bound form (the decode loop's) gives the same numbers
        y2 = np.full((m, n), np.nan, np.float32)
        int8.Bound(tw, isa)(x, y2)
        assert np.array_equal(y, y2)
    # a row's bits do not depend on the batch it came in (alone, a decode step, prefill),
    # int8o's within decode (up to 16 rows) and within prefill
    if outliers and not sparse:
        assert np.array_equal(int8.matmul(np.tile(x[-1:], (17, 1)), tw, isa)[0], y[-1])
    else:
        assert np.array_equal(int8.matmul(x[-1:], tw, isa)[0], y[-1])


def test_every_instruction_set_gives_the_same_integers():
    """avx2's 16-bit pair sums never saturate: its results equal the portable ones exactly
    (the float accumulation is the same code)."""
    rng = np.random.default_rng(7)
    for t in NATIVE:
        tw = tiles.repack(_weight(rng, t, 37, 32 * 11))
        x = (rng.standard_normal((5, 32 * 11)) * 50).astype(np.float32)
        x[:, ::7] = 127  # large values everywhere: the worst pair sums
        outs = [int8.matmul(x, tw, isa) for isa in RUNNABLE]
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], rtol=1e-6, atol=1e-6 * np.abs(outs[0]).max())


@pytest.mark.skipif("avx2" not in RUNNABLE, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("t", ["Q4_K", "Q6_K"])
def test_avx2_k_quant_prefill_kernels_sum_a_super_block_in_integers(t):
    """avx2's K-quant kernels for x two digits a scale per super-block (``whole``: prefill),
    rows 1-16: against the float64 product of the digits and the gguf package's values, on
    random blocks and on the worst case for their 16-bit steps (every quant at its largest,
    15 or 63, every digit at ±127: pair sums of 30480 and 32004, below 2¹⁵); the digits from
    quantize_rows2's ``whole`` (8 equal scales a super-block). Other instruction sets and
    int8o's sparse digit have no such kernel."""
    rng = np.random.default_rng(3)
    n, k = 21, 512
    raw = k_blocks(rng, t, n, k)
    worst = raw.reshape(-1, 144 if t == "Q4_K" else 210).copy()
    if t == "Q4_K":
        worst[:, 16:144] = 0xFF  # every nibble 15
    else:
        worst[:, 0:192] = 0xFF  # every quant 63
    for blocks, big in ((raw, False), (worst.reshape(raw.shape), True)):
        w64 = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[t]).astype(np.float64).reshape(n, k)
        tw = tiles.repack(formats.from_ggml(blocks, t), 2, True)
        assert tw.kind == t.lower().replace("_", "")
        T, nb = tw.qs.shape[0], k // 32
        for R in int8.KERNEL_ROWS:
            x = rng.standard_normal((R, k)).astype(np.float32)
            xq = np.zeros((2 * R, k), np.int8)
            xd = np.zeros((2 * R, nb), np.float32)
            xs = np.zeros((2 * R, k // tw.xs_group), np.float32)
            quantize_rows2(x, xq, xd, xs, "avx2", whole=True)
            assert np.array_equal(xd, np.repeat(xd[:, ::8], 8, axis=1))  # one scale a super-block
            if big:  # the largest sums: every digit ±127 (row by row), the sums per group to match
                xq[:] = np.where(np.arange(2 * R)[:, None] % 3 == 1, -127, 127)
                g = tw.xs_group
                per = xq.reshape(2 * R, k // g, g).astype(np.float64).sum(-1) * np.repeat(xd, 32 // g, axis=1)
                xs[:] = 0
                xs[0::2] = (per[0::2] + per[1::2]).astype(np.float32)
            ref = dequantized(xq, xd, 2) @ w64.T
            y = np.full((R, T * 8), np.nan, np.float32)
            f = jit.functions([(tw.fmt, "avx2", R, 2, 32, False, True)])[0]
            f(tw.qs.ctypes.data, tw.d.ctypes.data, tw.m.ctypes.data, xq.ctypes.data, xd.ctypes.data,
              xs.ctypes.data, y.ctypes.data, T, nb, R, T * 8)  # fmt: skip
            err = np.abs(y[:, :n] - ref).max() / np.abs(ref).max()
            assert err <= 1e-5, f"{t} R={R} {'worst case' if big else 'random'}: {err:.2e}"
    for spec in (("q4k", "avx512", 8, 2, 32, False, True), ("q4k", "avx2", 8, 2, 32, True, True)):
        with pytest.raises(ValueError, match="no int8 kernel"):
            jit.functions([spec])


@pytest.mark.parametrize(
    "cpu_name,isa,instruction",
    [("sapphirerapids", "avx512", "vpdpbusd"), ("znver4", "avx512", "vpdpbusd"),
     ("sapphirerapids", "vnni", "vpdpbusd"), ("alderlake", "vnni", "vpdpbusd"), ("znver4", "vnni", "vpdpbusd"),
     ("haswell", "avx2", "vpmaddubsw"), ("x86-64", "portable", "pmaddwd")],
)  # fmt: skip
def test_each_instruction_set_compiles_to_its_instructions(cpu_name, isa, instruction):
    """What a CPU this machine may lack would run: the kernels compiled for it use the
    instruction (AVX512-VNNI + VL, AVX-VNNI; avx512 on 512-bit registers), and the portable
    ones use no AVX at all."""
    if not jit.target_machine("portable").triple.startswith("x86_64"):
        pytest.skip("x86 kernels")
    whole = [("q6k", isa, 8, 2, 32, False, True)] if isa == "avx2" else []  # prefill's super-block kernel
    asm = jit.assembly([("q4", isa, 1, 1), ("q8", isa, 4, 2), ("q4k", isa, 8, 2, 32, True), *whole], cpu_name, "")
    assert instruction in asm
    if isa == "portable":
        assert "ymm" not in asm and "vpdpbusd" not in asm
    if isa not in ("vnni", "avx512"):
        assert "vpdpbusd" not in asm
    assert ("zmm" in asm) == (isa == "avx512")
    # software prefetch of the weights in the decode kernels: each of a (tile, block)'s 3
    # cache lines of q6k in the 1-row kernel, into L1 and (further on) into L2, and in
    # int8o's 8-row one; none in the 8 rows of a prefill chunk (two dense digits)
    specs = [("q6k", isa, 1, 1), ("q6k", isa, 8, 2, 32, True), ("q6k", isa, 8, 2)]
    one, sparse, prefill = (jit.assembly([s], cpu_name, "") for s in specs)
    fewer = [(a.count("prefetcht0"), a.count("prefetcht1")) for a in (one, sparse, prefill)]
    assert min(fewer[0]) >= 3 and min(fewer[1]) >= 3 and fewer[2] == (0, 0), fewer


def test_amx_kernels_compile_to_tile_instructions():
    """Prefill on AMX (what a Sapphire Rapids runs, compiled on any x86 host): unsigned
    weights by tdpbsud, q8's signed ones by tdpbssd, the tiles configured and released."""
    if not jit.target_machine("portable").triple.startswith("x86_64"):
        pytest.skip("x86 kernels")
    specs = [("q40h", "amx", 16, 1), ("q4k", "amx", 8, 2), ("q6kh", "amx", 16, 1), ("q8", "amx", 8, 2, 16)]
    specs.append(("q4", "amx", 16, 2, 32, True))  # int8o: the outliers' digit on a branch
    specs.append(("q4", "amx", 8, 2, 32, True))  # ... or, at 8 rows, per call, dense: two bodies
    asm = jit.assembly(specs, "sapphirerapids", "")
    assert asm.count("ldtilecfg") == 7 and asm.count("tilerelease") in (6, 7)  # the two bodies may share one
    assert asm.count("tdpbsud") >= 3 and asm.count("tdpbssd") >= 1 and "vpdpbusd" not in asm
    with pytest.raises(ValueError, match="apart"):
        jit.assembly([("q4", "amx", 16, 1), ("q4", "avx512", 16, 1)], "sapphirerapids", "")
    with pytest.raises(ValueError, match="no AMX kernel"):
        jit.assembly([("q4", "amx", 4, 1)], "sapphirerapids", "")  # 4 rows of x fill no tile


@pytest.mark.parametrize("isa", [i for i in RUNNABLE if i != "amx"])
@pytest.mark.parametrize("t", ["Q4_1", "Q4_K", "Q6_K"])
def test_a_prefills_last_chunk_takes_a_smaller_kernel_with_the_same_bits(isa, t):
    """Prefill's last chunk of fewer rows runs the kernel of the next row count up (1, 2, 4,
    8: int8.prefill_kernels) instead of the full chunk's: every row of M = 17..32 rows has
    the bits it has in a prefill of 32 rows (full chunks only), int8o's two digits."""
    rng = np.random.default_rng(11)
    n, k = 40, 512
    bw = _weight(rng, t, n, k) if t == "Q4_1" else formats.from_ggml(k_blocks(rng, t, n, k), t)
    tw = tiles.repack(bw, 2, True)
    x = rng.standard_normal((32, k)).astype(np.float32)
    full = int8.matmul(x, tw, isa)
    tails = int8.prefill_kernels(tw.fmt, 2, isa, tw.group, k)
    assert len(set(tails[1:].tolist())) > 1, tails  # the tails' kernels are not all the full chunk's
    for m in range(17, 33):
        assert np.array_equal(int8.matmul(x[:m], tw, isa), full[:m]), m


@pytest.mark.skipif("amx" not in RUNNABLE, reason="no AMX on this CPU")
@pytest.mark.parametrize("t,R,m", [("Q4_1", 8, 8), ("Q4_K", 8, 5), ("Q6_K", 8, 8)])
def test_amx_int8o_bodies_give_the_vector_kernels_bits(monkeypatch, t, R, m):
    """int8o's AMX kernel picks per call, by the share of blocks with some row's outlier,
    between the outliers' digit on a branch and both digits in one tile product: each
    body, forced, gives avx512's numbers bit for bit, with outliers in a few blocks (the
    branch both ways) and rows past M (left from an earlier x) not stored."""
    from mpitp.kernels.ir import amx as amx_ir

    rng = np.random.default_rng(7)
    n, k = 40, 512 if t != "Q4_1" else 288
    bw = _weight(rng, t, n, k) if t == "Q4_1" else formats.from_ggml(k_blocks(rng, t, n, k), t)
    tw = tiles.repack(bw, 2, True)
    x = rng.standard_normal((R, k)).astype(np.float32)
    x[rng.integers(0, R, 4), rng.integers(0, k, 4)] *= 40  # outliers in a few blocks only
    want = np.empty((m, n), np.float32)
    int8.Bound(tw, "avx512")(x[:m], want)
    bound = int8.Bound(tw, "amx")
    bound.quantize(x)  # R rows: those past m stay in the buffers
    bound.quantize(x[:m])
    for dense_from in ((0, 1), (1, 0)):  # every call dense; none
        monkeypatch.setattr(amx_ir, "DENSE_FROM", {1: dense_from, 2: dense_from})
        names, ir = amx_ir.module([(tw.fmt, "amx", R, 2, tw.group, True)])
        with jit._LOCK:
            (at,) = jit._addresses(ir, "amx", names)
        y = np.full((m, tw.qs.shape[0] * 8), np.nan, np.float32)
        jit.PROTO(at)(*bound.wp, *bound.xp, y.ctypes.data, tw.qs.shape[0], k // 32, m, y.shape[1])
        assert np.array_equal(y[:, :n], want), dense_from


def test_the_instruction_sets_table():
    """cpu.FACTS as the kernels read it: which vector kernels take few and many rows of x,
    prefill's rows a call, where AMX's tiles take over, what is compiled for the baseline."""
    lanes = {i: [int8.lanes(i, r) for r in (1, 2, 4, 8, 16)] for i in cpu.ISAS}
    assert lanes["amx"] == lanes["avx512"] == ["vnni", "vnni", "avx512", "avx512", "avx512"]
    assert all(lanes[i] == [i] * 5 for i in ("vnni", "avx2", "portable"))
    assert [int8.chunk(i) for i in cpu.ISAS] == [16, 8, 16, 8, 16]
    assert (int8.chunk("amx", 2, int8.AMX_WIDE_K), int8.chunk("amx", 2, int8.AMX_WIDE_K + 32)) == (16, 8)
    assert [cpu.FACTS[i].tiles_from for i in cpu.ISAS] == [8, None, None, None, None]
    assert (
        [i for i in cpu.ISAS if cpu.FACTS[i].baseline] == [i for i in cpu.ISAS if not cpu.FACTS[i].f16c] == ["portable"]
    )
    assert jit.target("portable")[1] == "x86-64" or not jit.target("portable")[0].startswith("x86_64")


def test_the_choice_of_instruction_set(monkeypatch):
    have = cpu.supported()
    assert have[-1] == "portable" and cpu.isa({}) == have[0]
    assert cpu.isa({"MPITP_ISA": "portable"}) == "portable"
    assert cpu.supported(frozenset({"avx2", "avxvnni"}))[0] == "vnni"
    wide = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512vnni"})
    assert cpu.supported(wide)[:2] == ("avx512", "vnni")
    assert cpu.supported(wide | {"amx-tile", "amx-int8"})[:2] == ("amx", "avx512")  # prefill on tiles
    assert cpu.supported(wide | {"amx-tile", "amx-bf16"})[0] == "avx512"  # no integer tiles
    assert cpu.supported(wide - {"avx512bw"})[0] == "vnni"  # 512-bit byte shifts need BW
    assert cpu.supported(frozenset({"avx2", "avx512vnni", "avx512vl"}))[0] == "vnni"
    assert cpu.supported(frozenset({"avx2", "avx512vnni"}))[0] == "avx2"  # 256-bit VNNI needs VL
    assert cpu.supported(frozenset({"sse4.2"})) == ("portable",)
    with pytest.raises(ValueError, match="choose one of"):
        cpu.isa({"MPITP_ISA": "sse9"})
    if "vnni" not in have:
        with pytest.raises(ValueError, match="has only"):
            cpu.isa({"MPITP_ISA": "vnni"})
    assert str(cpu.activations("float32")) == "float32" and str(cpu.activations("int8")) == "int8"
    assert cpu.activations(None, {"MPITP_ACTIVATIONS": "int8"}) == cpu.Activations("int8")
    assert cpu.activations("auto", {}).name == ("int8o" if have[0] != "portable" else "float32")
    assert cpu.activations(None, {"MPITP_ISA": "portable"}).name == "float32"  # auto: no integer instructions
    o, f = cpu.activations("int8o"), cpu.activations("float32")  # what travels to the kernels
    assert (o.int8, o.digits, o.outliers) == (True, 2, True) and (f.int8, f.digits) == (False, 0)
    with pytest.raises(ValueError, match="one of"):
        cpu.activations("int4")


@settings(max_examples=20, deadline=None)
@given(
    t=st.sampled_from(["Q4_K", "Q6_K", "Q5_0"]),
    n=st.integers(1, 40),
    supers=st.integers(1, 4),
    m=st.sampled_from([1, 3, 16, 21]),
    isa=st.sampled_from(RUNNABLE),
    seed=st.integers(0, 2**31),
)
def test_k_quants_are_repacked_exactly_and_multiplied(t, n, supers, m, isa, seed):
    """Q4_K -> q4 (per-32 d·sc, -dmin·m), Q6_K -> q8 with a scale per 16, Q5_0 -> q8: the
    values equal the gguf package's dequantization bit for bit, a column cut on any
    32-boundary inside a super-block too; both activation paths multiply them right. In
    tiles, Q4_K and Q6_K keep their integer scales and float16 super-block scales (q4k, q6k:
    within 1.1x the file's bytes, padding rows to 8 aside); a cut inside a super-block takes
    the planar scales."""
    rng = np.random.default_rng(seed)
    k = 256 * supers
    raw = k_blocks(rng, t, n, k)
    ref_w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t]).astype(np.float32).reshape(n, k)
    bw = formats.from_ggml(raw, t)
    assert bw.source == t and bw.shape == (n, k) and np.array_equal(bw.dequantize(), ref_w)
    a = 32 * int(rng.integers(0, k // 32))
    b = 32 * int(rng.integers(a // 32 + 1, k // 32 + 1))
    assert np.array_equal(bw.cols(a, b).contiguous().dequantize(), ref_w[:, a:b])
    x = rng.standard_normal((m, k)).astype(np.float32)
    exact = x.astype(np.float64) @ ref_w.astype(np.float64).T
    from mpitp.kernels import matmul as mm

    y = mm.matmul(x, bw)  # float32 activations: up to summation order
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
    q, d, _ = quantize(x)
    ref = dequantized_x(q, d) @ ref_w.astype(np.float64).T
    cut = bw.cols(a, b).contiguous()
    for w, cols in ((bw, slice(None)), (cut, slice(a, b))):
        tw = tiles.repack(w)
        compact = t != "Q5_0" and w.ks is not None
        assert tw.kind == {"Q4_K": "q4k", "Q6_K": "q6k"}[t] if compact else tw.kind in ("q4", "q8")
        if compact:  # the file's float16 super-block scales, as float16
            assert tw.fmt == tw.kind + "h"
            assert tw.nbytes <= 1.1 * raw.nbytes * w.shape[1] / k * -(-n // 8) * 8 / n
        assert np.array_equal(tw.dequantize(), ref_w[:, cols])
        assert np.array_equal(tw.planar(n // 2, n).dequantize(), ref_w[n // 2 :, cols])
        xs = np.ascontiguousarray(x[:, cols])
        q, d, _ = quantize(xs)
        ref = dequantized_x(q, d) @ ref_w[:, cols].astype(np.float64).T
        y8 = int8.matmul(xs, tw, isa)
        assert np.abs(y8 - ref).max() <= 1e-5 * np.abs(ref).max()
        for digits, outliers in ((1, False), (2, False), (2, True)):  # the bound (decode) form, two digits too
            if m <= int8.SMALL:
                tw2 = tiles.repack(w, digits, outliers)
                y2 = np.full((m, n), np.nan, np.float32)
                int8.Bound(tw2, isa)(xs, y2)
                assert np.array_equal(y2, int8.matmul(xs, tw2, isa))
                if isa == "amx":  # 16 rows on the tiles, 3 and 1 not: all avx512's bits
                    assert np.array_equal(y2, int8.matmul(xs, tw2, "avx512"))


def test_mixed_pieces_of_a_merged_weight_are_kept_exactly():
    """A merged layer (qkv) of a Q4_K_M file: Q4_K q and k beside a Q6_K v and a Q8_0 piece.
    Runs of one kind are joined (q4: q and k; q8: the Q6_K and Q8_0 rows, a per-32 scale
    repeated beside the per-16 ones), the runs kept side by side, every value the file's
    bit for bit; each piece's kernel writes its columns: the float32 path up to summation
    order, the int8 tiles (q4k for the Q4_K run) against the float64 product of what they
    multiply, the bound (decode) form equal to the matmul."""
    from mpitp.kernels import matmul as mm

    rng = np.random.default_rng(11)
    k = 512
    q = formats.from_ggml(k_blocks(rng, "Q4_K", 24, k), "Q4_K")
    kk = formats.from_ggml(k_blocks(rng, "Q4_K", 8, k), "Q4_K")
    v6 = formats.from_ggml(k_blocks(rng, "Q6_K", 8, k), "Q6_K")
    v8 = formats.from_ggml(
        gguf.quants.quantize(rng.standard_normal((5, k)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0), "Q8_0"
    )
    joined = formats.join_pieces([q, kk, v6, v8])
    assert joined.layout == "pieces" and [p.kind for p in joined.parts] == ["q4", "q8"]
    assert joined.shape == (45, k) and joined.source == "Q4_K+Q6_K+Q8_0"
    want = np.concatenate([w.dequantize() for w in (q, kk, v6, v8)])
    assert np.array_equal(joined.dequantize(), want)
    x = rng.standard_normal((3, k)).astype(np.float32)
    exact = x.astype(np.float64) @ want.astype(np.float64).T
    assert np.abs(mm.matmul(x, joined) - exact).max() <= 1e-5 * np.abs(exact).max()
    tiled = formats.Pieces([tiles.repack(p) for p in joined.parts])
    assert tiled.parts[0].kind == "q4k" and np.array_equal(tiled.dequantize(), want)
    qx, dx, _ = quantize(x)
    ref = dequantized_x(qx, dx) @ want.astype(np.float64).T
    y = mm.matmul(x, tiled)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    f, rows = mm.bind(tiled)
    y2 = np.full((3, 45), np.nan, np.float32)
    f(x, y2)
    assert rows == int8.SMALL and np.array_equal(y, y2)
    assert formats.join_pieces([q, kk]).layout == "planar"  # one kind: one weight


@pytest.mark.parametrize("t,digits", [("Q4_1", 2), ("Q8_0", 1), ("Q4_0", 1)])
def test_threads_split_the_output_rows_and_change_no_bit(request, monkeypatch, t, digits):
    """--threads N: each thread a contiguous range of tiles (prefill: of column spans);
    every row is the one-thread kernel's on the same data, so equal bit for bit, for tile
    counts that do not divide (1, 3, 37 tiles; 300 rows: a part-filled last tile) and
    more threads than tiles. Where numba's pool is smaller than 3 (its size is the core
    count: 2 in CI), the test runs again in a child whose pool has 3 (NUMBA_NUM_THREADS),
    so 3 threads run on 2 cores, oversubscribed, instead of being passed over."""
    import os
    import subprocess
    import sys

    from mpitp.kernels import parallel

    if parallel.numba.config.NUMBA_NUM_THREADS < 3:
        env = dict(os.environ, NUMBA_NUM_THREADS="3")
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=request.config.rootpath)
        assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
        return

    rng = np.random.default_rng(7)
    monkeypatch.setattr(parallel, "MIN_WORK", 0)  # split even the smallest, to cut odd counts
    for n, blocks in [(5, 3), (24, 7), (296, 5), (300, 9)]:
        tw = tiles.repack(_weight(rng, t, n, 32 * blocks), digits)
        for m in (1, 3, 16, 17, 70):
            x = rng.standard_normal((m, 32 * blocks)).astype(np.float32)
            monkeypatch.setenv("MPITP_THREADS", "1")
            one = int8.matmul(x, tw)
            for threads in ("2", "3"):
                monkeypatch.setenv("MPITP_THREADS", threads)
                assert np.array_equal(int8.matmul(x, tw), one), (n, blocks, m, threads)
                if m <= int8.SMALL:
                    y = np.full((m, n), np.nan, np.float32)
                    b = int8.Bound(tw)
                    assert b.threads == int(threads)
                    b(x, y)
                    assert np.array_equal(y, one), (n, blocks, m, threads)


def test_threads_per_rank_are_checked(monkeypatch):
    from mpitp.kernels import parallel
    from mpitp.kernels.parallel import ThreadsError as ConfigError

    with pytest.raises(ConfigError, match="at least 1, got 0"):
        parallel.check(0)
    top = parallel.numba.config.NUMBA_NUM_THREADS
    with pytest.raises(ConfigError, match=f"{top + 1} threads per rank asked, but numba's pool has {top}"):
        parallel.check(top + 1)
    monkeypatch.setenv("MPITP_THREADS", "0")
    from mpitp.settings import SettingsError, current

    with pytest.raises(SettingsError, match="MPITP_THREADS"):
        current()


def test_grouped_experts_of_two_widths_give_their_own_kernels_bits():
    """--moe tp turns an uneven cut from expert to expert (MoEPlan.cut: 512 or 256 of 768
    columns over 2 ranks), so one rank's experts differ in width: the one compiled call over
    them (mpitp.kernels.experts) gives the bits of each expert's own bound kernels, SwiGLU and
    weighted sum, expert by expert in ascending order, an outlier in x included."""
    from mpitp.kernels.decode import swiglu
    from mpitp.kernels.experts import Grouped

    rng = np.random.default_rng(11)
    H, widths, k = 256, [512, 256, 512, 256, 256], 3

    def tiled(t, n, kk):  # int8o's tiles of a K-quant weight (the Qwen3 MoE file's formats)
        return tiles.repack(formats.from_ggml(k_blocks(rng, t, n, kk), t), 2, True)

    held = {e: (tiled("Q4_K", 2 * i, H), tiled("Q6_K", H, i)) for e, i in enumerate(widths)}
    held.pop(1)  # an expert this rank does not hold
    group = Grouped.of(held, len(widths))
    assert group is not None, "experts of two widths were not bound for one call"
    for rows in (1, 3, 16):
        x = rng.standard_normal((rows, H)).astype(np.float32)
        x[0, 3] = 40.0
        top = np.array([rng.choice(len(widths), k, replace=False) for _ in range(rows)])
        w = rng.random((rows, k)).astype(np.float32)
        y = np.zeros((rows, H), np.float32)
        group(x, top, w, y)
        want = np.zeros_like(y)
        for e in np.unique(top):
            if e not in held:
                continue
            r, slot = np.nonzero(top == e)
            gu_w, dn_w = held[e]
            gu = np.empty((r.size, gu_w.shape[0]), np.float32)
            int8.Bound(gu_w)(np.ascontiguousarray(x[r]), gu)
            act = np.empty((r.size, gu.shape[1] // 2), np.float32)
            swiglu(gu, act)
            out = np.empty((r.size, H), np.float32)
            int8.Bound(dn_w)(act, out)
            want[r] += out * w[r, slot][:, None]
        assert np.array_equal(y, want), f"{rows} rows: |grouped - own kernels| = {np.abs(y - want).max()}"
