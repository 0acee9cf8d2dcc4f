"""The forward of each LLaMA op, one definition for inference and training.

Inference (:mod:`mpitp.models.llama`) and training (:mod:`mpitp.train.block`) both call
these; the backward of each lives in :mod:`mpitp.train.backward`. Shapes::

    rms_norm    x [..., H], w [H]                       -> [..., H]
    swiglu      gate, up [..., I]                       -> silu(gate) * up
    attention   q [B, kv, g, T, d], k, v [B, kv, S, d]  -> out [B, kv, g, T, d], probs [B, kv, g, T, S]

(``g`` = query heads per KV head: grouped-query attention without repeating K and V.)
RoPE is :meth:`mpitp.models.rope.Rotary.apply`. NumPy or CuPy arrays alike.
"""

from __future__ import annotations

import numpy as np

from ..backend import xp_of

MASKED = np.finfo(np.float32).min


def norm_dtype(dtype) -> np.dtype:
    """RMSNorm statistics in float32 at least: float16 upcast, float64 kept."""
    return np.promote_types(dtype, np.float32)


def mean_square(x):
    """(x, mean(x²) over the last axis, keepdims), both in :func:`norm_dtype`."""
    x32 = x.astype(norm_dtype(x.dtype), copy=False)
    return x32, (x32 * x32).sum(axis=-1, keepdims=True) / x.shape[-1]  # mean, without mean()'s Python


def rms_norm(x, weight, eps: float):
    x32, ms = mean_square(x)
    return (x32 / xp_of(x).sqrt(ms + eps)).astype(x.dtype, copy=False) * weight


def swiglu(gate, up):
    """SiLU(gate) * up, as LLaMA's MLP."""
    return gate / (1.0 + xp_of(gate).exp(-gate)) * up


def attention(q, k, v, scale: float, allowed=None):
    """softmax(q kᵀ · scale) v over the last two axes; ``allowed`` is a boolean mask that
    broadcasts to the scores (``None``: nothing masked). Returns (out, probs)."""
    xp = xp_of(q)
    scores = (q @ k[:, :, None].swapaxes(-1, -2)) * scale  # [B, kv, g, T, S]
    if allowed is not None:
        scores = xp.where(allowed, scores, MASKED)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs.astype(v.dtype, copy=False) @ v[:, :, None]  # [B, kv, g, T, d]
    return out, probs


def causal_mask(T: int, xp=np):
    """[T, T]: True where query t may attend to key s (s <= t)."""
    return xp.tril(xp.ones((T, T), bool))
