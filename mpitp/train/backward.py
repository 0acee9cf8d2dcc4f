"""Backward of each LLaMA op; the forwards are :mod:`mpitp.models.ops` and
:meth:`mpitp.models.rope.Rotary.apply`. Each function takes the upstream gradient and
what the forward kept, returns the input gradients, and *accumulates* weight gradients
into the buffers it is given (so micro-batches add up in place). Checked in float64
against central differences (tests/test_train_grads.py)."""

from __future__ import annotations

import numpy as np

from ..backend import xp_of
from ..models.ops import mean_square


def linear_backward(dy, x, w, dw, db=None):
    """y = x @ w.T + b with w [out, in]: returns dx, adds dyᵀx to dw (and Σdy to db)."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    dw += dy2.T @ x2
    if db is not None:
        db += dy2.sum(axis=0)
    return dy @ w


def rms_norm_backward(dy, x, w, eps: float, dw):
    """y = x · r · w with r = 1/sqrt(mean(x²) + eps): returns dx, adds Σ dy·x·r to dw."""
    x32, ms = mean_square(x)
    r = 1.0 / xp_of(x).sqrt(ms + eps)
    xhat = x32 * r
    dw += (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    g = dy * w
    return (r * (g - xhat * ((g * xhat).sum(axis=-1, keepdims=True) / x.shape[-1]))).astype(x.dtype, copy=False)


def rope_backward(rotary, dy, cos, sin):
    """RoPE is a rotation per pair of halves: its transpose rotates by -θ."""
    return rotary.apply(dy, cos, -sin)


def swiglu_backward(dy, gate, up):
    """y = gate·σ(gate)·up: returns (dgate, dup)."""
    s = 1.0 / (1.0 + xp_of(gate).exp(-gate))
    silu = gate * s
    return dy * up * (s + silu * (1.0 - s)), dy * silu


def attention_backward(dout, q, k, v, probs, scale: float):
    """Gradients of :func:`mpitp.models.ops.attention` (q [B,kv,g,T,d], k, v [B,kv,S,d],
    probs [B,kv,g,T,S]); masked positions have probability 0 and get no gradient. K and V
    gradients sum over the g query heads that share them."""
    dv = (probs.swapaxes(-1, -2) @ dout).sum(axis=2)  # [B, kv, S, d]
    dp = dout @ v[:, :, None].swapaxes(-1, -2)  # [B, kv, g, T, S]
    ds = probs * (dp - (dp * probs).sum(axis=-1, keepdims=True))
    ds *= scale
    dq = ds @ k[:, :, None]  # [B, kv, g, T, d]
    dk = (ds.swapaxes(-1, -2) @ q).sum(axis=2)  # [B, kv, S, d]
    return dq, dk, dv


def embedding_backward(dy, ids, dw) -> None:
    """y = w[ids]: scatter-adds the rows of dy into dw."""
    xp_of(dw).add.at(dw, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))


def cross_entropy(logits, targets):
    """Σ over positions of -log softmax(logits)[target], and its gradient
    softmax - onehot (unscaled: the caller divides by the global token count)."""
    xp = xp_of(logits)
    z = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    zmax = z.max(axis=-1, keepdims=True)
    e = xp.exp(z - zmax)
    total = e.sum(axis=-1, keepdims=True)
    picked = z[xp.arange(len(t)), t]
    loss = float((xp.log(total[:, 0]) + zmax[:, 0] - picked).sum(dtype=np.float64))
    e /= total
    e[xp.arange(len(t)), t] -= 1.0
    return loss, e.reshape(logits.shape)
