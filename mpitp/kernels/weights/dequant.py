"""Block weights (:mod:`.formats`: q4, q8; F16/BF16 in :mod:`.half`) widened to float32: whole
rows for prefill's BLAS tiles and for :meth:`.formats.BlockWeight.dequantize`, single rows
for the embedding's lookup. The values equal the ``gguf`` package's dequantization (q4:
``d·q + m``; q8: ``d·q``, a scale per 32 or per 16)."""

from __future__ import annotations

import numpy as np
from numba import njit

SIXTEEN, SIXTEENTH = np.float32(16.0), np.float32(1 / 16)
OPTS = dict(cache=True, fastmath=True, nogil=True, boundscheck=False)


@njit(**OPTS)
def q4_dequantize(qs, d, m, r0, r1, out):
    """Rows [r0, r1) of a q4 weight -> out [r1-r0, K] float32."""
    B = d.shape[1]
    for n in range(r0, r1):
        for b in range(B):
            sc, mn = d[n, b], m[n, b]
            for j in range(16):
                qf = np.float32(qs[n, 16 * b + j])
                hi = np.floor(qf * SIXTEENTH)
                out[n - r0, 32 * b + j] = sc * (qf - SIXTEEN * hi) + mn
                out[n - r0, 32 * b + 16 + j] = sc * hi + mn


@njit(**OPTS)
def q8_dequantize(qs, d, r0, r1, out):
    B = d.shape[1]
    G = qs.shape[1] // B  # weights per scale: 32, or 16 (Q6_K)
    for n in range(r0, r1):
        for b in range(B):
            sc = d[n, b]
            for j in range(G):
                out[n - r0, G * b + j] = sc * np.float32(qs[n, G * b + j])


@njit(**OPTS)
def q4_take(qs, d, m, ids, out):
    """Embedding lookup: out[t] = row ids[t] of a q4 weight (a negative id gives zeros)."""
    for t in range(ids.shape[0]):
        if ids[t] < 0:
            out[t, :] = 0
        else:
            q4_dequantize(qs, d, m, ids[t], ids[t] + 1, out[t : t + 1])


@njit(**OPTS)
def q8_take(qs, d, ids, out):
    for t in range(ids.shape[0]):
        if ids[t] < 0:
            out[t, :] = 0
        else:
            q8_dequantize(qs, d, ids[t], ids[t] + 1, out[t : t + 1])


def dequantize_rows(w, r0: int, r1: int) -> np.ndarray:
    if getattr(w, "layout", "") == "pieces":
        return w.dequantize()[r0:r1]
    if getattr(w, "layout", "") == "tiles":  # int8 kernels' layout (:mod:`.tiles`)
        return dequantize_rows(w.planar(r0, r1), 0, r1 - r0)
    out = np.empty((r1 - r0, w.shape[1]), np.float32)
    if w.kind in ("f16", "bf16"):
        from ..half import half_dequantize

        half_dequantize(w.qs, w.kind == "bf16", r0, r1, out)
    elif w.kind == "q4":
        q4_dequantize(w.qs, w.d, w.m, r0, r1, out)
    else:
        q8_dequantize(w.qs, w.d, r0, r1, out)
    return out


def take(w, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (1-D int64; -1 for a zero row) of ``w`` as float32 [len(ids), K]."""
    out = np.empty((ids.shape[0], w.shape[1]), np.float32)
    if getattr(w, "layout", "") == "tiles":
        for t, i in enumerate(ids):
            out[t] = 0 if i < 0 else dequantize_rows(w, int(i), int(i) + 1)[0]
        return out
    if w.kind in ("f16", "bf16"):
        from ..half import half_take

        half_take(w.qs, w.kind == "bf16", ids, out)
    elif w.kind == "q4":
        q4_take(w.qs, w.d, w.m, ids, out)
    else:
        q8_take(w.qs, w.d, ids, out)
    return out
