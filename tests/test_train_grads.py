"""Backward of every op, a whole decoder block and the whole model against float64 central
differences (relative error <= 1e-6), plus the data windows, the schedule and AdamW's
bookkeeping. Single process; the multi-rank training tests are in test_train.py."""

import numpy as np
import pytest

from mpitp.models import ops
from mpitp.models.config import LlamaConfig
from mpitp.models.rope import Rotary
from mpitp.train import backward, block, data, layout
from mpitp.train.engine import TrainEngine
from mpitp.train.optim import learning_rate
from mpitp.train.sharding import Sharding

H = 1e-6
rng = np.random.default_rng(0)


def numeric(f, x, h=H):
    """Central differences of the scalar f() with respect to every element of x (in place)."""
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        a = f()
        flat[i] = old - h
        b = f()
        flat[i] = old
        gf[i] = (a - b) / (2 * h)
    return g


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_rms_norm():
    x, w, dy = rng.standard_normal((2, 3, 8)), rng.standard_normal(8), rng.standard_normal((2, 3, 8))
    f = lambda: float((ops.rms_norm(x, w, 1e-5) * dy).sum())  # noqa: E731
    dw = np.zeros(8)
    dx = backward.rms_norm_backward(dy, x, w, 1e-5, dw)
    assert rel(dx, numeric(f, x)) <= 1e-6 and rel(dw, numeric(f, w)) <= 1e-6


def test_linear_with_bias():
    x, w, b, dy = (
        rng.standard_normal((2, 3, 5)),
        rng.standard_normal((4, 5)),
        rng.standard_normal(4),
        rng.standard_normal((2, 3, 4)),
    )
    f = lambda: float(((x @ w.T + b) * dy).sum())  # noqa: E731
    dw, db = np.zeros_like(w), np.zeros_like(b)
    dx = backward.linear_backward(dy, x, w, dw, db)
    assert rel(dx, numeric(f, x)) <= 1e-6 and rel(dw, numeric(f, w)) <= 1e-6 and rel(db, numeric(f, b)) <= 1e-6


@pytest.mark.parametrize(
    "scaling",
    [
        {},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
def test_rope(scaling):
    rot = Rotary(8, 500.0, scaling, 64, dtype=np.float64)
    pos = np.array([[0, 5, 9, 40], [3, 4, 63, 1]])
    cos, sin = rot.tables(pos)
    x, dy = rng.standard_normal((2, 4, 3, 8)), rng.standard_normal((2, 4, 3, 8))
    f = lambda: float((rot.apply(x, cos, sin) * dy).sum())  # noqa: E731
    assert rel(backward.rope_backward(rot, dy, cos, sin), numeric(f, x)) <= 1e-6


def test_attention_gqa_causal():
    B, kv, g, T, d = 2, 2, 3, 5, 4
    q, k, v = (
        rng.standard_normal((B, kv, g, T, d)),
        rng.standard_normal((B, kv, T, d)),
        rng.standard_normal((B, kv, T, d)),
    )
    mask, dout = ops.causal_mask(T), rng.standard_normal((B, kv, g, T, d))
    f = lambda: float((ops.attention(q, k, v, 0.5, mask)[0] * dout).sum())  # noqa: E731
    probs = ops.attention(q, k, v, 0.5, mask)[1]
    dq, dk, dv = backward.attention_backward(dout, q, k, v, probs, 0.5)
    assert rel(dq, numeric(f, q)) <= 1e-6 and rel(dk, numeric(f, k)) <= 1e-6 and rel(dv, numeric(f, v)) <= 1e-6


def test_swiglu():
    gate, up, dy = rng.standard_normal((3, 7)), rng.standard_normal((3, 7)), rng.standard_normal((3, 7))
    f = lambda: float((ops.swiglu(gate, up) * dy).sum())  # noqa: E731
    dg, du = backward.swiglu_backward(dy, gate, up)
    assert rel(dg, numeric(f, gate)) <= 1e-6 and rel(du, numeric(f, up)) <= 1e-6


def test_embedding_repeated_ids():
    w, ids, dy = rng.standard_normal((6, 4)), np.array([[1, 3, 1], [5, 1, 0]]), rng.standard_normal((2, 3, 4))
    f = lambda: float((w[ids] * dy).sum())  # noqa: E731
    dw = np.zeros_like(w)
    backward.embedding_backward(dy, ids, dw)
    assert rel(dw, numeric(f, w)) <= 1e-6


def test_cross_entropy():
    logits, t = rng.standard_normal((2, 3, 11)) * 3, rng.integers(0, 11, (2, 3))
    f = lambda: backward.cross_entropy(logits, t)[0]  # noqa: E731
    loss, d = backward.cross_entropy(logits, t)
    ref = -np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
    assert abs(loss - np.take_along_axis(ref, t[..., None], -1).sum()) <= 1e-12
    assert rel(d, numeric(f, logits)) <= 1e-6


def tiny_cfg(**kw):
    base = dict(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=16,
    )
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("bias", [False, True])
def test_decoder_block(bias):
    cfg = tiny_cfg(
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        rope_theta=100.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    )
    lay = layout.llama_units(cfg)[1]
    flat = layout.init_unit(lay, 0, std=0.3)
    flat += rng.standard_normal(flat.size) * 0.05  # norms and biases away from 1 and 0
    ctx = block.Ctx.build(cfg, Rotary(4, 100.0, cfg.rope_scaling, 16, dtype=np.float64), 2, 5)
    x, dy = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    f = lambda: float((block.forward(lay.views(flat), x, ctx, keep=False)[0] * dy).sum())  # noqa: E731
    g = np.zeros_like(flat)
    dx = block.backward(lay.views(flat), lay.views(g), block.forward(lay.views(flat), x, ctx)[1], dy, ctx)
    assert rel(g, numeric(f, flat)) <= 1e-6
    assert rel(dx, numeric(f, x)) <= 1e-6


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_whole_model(tied, recompute):
    """Embedding, layers, final norm, head and the mean cross-entropy, through the engine."""
    cfg = tiny_cfg(tie_word_embeddings=tied)
    lays = layout.llama_units(cfg)
    S = Sharding(None, lays, "fsdp", np.float64, keep=(len(lays) - 1,) + ((0,) if tied else ()))
    for i, lay in enumerate(lays):
        S.owned_params(i)[: lay.numel] = layout.init_unit(lay, i, std=0.3)
    E = TrainEngine(cfg, S, recompute=recompute)
    ids, tg = rng.integers(0, 37, (2, 6)), rng.integers(0, 37, (2, 6))
    S.zero_grads()
    E.micro_step(ids, tg, 1 / 12)
    for i, lay in enumerate(lays):
        p = S.owned_params(i)[: lay.numel]
        num = numeric(lambda: E.loss(ids, tg) / 12, p)
        assert rel(S.opt_grads(i)[: lay.numel], num) <= 1e-6, lay.name


def test_windows_and_batches():
    tokens = np.arange(100)
    w = data.Windows(tokens, 10)
    assert w.count == 9  # (100 - 1) // 10
    x, y = w.batch(np.array([0, 3]))
    assert x[1].tolist() == list(range(30, 40)) and y[1].tolist() == list(range(31, 41))
    assert data.step_windows(2, 4, 9).tolist() == [8, 0, 1, 2]  # windows 8..11 mod 9
    for n in (1, 2, 3, 4, 5):
        rows = [data.local_rows(7, n, r) for r in range(n)]
        assert np.concatenate([np.arange(7)[s] for s in rows]).tolist() == list(range(7))
        assert [len(range(7)[s]) for s in rows] == [len(a) for a in np.array_split(np.arange(7), n)]


def test_llmc_bin(tmp_path):
    ids = np.array([5, 1, 65535, 7], np.uint16)
    head = np.zeros(256, np.int32)
    head[:3] = [data.LLMC_MAGIC, 1, 4]
    (tmp_path / "a.bin").write_bytes(head.tobytes() + ids.tobytes())
    (tmp_path / "b.bin").write_bytes(ids.tobytes())
    assert data.read_ids(tmp_path / "a.bin").tolist() == ids.tolist()
    assert data.read_ids(tmp_path / "b.bin").tolist() == ids.tolist()
    (tmp_path / "c.bin").write_bytes(b"abc")
    with pytest.raises(data.DataError, match="even size"):
        data.read_ids(tmp_path / "c.bin")


def test_schedule():
    assert [round(learning_rate(s, 1.0, 10, warmup=2), 6) for s in (0, 1)] == [0.5, 1.0]
    assert learning_rate(2, 1.0, 10, warmup=2, schedule="cosine") == pytest.approx(1.0)
    assert learning_rate(9, 1.0, 10, warmup=2, schedule="cosine") == pytest.approx(0.1)
    assert learning_rate(5, 1.0, 10, warmup=2, schedule="constant") == 1.0


def test_layout_ranges_cover_every_element():
    cfg = tiny_cfg(qkv_bias=True)
    for lay in layout.llama_units(cfg):
        for n in (1, 2, 3, 4, 7):
            P = lay.padded(n)
            assert P % n == 0 and P >= lay.numel
            spans = [lay.owned(n, r) for r in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == P
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        mask = lay.decay_mask(0, lay.numel)
        assert mask.sum() == sum(t.size for t in lay.tensors if len(t.shape) >= 2)
