"""The block-format kernels (:mod:`mpitp.kernels`) against the ``gguf`` package's own
quantizers and dequantizers and a float64 NumPy matmul, for shapes that are multiples of
nothing convenient: rows of x 1-16 (the decode kernels) and more (tiles + BLAS)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from mpitp.kernels import cpu  # noqa: E402
from mpitp.kernels import matmul as mm  # noqa: E402
from mpitp.kernels.weights import formats  # noqa: E402
from mpitp.kernels.weights.dequant import take  # noqa: E402

NATIVE = ["Q4_0", "Q4_1", "Q8_0"]
RUNNABLE = list(cpu.supported())  # this CPU's instruction sets: decode attention's core on each


def ggml(w, t):
    """(raw bytes, the gguf package's float32 dequantization) of w quantized to type t."""
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[t])
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t]).astype(np.float32)


def magnitude(bw):
    """|d·q| + |m| per weight: the size of the terms the kernel adds (q4 adds the minimum's
    term apart, so a weight near zero can still carry large terms)."""
    d = np.repeat(np.abs(bw.d), 32, axis=1)
    if bw.kind == "q8":
        return d * np.abs(bw.qs.astype(np.float32))
    b = bw.dequantize() - np.repeat(bw.m, 32, axis=1)
    return np.abs(b) + np.repeat(np.abs(bw.m), 32, axis=1)


def close(y, ref, x, bw):
    """Any float32 summation order of K terms errs by at most K·u·Σ|terms| (u = 2⁻²⁴)."""
    k = x.shape[-1]
    bound = 2 * k * 2.0**-24 * (np.abs(x.astype(np.float64)) @ magnitude(bw).T.astype(np.float64)) + 1e-30
    worst = (np.abs(y - ref) / bound).max()
    assert worst <= 1, worst


@settings(max_examples=40, deadline=None)
@given(
    t=st.sampled_from(NATIVE),
    n=st.integers(1, 300),
    blocks=st.integers(1, 23),
    m=st.one_of(st.integers(1, 16), st.integers(17, 40)),
    seed=st.integers(0, 2**31),
)
def test_matmul_equals_the_dequantized_product(t, n, blocks, m, seed):
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3)
    raw, deq = ggml(w, t)
    bw = formats.from_ggml(raw, t)
    assert bw.shape == (n, k) and np.array_equal(bw.dequantize(), deq)  # the file's values, exactly
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = mm.matmul(x, bw)
    assert y.dtype == np.float32 and y.shape == (m, n)
    close(y, x.astype(np.float64) @ deq.T.astype(np.float64), x, bw)


@pytest.mark.parametrize("t", NATIVE)
def test_batched_leading_dims_and_non_contiguous_x(t):
    rng = np.random.default_rng(1)
    raw, deq = ggml(rng.standard_normal((70, 96)).astype(np.float32), t)
    bw = formats.from_ggml(raw, t)
    x = rng.standard_normal((3, 2, 192)).astype(np.float32)[..., ::2]  # strided
    close(mm.matmul(x, bw), x.astype(np.float64) @ deq.T.astype(np.float64), x, bw)


@pytest.mark.parametrize("t", NATIVE)
def test_row_and_block_column_slices(t):
    rng = np.random.default_rng(2)
    raw, deq = ggml(rng.standard_normal((50, 32 * 9)).astype(np.float32), t)
    bw = formats.from_ggml(raw, t)
    assert np.array_equal(bw.rows(7, 31).dequantize(), deq[7:31])
    assert np.array_equal(bw.cols(64, 224).dequantize(), deq[:, 64:224])
    with pytest.raises(ValueError, match="block boundaries"):
        bw.cols(10, 64)
    both = formats.concat_rows([bw.rows(0, 20), bw.rows(20, 50)])
    assert np.array_equal(both.dequantize(), deq)


@pytest.mark.parametrize("t", NATIVE)
def test_take_is_the_embedding_lookup(t):
    rng = np.random.default_rng(3)
    raw, deq = ggml(rng.standard_normal((40, 64)).astype(np.float32), t)
    bw = formats.from_ggml(raw, t)
    ids = np.array([3, -1, 39, 0, 3], np.int64)
    out = take(bw, ids)
    assert np.array_equal(out[[0, 2, 3, 4]], deq[[3, 39, 0, 3]]) and not out[1].any()


def test_quantize_q8_0_is_ggmls():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((33, 160)).astype(np.float32)
    w[3, :32] = 0  # an all-zero block: d = 0
    raw, deq = ggml(w, "Q8_0")
    mine = formats.quantize_q8_0(w)
    assert np.array_equal(mine.dequantize(), deq)
    assert np.array_equal(mine.qs, formats.from_ggml(raw, "Q8_0").qs)


def k_quant(t, rows, superblocks, rng):
    """Random bytes of a K-quant tensor with finite fp16 scales where its layout has them."""
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
    raw = rng.integers(0, 256, (rows, superblocks, size), dtype=np.uint8)
    scales = lambda n: rng.uniform(1e-3, 2e-2, (rows, superblocks, n)).astype(np.float16).view(np.uint8)
    if t == "Q6_K":  # ql, qh, int8 scales, then d
        raw[..., -2:] = scales(1)
    elif t == "Q2_K":  # scales, qs, then d, dmin
        raw[..., -4:] = scales(2)
    else:  # Q4_K, Q5_K: d, dmin first
        raw[..., :4] = scales(2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("t", ["Q5_K", "Q2_K"])
def test_other_k_quants_become_q8_0_within_half_a_step(t):
    """K-quants with no exact repack (Q4_K, Q6_K have one: tests/test_int8.py) are
    converted once at load: each value within half a Q8_0 step (d = amax/127 of its block),
    plus the step's own rounding to fp16 (q·|d - fp16(d)| <= 127·d·2⁻¹¹)."""
    rng = np.random.default_rng(5)
    raw = k_quant(t, 12, 3, rng)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t]).astype(np.float32)
    bw = formats.from_ggml(raw, t)
    assert bw.kind == "q8" and bw.source == f"{t}->Q8_0" and bw.shape == ref.shape
    got = bw.dequantize()
    amax = np.abs(ref.reshape(12, -1, 32)).max(-1, keepdims=True)
    err = np.abs(got - ref).reshape(12, -1, 32)
    assert (err <= amax / 127 * (0.5 + 127 * 2.0**-11) + 1e-7).all()
    x = rng.standard_normal((3, ref.shape[1])).astype(np.float32)
    close(mm.matmul(x, bw), x.astype(np.float64) @ got.T.astype(np.float64), x, bw)


HALF = ["F16", "BF16"]


def half_file(w, t):
    """(the tensor's bytes as the gguf package writes them, its float32 values)."""
    raw, deq = ggml(w, t)
    return np.ascontiguousarray(raw).view(np.uint8).reshape(w.shape[0], -1), deq


@settings(max_examples=40, deadline=None)
@given(
    t=st.sampled_from(HALF),
    n=st.integers(1, 200),
    k=st.integers(1, 700),  # any width: 16-bit weights have no blocks
    m=st.one_of(st.integers(1, 16), st.integers(17, 40)),
    seed=st.integers(0, 2**31),
)
def test_half_matmul_equals_the_float32_product(t, n, k, m, seed):
    """F16/BF16 kept at 16 bits: widened exactly (subnormals too), the product within
    float32 summation error of the float64 product of the file's values."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(1e-3, 3)
    w.flat[: min(4, w.size)] = [0.0, -0.0, 3e-6, -6e-8][: min(4, w.size)]  # f16 subnormals, signed zero
    raw, deq = half_file(w, t)
    bw = formats.from_ggml(raw, t)
    assert bw.shape == (n, k) and bw.nbytes == 2 * n * k
    assert np.array_equal(bw.dequantize().view(np.uint32), deq.view(np.uint32))  # to the bit, -0.0 kept
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = mm.matmul(x, bw)
    bound = 2 * k * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(deq.T.astype(np.float64))) + 1e-30
    assert (np.abs(y - x.astype(np.float64) @ deq.T.astype(np.float64)) / bound).max() <= 1


@pytest.mark.parametrize("t", HALF)
def test_half_slices_and_take(t):
    rng = np.random.default_rng(5)
    raw, deq = half_file(rng.standard_normal((40, 70)).astype(np.float32), t)
    bw = formats.from_ggml(raw, t)
    assert np.array_equal(bw.rows(7, 31).dequantize(), deq[7:31])
    assert np.array_equal(bw.cols(10, 61).dequantize(), deq[:, 10:61])  # no block boundary needed
    assert np.array_equal(formats.concat_rows([bw.rows(0, 9), bw.rows(9, 40)]).dequantize(), deq)
    out = take(bw, np.array([3, -1, 39], np.int64))
    assert np.array_equal(out[[0, 2]], deq[[3, 39]]) and not out[1].any()
    assert not formats.empty(bw.kind, 2, 70, t).dequantize().any()


ATTENTION = [(8, None, np.float32, "numba-loops")]  # a head dimension the IR core does not take
ATTENTION += [  # the core on each instruction set; a float16 cache where the core reads one (not the baseline x86-64)
    (32, isa, kv, f"ir-core-{isa}-{np.dtype(kv).name}")
    for isa in RUNNABLE
    for kv in (np.float32, np.float16)
    if not (isa == "portable" and kv == np.float16)
]


@pytest.mark.parametrize("d, isa, kv", [a[:3] for a in ATTENTION], ids=[a[3] for a in ATTENTION])
def test_decode_attention_against_numpy_and_over_threads(d, isa, kv, monkeypatch):
    """decode.attend (RoPE, the new K/V into the cache, masked softmax · V per query head of
    each KV head) equals a float64 NumPy reference: numba's loops (a head dimension not a
    multiple of 16) and the IR core (one that is; also compiled for the baseline x86-64;
    and over a float16 cache, the new column rounded as NumPy rounds it), over more
    columns than the core's 16 and a few not valid; with threads (each row and KV head a
    task) the same bits."""
    import numba

    from mpitp.kernels import decode

    if isa is not None:
        monkeypatch.setenv("MPITP_ISA", isa)
        monkeypatch.setattr(decode, "_CORES", {})  # the cores compiled for this one
    rng = np.random.default_rng(5)
    B, nh, nkv, s, L = 3, 6, 2, 37, 40
    qkv = rng.standard_normal((B, (nh + 2 * nkv) * d)).astype(np.float32)
    ang = rng.uniform(0, 6, (B, d // 2))
    cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)
    kc = rng.standard_normal((B, L, nkv, d)).astype(kv)
    vc = rng.standard_normal((B, L, nkv, d)).astype(kv)
    valid = rng.random((B, L)) > 0.3
    valid[:, s] = True
    vc[~valid] = np.nan  # a column not valid is never read into the sum

    def rope(x, b):
        h = d // 2
        return np.concatenate([x[:h] * cos[b, :h] - x[h:] * sin[b, :h], x[h:] * cos[b, h:] + x[:h] * sin[b, h:]])

    x = qkv.astype(np.float64).reshape(B, nh + 2 * nkv, d)
    want = np.zeros((B, nh * d))
    k_all, v_all = kc.astype(np.float64), vc.astype(np.float64)
    for b in range(B):
        for j in range(nkv):
            k_all[b, s, j], v_all[b, s, j] = rope(x[b, nh + j], b), x[b, nh + nkv + j]
    k_all = k_all.astype(np.float32).astype(kv).astype(np.float64)  # as the cache holds them
    v_all = v_all.astype(np.float32).astype(kv).astype(np.float64)
    for b in range(B):
        for h in range(nh):
            j = h // (nh // nkv)
            seen = np.flatnonzero(valid[b, : s + 1])
            sc = k_all[b, seen, j] @ rope(x[b, h], b) * 0.3
            p = np.exp(sc - sc.max())
            want[b, h * d : (h + 1) * d] = (p / p.sum()) @ v_all[b, seen, j]
    assert (decode.core(d, nh // nkv, kv) is None) == (d % 16 != 0)
    outs = []
    for f in (decode.attend, decode.attend_threads):
        k2, v2, out = kc.copy(), vc.copy(), np.empty((B, nh * d), np.float32)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        f(qkv, cos, sin, k2, v2, valid, s, nh, nkv, np.float32(0.3), True, out)
        outs.append((out, k2, v2))
    out, k2, v2 = outs[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        k2[:, s].astype(np.float64), k_all[:, s], rtol=1e-6 if kv == np.float32 else 1e-3, atol=1e-6
    )
    assert np.array_equal(v2, v_all.astype(kv), equal_nan=True)
    assert all(np.array_equal(a, c, equal_nan=True) for a, c in zip(outs[0], outs[1]))


def test_swiglu_against_float64():
    """decode.swiglu (its exp a polynomial) against float64, at ordinary gates and at ones
    whose exp under- or overflows float32."""
    from mpitp.kernels import decode

    rng = np.random.default_rng(6)
    gu = (rng.standard_normal((5, 2 * 75)) * 5).astype(np.float32)
    gu[0, :6] = [100.0, -100.0, 88.5, -88.5, 87.0, -87.0]
    out = np.empty((5, 75), np.float32)
    decode.swiglu(gu, out)
    g = gu.astype(np.float64)
    want = g[:, :75] / (1 + np.exp(-g[:, :75])) * g[:, 75:]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-30)


def test_prefill_attention_rows_against_float64():
    """decode.attend_rows (prefill: every query row against its own columns, grouped heads)
    against float64 softmax attention over the same mask: two rows of a batch, one packed
    with prompts that share cached columns, one left-padded, and a query row that sees
    nothing (its output zero)."""
    from mpitp.kernels import decode

    rng = np.random.default_rng(8)
    B, T, S0, nkv, g, d = 2, 37, 5, 2, 3, 32
    nh, S = nkv * g, S0 + T
    qk = rng.standard_normal((B, T, nh + nkv, d)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, nkv, d)).astype(np.float32) for _ in range(2))
    owner = np.repeat([0, 1, 2], [10, 20, 7])  # row 0: three prompts packed after 5 shared columns
    allowed = np.zeros((B, T, S), bool)
    for t in range(T):
        allowed[0, t, :S0] = True
        allowed[0, t, S0:] = (owner == owner[t]) & (np.arange(T) <= t)
        allowed[1, t, S0 + 4 : S0 + t + 1] = True  # row 1: 4 pad columns, causal
    allowed[1, 2] = False  # a pad query: no column at all
    rows, cols = np.nonzero(allowed.reshape(B * T, S))
    indptr = np.zeros(B * T + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=B * T), out=indptr[1:])
    out = np.full((B, T, nh * d), np.nan, np.float32)
    scale = np.float32(d**-0.5)
    decode.attend_rows(qk, nh, g, k, v, indptr, cols.astype(np.int64), scale, out)
    q = qk[:, :, :nh].astype(np.float64).reshape(B, T, nkv, g, d)
    scores = np.einsum("btjhi,bsji->btjhs", q, k.astype(np.float64)) * float(scale)
    scores = np.where(allowed[:, :, None, None], scores, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    want = np.nan_to_num(np.einsum("btjhs,bsji->btjhi", p, v.astype(np.float64))).reshape(B, T, nh * d)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert not out[1, 2].any()  # the row that sees nothing


def test_numbas_cache_is_named_by_every_kernel_source(tmp_path):
    """A cached numba function is checked against its own file only, so the fused halves
    would keep a callee's old code from another file: the cache folder is named by a digest
    of every module in mpitp/kernels, and any edit of one names a new folder."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import mpitp.kernels as kernels

    src = Path(kernels.__file__).parent
    copy = tmp_path / "k"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kernels.numba_cache_dir(copy) == kernels.numba_cache_dir(src)
    (copy / "decode.py").write_text((copy / "decode.py").read_text() + "\n# an edit\n")
    assert kernels.numba_cache_dir(copy) != kernels.numba_cache_dir(src)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    code = "import numba, mpitp.kernels as k; print(numba.config.CACHE_DIR); print(k.numba_cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    used, named = out.stdout.split()
    assert used == named and used.startswith(str(tmp_path / "xdg" / "mpitp" / "numba")), out.stderr[-2000:]
