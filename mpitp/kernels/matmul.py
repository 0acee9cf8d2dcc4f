"""``y = x @ Wᵀ`` for a weight in whatever form mpitp holds it, dispatched by one table (as
ggml's ``type_traits_cpu``): the weight's kind names its two operations, ``bind`` (a
decode step's ``f(x, y)``, its kernel chosen once) and ``matmul`` (any rows)::

    kind       held as                                 operations
    tiles      the int8 kernels' tiles (.weights.tiles)  .int8: Bound, matmul
    pieces     several formats side by side (merged qkv)  each piece's own, into its columns
    q4, q8     planar blocks, float32 activations          .planar: bind, matmul
    f16, bf16  16-bit floats                               .planar (.half's kernels)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import int8, planar


class Pieces:
    """``f(x, y)`` of a weight held in pieces of different formats: each piece's bound
    kernel (``parts``) into its columns (``spans``) of y, through a buffer."""

    def __init__(self, parts: list, spans: list[tuple[int, int]], rows: int):
        self.parts, self.spans = parts, spans
        self.bufs = [np.empty((rows, b - a), np.float32) for a, b in spans]

    def __call__(self, x, y) -> None:
        M = x.shape[0]
        for f, (a, b), buf in zip(self.parts, self.spans, self.bufs):
            f(x, buf[:M])
            y[:, a:b] = buf[:M]


def _bind_pieces(w):  # each piece's kernel into its columns of y
    bound = [bind(p) for p in w.parts]
    spans = [(a, a + p.shape[0]) for a, p in zip(w.starts, w.parts)]
    rows = min(r for _, r in bound)
    return Pieces([f for f, _ in bound], spans, rows), rows


def _matmul_pieces(x2, w):
    return np.concatenate([matmul(x2, p) for p in w.parts], axis=1)


class Ops(NamedTuple):
    bind: Callable[[Any], tuple[Callable, int]]
    matmul: Callable[[np.ndarray, Any], np.ndarray]


OPS = {
    "tiles": Ops(lambda w: (int8.Bound(w), int8.SMALL), int8.matmul),
    "pieces": Ops(_bind_pieces, _matmul_pieces),
    **{kind: Ops(planar.bind, planar.matmul) for kind in ("q4", "q8", "f16", "bf16")},
}


def kind(w) -> str:
    """The table's key of a weight: its layout, or for planar blocks its kind."""
    return w.kind if w.layout == "planar" else w.layout


def bind(w):
    """``(f, rows)``: ``f(x, y)`` writes ``x @ w.T`` into ``y`` [M, N] for a C-contiguous
    float32 ``x`` [M, K] of at most ``rows`` rows, the kernel chosen once (a decode step
    calls ~120 of them: :mod:`mpitp.models.decode_step`)."""
    return OPS[kind(w)].bind(w)


def matmul(x: np.ndarray, w) -> np.ndarray:
    """``x [..., K] @ w.T`` -> float32 [..., N]."""
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    if x2.dtype != np.float32 or not x2.flags.c_contiguous:
        x2 = np.ascontiguousarray(x2, dtype=np.float32)
    y = OPS[kind(w)].matmul(x2, w)
    return y if x.ndim == 2 else y.reshape(*x.shape[:-1], y.shape[1])
