"""Tensor-parallel training ops (mpitp.train.tensor_parallel) against the single-process
reference in float64: every rank's outputs, input gradients and weight gradients equal
the full computation's, the weights' cut by chunk(p)[rank] (picotron's pattern). The
reference backward (mpitp.train.backward) is itself checked against central differences."""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

from mpitp.train import backward
from mpitp.train import tensor_parallel as tpo

N = MPI.COMM_WORLD.size
TOL = 1e-12


def close(a, b):
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=TOL, atol=TOL))


def cut(a, axis, r=None):
    """chunk(p)[rank] of ``a`` along ``axis`` (numpy.array_split sizes)."""
    r = MPI.COMM_WORLD.rank if r is None else r
    return np.array_split(a, N, axis=axis)[r]


def first_row(n, r):
    """Where rank ``r``'s piece of ``n`` rows starts under numpy.array_split."""
    return sum(len(c) for c in np.array_split(np.empty(n), N)[:r])


def test_column_then_row_mlp(comm):
    """y = row(gelu-free) ∘ column: the Megatron MLP cut; loss = Σ y·R."""
    rng = np.random.default_rng(0)
    B, T, H, I = 2, 3, 5, 2 * N + 1  # I not a multiple of N: uneven cut
    x, W1, b1 = rng.standard_normal((B, T, H)), rng.standard_normal((I, H)), rng.standard_normal(I)
    W2, b2, R = rng.standard_normal((H, I)), rng.standard_normal(H), rng.standard_normal((B, T, H))
    # reference, one process
    h = x @ W1.T + b1
    y = h @ W2.T + b2
    gW1, gb1, gW2, gb2 = np.zeros_like(W1), np.zeros_like(b1), np.zeros_like(W2), np.zeros_like(b2)
    dh = backward.linear_backward(R, h, W2, gW2, gb2)
    dx = backward.linear_backward(dh, x, W1, gW1, gb1)
    # tensor parallel
    w1, bb1, w2 = cut(W1, 0), cut(b1, 0), cut(W2, 1)
    hl = tpo.column_forward(x, w1, bb1)
    yl = tpo.row_forward(hl, w2, b2, comm)
    g1, gb1l, g2, gb2l = np.zeros_like(w1), np.zeros_like(bb1), np.zeros_like(w2), np.zeros_like(b2)
    dhl = tpo.row_backward(R, hl, w2, g2, gb2l)
    dxl = tpo.column_backward(dhl, x, w1, g1, gb1l, comm)
    agree(close(hl, cut(h, 2)) and close(yl, y), "forward: column output = chunk(p)[rank], row output = full")
    agree(close(dxl, dx), "dx: the column layer's all-reduced input gradient")
    agree(close(g1, cut(gW1, 0)) and close(gb1l, cut(gb1, 0)), "column dW, db = chunk(p)[rank] of the reference")
    agree(close(g2, cut(gW2, 1)) and close(gb2l, gb2), "row dW = its column chunk; row db replicated")


@pytest.mark.parametrize("V", [7, 2 * N + 1, 64])
def test_vocab_parallel_embedding_and_cross_entropy(comm, V):
    rng = np.random.default_rng(V)
    B, T, H = 2, 4, 3
    E, ids, targets = rng.standard_normal((V, H)), rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    Wh, D = rng.standard_normal((V, H)), rng.standard_normal((B, T, H))
    x = E[ids]
    logits = x @ Wh.T
    loss, dlogits = backward.cross_entropy(logits, targets)
    gE, gWh = np.zeros_like(E), np.zeros_like(Wh)
    dx = backward.linear_backward(dlogits, x, Wh, gWh)
    backward.embedding_backward(dx + D, ids, gE)
    v0 = first_row(V, comm.rank)
    el, whl = cut(E, 0), cut(Wh, 0)
    xl = tpo.vocab_embedding_forward(ids, el, v0, comm)
    ll = tpo.column_forward(xl, whl)  # this rank's logits: columns [v0, v0 + V_r)
    lossl, dll = tpo.vocab_cross_entropy(ll, targets, v0, comm)
    gEl, gWhl = np.zeros_like(el), np.zeros_like(whl)
    dxl = tpo.column_backward(dll, xl, whl, gWhl, None, comm)
    tpo.vocab_embedding_backward(dxl + D, ids, gEl, v0)
    agree(close(xl, x), "embedding lookup")
    agree(abs(lossl - loss) <= TOL * abs(loss) and close(dll, cut(dlogits, 2)), f"loss {lossl} vs {loss}")
    agree(close(dxl, dx) and close(gWhl, cut(gWh, 0)) and close(gEl, cut(gE, 0)), "gradients")


def test_sequence_parallel_rms_norm(comm):
    """Tokens cut across ranks: each rank's dx is its tokens' slice, and the weight
    gradient, summed over ranks, is the full one on every rank."""
    rng = np.random.default_rng(3)
    B, T, H = 2, 2 * N + 1, 6
    x, w, dy = rng.standard_normal((B, T, H)), rng.standard_normal(H), rng.standard_normal((B, T, H))
    gw = np.zeros(H)
    dx = backward.rms_norm_backward(dy, x, w, 1e-6, gw)
    gwl = np.zeros(H)
    dxl = tpo.sequence_rms_norm_backward(cut(dy, 1), cut(x, 1), w, 1e-6, gwl, comm)
    agree(close(dxl, cut(dx, 1)) and close(gwl, gw), "sequence-parallel RMSNorm")


@pytest.mark.parametrize("algorithm", ["ring", "mpi"])
def test_activations_summed_in_bfloat16(comm, algorithm):
    """``wire=bfloat16`` (--param-dtype bfloat16 with --tp): each rank's part is rounded to
    bfloat16 and the sum is carried in it, each add in float32 and each partial sum rounded
    to bfloat16. With parts whose float32 sums are exact (magnitudes in [1, 2)): at 2 ranks
    the result is bfloat16(Σ bfloat16(part)) to the bit; at more, within the N - 1 roundings'
    half-ulps of it (2^-8 relative each); on every rank the same values, float32."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    parts = [(rng.uniform(1, 2, (3, 7, 11)) * rng.choice([-1, 1], (3, 7, 11))).astype(np.float32) for _ in range(N)]
    mine = parts[comm.rank].copy()
    got = tpo.sum_over(mine, comm, algorithm, wire=bf16)
    want = sum(p.astype(bf16).astype(np.float32) for p in parts).astype(bf16).astype(np.float32)
    assert got is mine and got.dtype == np.float32
    exact = sum(p.astype(bf16).astype(np.float32) for p in parts)
    if N <= 2:
        agree(np.array_equal(got, want if N == 2 else parts[0]), f"max diff {np.abs(got - want).max()}")
    else:
        bound = (N - 1) * 2.0**-8 * sum(np.abs(p) for p in parts)
        agree(bool(np.all(np.abs(got - exact) <= bound)), f"max diff {np.abs(got - exact).max()}")
    agree(np.array_equal(got, comm.bcast_object(got if comm.rank == 0 else None)), "ranks differ")
    y = tpo.sum_over(parts[comm.rank].copy(), comm, algorithm)  # no wire: float32 throughout
    agree(np.allclose(y, sum(parts), rtol=1e-6, atol=1e-5) and (N == 1 or not np.array_equal(y, got)), "float32 sum")
