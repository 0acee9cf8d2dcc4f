"""A decoder layer's training forward and backward, with the inference ops.

    x ─ rms_norm ─ qkv ─ RoPE(q, k) ─ attention ─ o ─(+x)= h ─ rms_norm ─ gate_up ─ swiglu ─ down ─(+h)= y

``forward`` returns ``y`` and what ``backward`` needs (``Saved``); with activation
recomputation the trainer keeps only ``x`` and calls ``forward`` again in backward.
``p`` and ``g`` are the unit's parameter and gradient views (:meth:`UnitLayout.views`).

With tensor parallelism (``Ctx.tp``) ``p`` is this rank's slice (:mod:`.tp_layout`) and
``Ctx.cfg`` counts its heads and columns: qkv and gate_up are column-parallel, o and down
row-parallel, so a layer all-reduces twice forward (after o, after down) and twice
backward (the input gradients of qkv and gate_up), Megatron's f/g pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import xp_of
from ..models.config import LlamaConfig
from ..models.ops import attention, causal_mask, rms_norm, swiglu
from ..models.rope import Rotary
from .backward import attention_backward, linear_backward, rms_norm_backward, rope_backward, swiglu_backward
from .tensor_parallel import column_backward, row_forward


@dataclass
class Ctx:
    """What every layer of one micro-batch shares: RoPE tables, the causal mask, and the
    tensor-parallel group (None: whole layers) with the algorithm of its all-reduces and
    the dtype they carry (``wire``: None for the activations' own)."""

    cfg: LlamaConfig
    rotary: Rotary
    cos: Any
    sin: Any
    mask: Any
    tp: Any = None
    algorithm: str = "auto"
    wire: Any = None

    @classmethod
    def build(
        cls, cfg: LlamaConfig, rotary: Rotary, B: int, T: int, xp=np, tp=None, algorithm: str = "auto", wire=None
    ) -> Ctx:
        cos, sin = rotary.tables(xp.broadcast_to(xp.arange(T), (B, T)))
        return cls(cfg, rotary, cos, sin, causal_mask(T, xp), tp, algorithm, wire)


@dataclass
class Saved:
    x: Any
    h1: Any
    q: Any
    k: Any
    v: Any
    probs: Any
    a: Any
    h: Any
    h2: Any
    gate: Any
    up: Any
    m: Any


def _linear(x, p: dict, w: str, b: str):
    y = x @ p[w].T
    return y + p[b] if b in p else y


def forward(p: dict, x, c: Ctx, keep: bool = True):
    cfg = c.cfg
    B, T, _ = x.shape
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    h1 = rms_norm(x, p["ln1"], cfg.rms_norm_eps)
    qkv = _linear(h1, p, "qkv", "bqkv")
    nq = nh + nkv  # q and k side by side: one rotation for both
    qk = c.rotary.apply(qkv[..., : nq * d].reshape(B, T, nq, d), c.cos, c.sin)
    q = qk[:, :, :nh].reshape(B, T, nkv, nh // nkv, d).transpose(0, 2, 3, 1, 4)  # [B, kv, g, T, d]
    k = qk[:, :, nh:].transpose(0, 2, 1, 3)  # [B, kv, T, d]
    v = qkv[..., nq * d :].reshape(B, T, nkv, d).transpose(0, 2, 1, 3)
    att, probs = attention(q, k, v, d**-0.5, c.mask)
    a = att.transpose(0, 3, 1, 2, 4).reshape(B, T, nh * d)
    h = x + row_forward(a, p["o"], p.get("bo"), c.tp, c.algorithm, c.wire)
    h2 = rms_norm(h, p["ln2"], cfg.rms_norm_eps)
    gu = _linear(h2, p, "gate_up", "bgate_up")
    I = cfg.intermediate_size
    gate, up = gu[..., :I], gu[..., I:]
    m = swiglu(gate, up)
    y = h + row_forward(m, p["down"], p.get("bdown"), c.tp, c.algorithm, c.wire)
    return y, (Saved(x, h1, q, k, v, probs, a, h, h2, gate, up, m) if keep else None)


def backward(p: dict, g: dict, s: Saved, dy, c: Ctx):
    """dL/dx for dL/dy = ``dy``; parameter gradients are added into ``g``."""
    cfg = c.cfg
    xp = xp_of(dy)
    B, T, _ = dy.shape
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    dm = linear_backward(dy, s.m, p["down"], g["down"], g.get("bdown"))
    dgate, dup = swiglu_backward(dm, s.gate, s.up)
    dgu = xp.concatenate([dgate, dup], axis=-1)
    dh2 = column_backward(dgu, s.h2, p["gate_up"], g["gate_up"], g.get("bgate_up"), c.tp, c.algorithm, c.wire)
    dh = dy + rms_norm_backward(dh2, s.h, p["ln2"], cfg.rms_norm_eps, g["ln2"])
    da = linear_backward(dh, s.a, p["o"], g["o"], g.get("bo"))
    datt = da.reshape(B, T, nkv, nh // nkv, d).transpose(0, 2, 3, 1, 4)
    dq, dk, dv = attention_backward(datt, s.q, s.k, s.v, s.probs, d**-0.5)
    dqk = xp.concatenate([dq.transpose(0, 3, 1, 2, 4).reshape(B, T, nh, d), dk.transpose(0, 2, 1, 3)], axis=2)
    dqk = rope_backward(c.rotary, dqk, c.cos, c.sin)
    dqkv = xp.concatenate([dqk.reshape(B, T, (nh + nkv) * d), dv.transpose(0, 2, 1, 3).reshape(B, T, nkv * d)], axis=-1)
    dh1 = column_backward(dqkv, s.h1, p["qkv"], g["qkv"], g.get("bqkv"), c.tp, c.algorithm, c.wire)
    return dh + rms_norm_backward(dh1, s.x, p["ln1"], cfg.rms_norm_eps, g["ln1"])
