"""Each parallel layer against the full layer (picotron's pattern): the rank's output is
the reference output's ``chunk(p)[rank]`` (column), or the whole of it (row, after the
all-reduce); embedding and head against a plain lookup / matmul."""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

from mpitp.tp import (
    ArraySource,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardingError,
    VocabParallelEmbedding,
    partition,
)

N = MPI.COMM_WORLD.size
rng = np.random.default_rng(0)  # same stream on every rank: identical "full" weights


def close(a, b, tol=1e-5):
    return a.shape == b.shape and bool(np.allclose(a, b, atol=tol, rtol=tol))


def test_column_and_row(comm):
    W1, b1 = rng.standard_normal((12 * N, 10)), rng.standard_normal(12 * N)
    W2, b2 = rng.standard_normal((7, 12 * N)), rng.standard_normal(7)
    x = rng.standard_normal((3, 5, 10)).astype(np.float32)
    col = ColumnParallelLinear(10, 12 * N, bias=True, comm=comm)
    col.weight_loader("weight", ArraySource("w1", W1))
    col.weight_loader("bias", ArraySource("b1", b1))
    y_ref = x @ W1.T + b1
    y = col(x)
    agree(close(y, np.split(y_ref, N, axis=-1)[comm.rank].astype(np.float32)), "column output = chunk(p)[rank]")
    row = RowParallelLinear(12 * N, 7, bias=True, comm=comm)
    row.weight_loader("weight", ArraySource("w2", W2))
    row.weight_loader("bias", ArraySource("b2", b2))
    agree(close(row(y), (y_ref @ W2.T + b2).astype(np.float32), 1e-4), "row output = full output, bias once")
    gathered = ColumnParallelLinear(10, 12 * N, bias=True, comm=comm, gather_output=True)
    gathered.weight_loader("weight", ArraySource("w1", W1))
    gathered.weight_loader("bias", ArraySource("b1", b1))
    agree(close(gathered(x), y_ref.astype(np.float32)), "gather_output")
    rep = ReplicatedLinear(10, 4, bias=False, comm=comm)
    W3 = rng.standard_normal((4, 10))
    rep.weight_loader("weight", ArraySource("w3", W3))
    agree(close(rep(x), (x @ W3.T).astype(np.float32)), "replicated")


def test_merged_gate_up_layout(comm):
    I = 8 * N
    G, U = rng.standard_normal((I, 6)), rng.standard_normal((I, 6))
    m = MergedColumnParallelLinear(6, [I, I], comm=comm)
    m.weight_loader("weight", ArraySource("gate", G), 0)
    m.weight_loader("weight", ArraySource("up", U), 1)
    n = I // N
    want = np.concatenate([G[comm.rank * n : (comm.rank + 1) * n], U[comm.rank * n : (comm.rank + 1) * n]])
    agree(close(m.weight, want.astype(np.float32)), "local [gate_r ; up_r], up at local row I/p")


@pytest.mark.parametrize(
    "heads,kv",
    [
        (4 * N, 2 * N),
        (4 * N, 1),
        (4 * N, 4 * N),  # p divides
        (N + 1, 1),
        (3 * N + 3, 3),
        (9, 3),
        (2 * N + 2, N + 1),
    ],
)  # it does not
def test_qkv_heads_by_kv_groups(comm, heads, kv):
    """Each rank's q heads and the KV heads they use (its share, or the one it shares when
    p exceeds the KV heads), against the reference weights cut by the same partition."""
    if N > heads:
        pytest.skip("more ranks than heads")
    d = 2
    Q, K, V = (rng.standard_normal((h * d, 8)) for h in (heads, kv, kv))
    m = QKVParallelLinear(8, d, heads, kv, comm=comm)
    for sid, w in zip("qkv", (Q, K, V)):
        m.weight_loader("weight", ArraySource(sid, w), sid)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    q, k, v = m.split(m(x))
    a = partition.attention(heads, kv, N)
    nq, q0, nkv, k0 = a.rank(comm.rank)
    agree(close(q, (x @ Q[q0 * d : (q0 + nq) * d].T).astype(np.float32)), f"q heads {q0}..{q0 + nq - 1}")
    agree(close(k, (x @ K[k0 * d : (k0 + nkv) * d].T).astype(np.float32)), f"k heads {k0}..")
    agree(close(v, (x @ V[k0 * d : (k0 + nkv) * d].T).astype(np.float32)), "v heads")


def test_uneven_column_and_row(comm):
    out = 7 * N + 3
    sizes = [1] * (N - 1) + [out - (N - 1)]  # as uneven as a cut can be
    W1, W2 = rng.standard_normal((out, 10)), rng.standard_normal((5, out))
    x = rng.standard_normal((3, 10)).astype(np.float32)
    col = ColumnParallelLinear(10, out, comm=comm, sizes=sizes)
    col.weight_loader("weight", ArraySource("w1", W1))
    lo = partition.starts(sizes)[comm.rank]
    y_ref = x @ W1.T
    y = col(x)
    agree(close(y, y_ref[:, lo : lo + sizes[comm.rank]].astype(np.float32)), "column output = reference cut")
    row = RowParallelLinear(out, 5, comm=comm, sizes=sizes)
    row.weight_loader("weight", ArraySource("w2", W2))
    agree(close(row(y), (y_ref @ W2.T).astype(np.float32), 1e-4), "row output after the all-reduce")
    gathered = ColumnParallelLinear(10, out, comm=comm, sizes=sizes, gather_output=True)
    gathered.weight_loader("weight", ArraySource("w1", W1))
    agree(close(gathered(x), y_ref.astype(np.float32)), "uneven gather_output")
    m = MergedColumnParallelLinear(10, [out, out], comm=comm, sizes=sizes)
    m.weight_loader("weight", ArraySource("gate", W1), 0)
    m.weight_loader("weight", ArraySource("up", W1 * 2), 1)
    n = sizes[comm.rank]
    agree(close(m.weight, np.concatenate([W1[lo : lo + n], 2 * W1[lo : lo + n]]).astype(np.float32)), "[gate_r ; up_r]")


def test_more_ranks_than_heads_is_refused(comm):
    if N < 2:
        pytest.skip("one rank always has a head")
    with pytest.raises(
        ShardingError, match=f"tensor-parallel size {N} exceeds the number of attention heads = {N - 1}"
    ):
        QKVParallelLinear(8, 2, N - 1, 1, comm=comm)


@pytest.mark.parametrize("vocab", [50, 64 * N, 64 * N + 1])
def test_vocab_parallel_embedding_and_head(comm, vocab):
    E = rng.standard_normal((vocab, 6)).astype(np.float32)
    emb = VocabParallelEmbedding(vocab, 6, comm=comm)
    emb.weight_loader("weight", ArraySource("emb", E))
    ids = np.array([[0, vocab - 1, 3 % vocab], [vocab // 2, 1 % vocab, 0]])
    agree(close(emb(ids), E[ids]), f"embedding lookup vocab={vocab}")
    agree(
        emb.padded % 64 == 0 and emb.padded >= vocab and max(emb.sizes) - min(emb.sizes) <= 64,
        "padded to whole blocks of 64, cut differing by at most one block",
    )
    head = ParallelLMHead(vocab, 6, comm=comm)
    head.tie(emb)
    h = rng.standard_normal((2, 3, 6)).astype(np.float32)
    agree(close(head(h), h @ E.T, 1e-4), "head logits trimmed to the real vocabulary")
    agree(head.weight is emb.weight, "tied head shares the embedding shard")


def logits_of(h, E):
    """h @ Eᵀ in float64, each row of E summed alike: a BLAS product may sum a tail row in
    another order, and two equal rows of E meant as a tie then differ in the last bit (an
    Intel Xeon's OpenBLAS put the last of 50 rows ahead of the first)."""
    return (h[..., None, :].astype(np.float64) * E.astype(np.float64)).sum(-1)


@pytest.mark.parametrize("vocab", [50, 64 * N, 64 * N + 1])
def test_greedy_head_is_the_argmax_of_the_gathered_logits(comm, vocab):
    """Each rank's argmax of its shard, one all-gather of (value, token): the token argmax of
    the whole logits picks, ties (across the shards' borders too) to the lowest token, NaN
    first, never a padding row's (its logit 0 above rows all below 0)."""
    E = (np.abs(rng.standard_normal((vocab, 6))) + 0.1).astype(np.float32)
    E[0] *= 10
    E[vocab - 1] = E[0]  # a tie between the first and the last shard, the largest rows
    E[vocab // 2] = E[vocab // 3]
    head = ParallelLMHead(vocab, 6, comm=comm)
    head.weight_loader("weight", ArraySource("head", E))
    h = rng.standard_normal((5, 1, 6)).astype(np.float32)
    h[1, 0] = -np.abs(h[1, 0])  # every logit below 0: the padding's 0 must not win
    h[2, 0] = E[0] * 3  # the tie of tokens 0 and vocab - 1 is the maximum
    h[3, 0] = np.nan
    h[4, 0] = E[vocab // 3] * 3
    full = logits_of(h, E)
    want = full[:, 0].argmax(-1)
    got = head.greedy(h)
    agree(got.shape == (5, 1) and got.dtype == np.int64, f"one token a row: {got.shape} {got.dtype}")
    agree(np.array_equal(got[:, 0], want), f"vocab={vocab}: {got[:, 0].tolist()} != {want.tolist()}")
    agree(np.array_equal(got[:, 0], head(h)[:, 0].argmax(-1)), "the argmax of the head's own gathered logits")
    agree(want[2] == 0 and want[3] == 0 and full[1].max() < 0, "the test's ties, NaN and negative row hold")


@pytest.mark.parametrize("vocab", [50, 64 * N + 1, 1025])
def test_data_parallel_head_picks_as_the_whole_vocabulary_would(comm, vocab):
    """--dp-attention's head (:mod:`mpitp.tp.dp_head`): rows differ by rank (rank 1 has none),
    the vocabulary is cut. Greedy rows get the whole logits' argmax (ties to the lowest token,
    NaN first); rows that ask for logits get them whole; sampled rows follow the softmax at
    their temperature: 4000 rows a rank of its own x (12000 at 1025 tokens: blocks of several
    of the draw's 64-column chunks), the tokens' counts against the whole
    logits' softmax (chi-square under 6 standard deviations above its degrees of freedom;
    a sampler that ignored each block's mass, choosing blocks uniformly, is far above); a
    negative temperature on rank 0 raises the same ValueError on every rank."""
    from mpitp.tp.dp_head import DataParallelHead

    E = (np.abs(rng.standard_normal((vocab, 6))) + 0.1).astype(np.float32)
    E[vocab - 1] = E[0] * 10  # the tie of the first and the last token is the largest
    E[0] *= 10
    head = DataParallelHead(vocab, 6, comm=comm)
    head.weight_loader("weight", ArraySource("head", E))
    r = comm.rank
    mine = np.random.default_rng(100 + r)
    n = 0 if r == 1 else 4
    h = mine.standard_normal((n, 6)).astype(np.float32)
    T = np.array([0.0, 0.0, np.nan, 0.0][:n])
    if n:
        h[1] = E[0] * 3
        h[3] = np.nan
    tokens, logits = head.pick(h, T, np.zeros((n, 2)))
    full = logits_of(h, E)
    g = T == 0
    agree(np.array_equal(tokens[g], full[g].argmax(-1)), f"vocab={vocab}: greedy {tokens[g]} != {full[g].argmax(-1)}")
    agree(n == 0 or (tokens[1] == 0 and tokens[3] == 0), "the tie and the NaN row take token 0")
    agree(tokens[~g].tolist() == [-1] * int((~g).sum()) and close(logits, full[np.isnan(T)], 1e-4), "logits rows")
    E = rng.standard_normal((vocab, 6)).astype(np.float32)  # no tie: the mass spread over every block
    head = DataParallelHead(vocab, 6, comm=comm)
    head.weight_loader("weight", ArraySource("head", E))
    M, t = 4000 if vocab < 1000 else 12000, 0.8 + 0.2 * r
    x = np.repeat(0.5 * mine.standard_normal((1, 6)).astype(np.float32), M, axis=0) if r != 1 else np.zeros((0, 6))
    tokens, _ = head.pick(x, np.full(len(x), t), mine.random((len(x), 2)))
    if len(x):
        z = (x[0] @ E.T).astype(np.float64) / t
        p = np.exp(z - z.max())
        p /= p.sum()
        seen = np.bincount(tokens, minlength=vocab)
        chi2 = float(((seen - M * p) ** 2 / (M * p)).sum())
        bound = (vocab - 1) + 6 * np.sqrt(2 * (vocab - 1))
        agree(seen.sum() == M and chi2 < bound, f"vocab={vocab} rank {r}: chi-square {chi2:.0f} >= {bound:.0f}")
    else:
        agree(tokens.shape == (0,), "a rank without rows gets none")
    with pytest.raises(ValueError, match="rank 0 gave a row temperature -1.0"):  # on every rank
        head.pick(np.zeros((1, 6)), np.array([-1.0 if r == 0 else 1.0]), np.zeros((1, 2)))


def test_shape_mismatch_names_the_tensor(comm):
    col = ColumnParallelLinear(10, 4 * N, comm=comm)
    with pytest.raises(ShardingError, match=r"w_bad: checkpoint shape \(5, 10\)"):
        col.weight_loader("weight", ArraySource("w_bad", np.zeros((5, 10))))
