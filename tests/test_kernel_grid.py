"""The int8 kernels' whole grid, as parameters, not draws: every instruction set this CPU
runs × activations (int8, int8x2, int8o) × rows of x (1, 2, 4, 8, 16: the decode kernels;
21: prefill's tiles) × weight format (Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K, a merged Q4_K +
Q6_K layer) × threads (1, 2). Hypothesis varies only the shapes and the data inside a cell.

Each cell is held to two independent references (tests/int8_reference.py):
- the digits the kernels multiplied (the bound decode buffers, or prefill's quantizer)
  equal a NumPy statement of the rule bit for bit (amax, the cut, outliers; avx2's K-quant
  prefill: two digits a scale per super-block of 256);
- y within 1e-5 · max|y| of the float64 product of those digits and the ``gguf``
  package's dequantization of the file's blocks.
int8o's cells put outliers in some blocks and none in others, so its sparse digit's
branch is taken both ways. The bound form (decode's) equals the matmul bit for bit, and a
row's bits do not depend on the batch it came in. Instruction sets the CPU lacks are
compiled and their machine code checked (tests/test_int8.py); the session's summary says
which ran here (tests/conftest.py)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from int8_reference import LIMIT, dequantized, k_blocks, outlier_mask, quantize, sums

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from mpitp.kernels import cpu, int8, parallel  # noqa: E402
from mpitp.kernels import matmul as mm  # noqa: E402
from mpitp.kernels.quantize import LIMIT as KERNEL_LIMIT  # noqa: E402
from mpitp.kernels.quantize import quantize_rows, quantize_rows2  # noqa: E402
from mpitp.kernels.weights import formats, tiles  # noqa: E402

RUNNABLE = list(cpu.supported())
SCHEMES = dict(cpu.SCHEMES)  # int8, int8o, int8x2: (digits, outliers)
ROWS = [1, 2, 4, 8, 16, 21]
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "Q4_K+Q6_K"]
THREADS = [1, 2]
EXAMPLES = 3  # per cell; 1,000-odd cells


def test_the_reference_states_the_kernels_rule():
    assert LIMIT == KERNEL_LIMIT


def _weight(rng, fmt: str, n: int, k: int):
    """(the layer as mpitp holds it from the file, the gguf package's float64 values)."""
    if "+" in fmt:  # a merged layer of two formats (Q4_K_M's qkv: q, k in Q4_K beside v in Q6_K)
        a = max(1, n // 2)
        parts = [_weight(rng, t, r, k) for t, r in zip(fmt.split("+"), (a, n - a))]
        return formats.join_pieces([p for p, _ in parts]), np.concatenate([w for _, w in parts])
    if fmt in ("Q4_K", "Q6_K"):
        raw = k_blocks(rng, fmt, n, k)
    else:
        w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(rng.uniform(0.01, 3))
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).astype(np.float64).reshape(n, k)
    return formats.from_ggml(raw, fmt), ref


def _tiled(bw, digits: int, outliers: bool):
    if getattr(bw, "layout", "") == "pieces":
        return formats.Pieces([tiles.repack(p, digits, outliers) for p in bw.parts])
    return tiles.repack(bw, digits, outliers)


def _bound_digits(f, D: int, m: int):
    """Each piece's (xq, xd, xs) as the bound kernels last quantized x into them."""
    parts = f.parts if isinstance(f, mm.Pieces) else [f]
    return [(p.xq[: D * m], p.xd[: D * m], p.xs[: D * m], p.w.xs_group) for p in parts]


def _prefill_digits(x, tw, D: int, whole: bool):
    """Prefill's quantizer on x, as int8.matmul calls it for each piece (``whole``: a scale
    per 256, avx2's K-quants)."""
    out = []
    for w in tw.parts if getattr(tw, "layout", "") == "pieces" else [tw]:
        M, K = x.shape
        xq, xd = np.zeros((D * M, K), np.int8), np.zeros((D * M, K // 32), np.float32)
        xs = np.zeros((D * M, K // w.xs_group), np.float32)
        if D == 1:
            quantize_rows(x, xq, xd, xs)
        else:
            quantize_rows2(x, xq, xd, xs, None, whole)
        out.append((xq, xd, xs, w.xs_group))
    return out


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("isa", RUNNABLE)
def test_cell(monkeypatch, isa, scheme, m, fmt, threads):
    if threads > parallel.numba.config.NUMBA_NUM_THREADS:  # numba's pool: test_threads.py runs more in a child
        pytest.skip(f"numba's pool has {parallel.numba.config.NUMBA_NUM_THREADS} threads")
    monkeypatch.setenv("MPITP_ISA", isa)  # every kernel and quantizer below is this instruction set's
    monkeypatch.setenv("MPITP_THREADS", str(threads))
    monkeypatch.setattr(parallel, "MIN_WORK", 0)  # split even these small weights over the threads
    digits, outliers = SCHEMES[scheme]
    decode = m <= int8.SMALL
    rule = scheme if decode or scheme == "int8" else "int8x2"  # past 16 rows int8o multiplies two full digits
    k_quant = fmt.startswith(("Q4_K", "Q6_K"))
    if rule == "int8x2" and not decode and k_quant and cpu.FACTS[isa].whole_k:  # avx2's K-quant prefill
        rule = "int8x2/256"

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        n=st.integers(2, 40),
        blocks=st.integers(1, 2) if k_quant else st.integers(2, 12),
        seed=st.integers(0, 2**31),
    )
    def cell(n, blocks, seed):
        rng = np.random.default_rng(seed)
        k = blocks * (256 if k_quant else 32)
        bw, w64 = _weight(rng, fmt, n, k)
        tw = _tiled(bw, digits, outliers)
        x = (rng.standard_normal((m, k)) * np.exp(rng.standard_normal((1, k)) * 0.3)).astype(np.float32)
        nb = k // 32
        for b in rng.choice(nb, size=rng.integers(1, nb), replace=False):  # an outlier in some blocks, not all
            r, c = rng.integers(0, m), 32 * b + rng.integers(0, 32)
            x[r, c] = rng.choice([-1, 1]) * rng.uniform(10, 40) * np.abs(x[r, 32 * b : 32 * b + 32]).mean()
        big, cut = outlier_mask(x)
        ratio = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32) / np.where(cut > 0, cut, 1)[..., None]
        assume(not (np.abs(ratio - 1) < 1e-9).any())  # no value on the cut itself (summation order decides it)
        if rule == "int8o":
            per_block = big.reshape(m, -1, 32).any(-1)
            assume(not per_block.all())  # the sparse digit's branch both ways (some block of a row has none)
            assert per_block.any()

        qr, dr = quantize(x, rule)
        D = 1 if rule == "int8" else 2
        ref = dequantized(qr, dr, D) @ w64.T

        y = mm.matmul(x, tw)
        assert y.dtype == np.float32 and y.shape == (m, n)
        scale = np.abs(ref).max() + 1e-30
        err = np.abs(y - ref).max() / scale
        assert err <= 1e-5, f"{isa} {scheme} m={m} {fmt} threads={threads}: |y - ref| = {err:.2e} of max|y|"

        if decode:  # the bound form (the decode loop's): the same numbers, and the digits it multiplied
            f, rows = mm.bind(tw)
            y2 = np.full((m, n), np.nan, np.float32)
            f(x, y2)
            assert rows == int8.SMALL and np.array_equal(y2, y)
            got = _bound_digits(f, D, m)
            if threads > 1:
                assert all(p.threads == threads for p in (f.parts if isinstance(f, mm.Pieces) else [f]))
        else:
            got = _prefill_digits(x, tw, D, rule == "int8x2/256")
        for xq, xd, xs, group in got:  # each piece's digits: the rule's, bit for bit
            assert np.array_equal(xq, qr), f"{isa} {rule}: q differs in {np.count_nonzero(xq != qr)} values"
            assert np.array_equal(xd, dr), f"{isa} {rule}: d differs in {np.count_nonzero(xd != dr)} blocks"
            want = sums(qr, dr, D, group)
            np.testing.assert_allclose(xs[0::D], want, rtol=2e-6, atol=1e-6 * np.abs(want).max() + 1e-30)

        # a row's bits do not depend on the batch it came in (decode's rows alone; prefill's within prefill)
        last = x[-1:] if decode or rule == "int8" else np.tile(x[-1:], (int8.SMALL + 1, 1))
        assert np.array_equal(mm.matmul(last, tw)[0], y[-1])
        if isa == "amx":  # AMX's tiles give avx512's numbers bit for bit
            monkeypatch.setenv("MPITP_ISA", "avx512")
            assert np.array_equal(mm.matmul(x, tw), y)
            monkeypatch.setenv("MPITP_ISA", isa)

    cell()


@pytest.mark.parametrize("isa", RUNNABLE)
def test_zero_rows_give_an_empty_product(monkeypatch, isa):
    """A prefill chunk that wants no logits: no rows in, none out, on every instruction set."""
    monkeypatch.setenv("MPITP_ISA", isa)
    bw, _ = _weight(np.random.default_rng(1), "Q4_1", 9, 64)
    for digits, outliers in SCHEMES.values():
        tw = tiles.repack(bw, digits, outliers)
        assert int8.matmul(np.zeros((0, 64), np.float32), tw).shape == (0, 9)
