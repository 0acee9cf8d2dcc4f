"""Block weights repacked for the int8 kernels: 8 output rows side by side, 4 consecutive
k per 32-bit lane (what one ``vpdpbusd`` / ``vpmaddubsw`` multiplies against 4 bytes of x
broadcast to every lane).

A planar weight (:mod:`.formats`) [N, K] becomes T = ⌈N/8⌉ tiles of 8 rows (the last one
padded with zero rows), each tile a run of K/32 blocks::

    q4  qs [T, K/32, 4, 32] u8   vector g (0..3), byte 4i+j:  row 8t+i, k 32b+4g+j    (low nibble)
                                                            row 8t+i, k 32b+16+4g+j  (high nibble)
    q8  qs [T, K/32, 8, 32] i8   vector g (0..7), byte 4i+j:  row 8t+i, k 32b+4g+j
    d, m [T, K/32, 8] f32       the 8 rows' scale (and minimum) of block b, one vector load
                                (q8 with a scale per 16, Q6_K's: d [T, K/16, 8])

The values are the planar weight's exactly (the same quants and float32 scales, moved):
:meth:`TiledWeight.dequantize` equals the planar one bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import BLOCK, BlockWeight

ROWS = 8  # output rows per tile (8 int32 lanes of a 256-bit vector)


@dataclass
class TiledWeight:
    kind: str  # "q4" or "q8"
    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    n: int  # output rows (the tiles hold ⌈n/8⌉·8)
    source: str
    digits: int = 1  # int8 digits each value of x is quantized to (mpitp.kernels.quantize)
    layout = "tiles"

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.qs.shape[1] * BLOCK

    @property
    def group(self) -> int:
        return self.shape[1] // self.d.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + sum(a.nbytes for a in (self.d, self.m) if a is not None)

    def planar(self, r0: int = 0, r1: int | None = None) -> BlockWeight:
        """Rows [r0, r1) back in the planar layout (for lookups and prefill tiles)."""
        r1 = self.n if r1 is None else r1
        t0, t1 = r0 // ROWS, -(-r1 // ROWS)
        T, nb, ng = t1 - t0, self.qs.shape[1], self.d.shape[1]
        d = self.d[t0:t1].transpose(0, 2, 1).reshape(T * ROWS, ng)
        m = None if self.m is None else self.m[t0:t1].transpose(0, 2, 1).reshape(T * ROWS, ng)
        # [T, nb, G, 8 rows, 4 k] -> [T, 8 rows, nb, G, 4 k]
        G = self.qs.shape[2]
        q = self.qs[t0:t1].reshape(T, nb, G, ROWS, 4).transpose(0, 3, 1, 2, 4)
        if self.kind == "q4":  # bytes of groups g hold k 4g.. (low) and 16+4g.. (high): as planar
            q = q.reshape(T * ROWS, nb * 16)
        else:
            q = q.reshape(T * ROWS, nb * BLOCK)
        a, b = r0 - t0 * ROWS, r1 - t0 * ROWS
        return BlockWeight(self.kind, np.ascontiguousarray(q[a:b]), np.ascontiguousarray(d[a:b]),
                           None if m is None else np.ascontiguousarray(m[a:b]), self.source)  # fmt: skip

    def dequantize(self) -> np.ndarray:
        return self.planar().dequantize()


def repack(w: BlockWeight, digits: int = 1) -> TiledWeight:
    """A planar q4/q8 weight in tiles (a copy; the planar arrays can be dropped)."""
    if w.kind not in ("q4", "q8"):
        raise ValueError(f"no tiles for {w.kind} weights")
    N, K = w.shape
    nb = K // BLOCK
    T = -(-N // ROWS)
    pad = T * ROWS - N

    def rows(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)]) if pad else a

    def scales(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(rows(a).reshape(T, ROWS, a.shape[1]).transpose(0, 2, 1))

    G = 4 if w.kind == "q4" else 8  # 4-byte groups per block (q4: each byte holds two k)
    q = rows(w.qs).reshape(T, ROWS, nb, G, 4).transpose(0, 2, 3, 1, 4)  # [T, nb, G, 8 rows, 4]
    qs = np.ascontiguousarray(q).reshape(T, nb, G, ROWS * 4)
    assert w.d is not None
    m = scales(w.m) if w.kind == "q4" and w.m is not None else None
    return TiledWeight(w.kind, qs, scales(w.d), m, N, w.source, digits)
