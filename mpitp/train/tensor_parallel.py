"""Tensor-parallel training ops: the Megatron f/g pair and what is built on it.

Forward and backward of the parallel layers on the ``tp`` communicator (picotron's
``copy_to`` / ``reduce_from`` functions), each the conjugate of the other::

    column  y_r = x W_rᵀ (+ b_r)      forward: x replicated (f: identity)
            dx = Σ_r dy_r W_r          backward: all-reduce (f's conjugate)
    row     y = Σ_r x_r W_rᵀ (+ b)     forward: all-reduce (g)
            dx_r = dy W_r              backward: identity (g's conjugate)

    W [out, in]: column cuts rows (out), row cuts columns (in); a rank's cut is
    ``chunk(p)[rank]`` of the full tensor, and so are its weight gradients.

The vocabulary-parallel embedding and cross-entropy never gather the full vocabulary:
each rank holds rows [v0, v1) of the table and its slice of the logits; the loss needs
three all-reduces of one number per token (max, Σexp, the target's logit). RMSNorm over
a sequence cut across ranks (sequence parallelism) sums its weight gradient over ranks.
Weight gradients are *added* into the buffers given, as in :mod:`mpitp.train.backward`.

``wire`` (``--param-dtype bfloat16``): the activation all-reduces (row forward, column
backward, the embedding lookup) carry it: each rank's part is rounded to it and the sum is
carried in it (the Communicator's bfloat16 path: each add in float32, each partial sum
rounded to bfloat16, so N - 1 roundings at most), as torch's bfloat16 activations are; the
loss's per-token numbers stay in float32.
"""

from __future__ import annotations

import numpy as np

from ..backend import xp_of
from .backward import linear_backward, rms_norm_backward


def column_forward(x, w, b=None):
    """This rank's output columns of a column-parallel linear (x replicated)."""
    y = x @ w.T
    return y if b is None else y + b


def sum_over(x, tp, algorithm: str = "auto", wire=None):
    """``x`` summed over the ``tp`` group, in place; in ``wire``'s dtype on the way when
    one is given (the result is widened back into ``x``)."""
    if tp is None or tp.size == 1:
        return x
    if wire is None or np.dtype(wire) == x.dtype:
        return tp.allreduce(x, out=x, algorithm=algorithm)
    carried = x.astype(wire)
    tp.allreduce(carried, out=carried, algorithm=algorithm)
    x[...] = carried
    return x


def column_backward(dy, x, w, dw, db, tp, algorithm: str = "auto", wire=None):
    """dL/dx (all-reduced over ``tp``: every rank's output columns depend on all of x);
    adds this rank's dW, db."""
    return sum_over(linear_backward(dy, x, w, dw, db), tp, algorithm, wire)


def row_forward(x, w, b, tp, algorithm: str = "auto", wire=None):
    """A row-parallel linear: this rank's input columns ``x``, the output all-reduced;
    the (replicated) bias added once, after the sum."""
    y = sum_over(x @ w.T, tp, algorithm, wire)
    return y if b is None else y + b


def row_backward(dy, x, w, dw, db):
    """dL/dx for this rank's input columns (no communication: dy is replicated); adds dW
    and the replicated bias's gradient (the same on every rank)."""
    return linear_backward(dy, x, w, dw, db)


def vocab_embedding_forward(ids, w, v0: int, tp, algorithm: str = "auto", wire=None):
    """Rows ``ids`` of a table cut by vocabulary: rank r holds rows [v0, v0 + len(w)) and
    contributes those, the others zeros; the sum over ranks is the lookup."""
    xp = xp_of(w)
    local = ids - v0
    mine = (local >= 0) & (local < w.shape[0])
    return sum_over(w[xp.where(mine, local, 0)] * mine[..., None], tp, algorithm, wire)


def vocab_embedding_backward(dy, ids, dw, v0: int) -> None:
    """Adds the rows of ``dy`` whose ids fall in this rank's rows into ``dw``."""
    xp = xp_of(dw)
    local = (ids - v0).reshape(-1)
    mine = (local >= 0) & (local < dw.shape[0])
    xp.add.at(dw, local[mine], dy.reshape(-1, dy.shape[-1])[mine])


def vocab_cross_entropy(logits, targets, v0: int, tp, algorithm: str = "auto"):
    """Σ over positions of -log softmax(logits)[target] with the logits cut by vocabulary
    (this rank: columns [v0, v0 + V_r)), and this rank's slice of its gradient
    softmax - onehot. Never gathers the logits: per token, the max, the sum of
    exponentials and the target's logit are all-reduced."""
    xp = xp_of(logits)
    z = logits.reshape(-1, logits.shape[-1])
    t = targets.reshape(-1) - v0
    mine = (t >= 0) & (t < z.shape[1])
    rows = xp.arange(len(t))
    zmax = z.max(axis=-1)
    picked = xp.where(mine, z[rows, xp.where(mine, t, 0)], 0.0)
    if tp is not None and tp.size > 1:
        tp.allreduce(zmax, op="max", out=zmax, algorithm=algorithm)
    e = xp.exp(z - zmax[:, None])
    total = e.sum(axis=-1)
    if tp is not None and tp.size > 1:
        both = xp.stack([total, picked])
        tp.allreduce(both, out=both, algorithm=algorithm)
        total, picked = both[0], both[1]
    loss = float((xp.log(total) + zmax - picked).sum(dtype=np.float64))
    e /= total[:, None]
    e[rows[mine], t[mine]] -= 1.0
    return loss, e.reshape(logits.shape)


def sequence_rms_norm_backward(dy, x, w, eps: float, dw, tp):
    """RMSNorm's backward on this rank's part of the sequence (sequence parallelism):
    dL/dx for those tokens; the weight gradient summed over every rank's tokens (an
    all-reduce of dw's increment), so each rank adds the full one."""
    part = w * 0
    dx = rms_norm_backward(dy, x, w, eps, part)
    if tp is not None and tp.size > 1:
        tp.allreduce(part, out=part)
    dw += part
    return dx
