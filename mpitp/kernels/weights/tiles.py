"""Block weights repacked for the int8 kernels: 8 output rows side by side, 4 consecutive
k per 32-bit lane (what one ``vpdpbusd`` / ``vpmaddubsw`` multiplies against 4 bytes of x
broadcast to every lane).

A planar weight (:mod:`.formats`) [N, K] becomes T = ⌈N/8⌉ tiles of 8 rows (the last one
padded with zero rows), each tile a run of K/32 blocks::

    q4  qs [T, K/32, 4, 32] u8   vector g (0..3), byte 4i+j:  row 8t+i, k 32b+4g+j    (low nibble)
                                                            row 8t+i, k 32b+16+4g+j  (high nibble)
    q8  qs [T, K/32, 8, 32] i8   vector g (0..7), byte 4i+j:  row 8t+i, k 32b+4g+j
    d, m [T, K/32, 8] f16/f32   the 8 rows' scale (and minimum) of block b, one vector load
                                (q8 with a scale per 16, Q6_K's: d [T, K/16, 8]); float16
                                where every scale is one (the file's: Q4_0, Q4_1, Q8_0, Q5_0),
                                as the file holds them; Q4_0's minimum -8·d is not stored

K-quants whose super-blocks are whole (a cut on 256-weight boundaries) keep the file's
integer scales, so they are held at about the file's size (19 bytes per 32 weights for
Q4_K's 18, 26.5 for Q6_K's 26.25) and the kernels form the float scales in registers::

    q4k qs as q4;  d [T, K/32, 16] u8   the 8 rows' sub-block scales sc, then mins mn
                   m [T, K/256, 16] f16 the 8 rows' super-block d, then dmin (the file's)
                                        w = (d·sc)·q - (dmin·mn)
    q6k qs [T, K/32, 6, 32] u8  vectors 0-3 the low 4 bits as q4 lays nibbles out, 4-5 the
                                high 2 bits: byte 4i+j of vector 4+h, bits 2g..2g+1 = row
                                8t+i, k 32b+16h+4g+j
        d [T, K/32, 16] i8      the 8 rows' scale of k 0-15, then of k 16-31
        m [T, K/256, 8] f16     the 8 rows' super-block d      w = (d·sc)·(q6 - 32)

The values are the planar weight's exactly (the same quants and float32 scales, moved;
K-quants' scales formed by the same float32 products as the planar ones):
:meth:`TiledWeight.dequantize` equals the planar one bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .formats import BLOCK, SUPER, BlockWeight

ROWS = 8  # output rows per tile (8 int32 lanes of a 256-bit vector)


@dataclass
class TiledWeight:
    kind: str  # "q4", "q8", or the K-quants' "q4k", "q6k"
    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    n: int  # output rows (the tiles hold ⌈n/8⌉·8)
    source: str
    digits: int = 1  # int8 digits each value of x is quantized to (mpitp.kernels.quantize)
    outliers: bool = False  # digit 2 holds x's outliers only (int8o), not what digit 1 leaves
    bound: dict = field(default_factory=dict, repr=False, compare=False)  # int8.matmul's, by (isa, threads)
    layout = "tiles"

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.qs.shape[1] * BLOCK

    @property
    def fmt(self) -> str:
        """The kernels' name for this layout: the kind, then "0" where the minimum is Q4_0's
        -8·d (not stored) and "h" where the scales are float16 (q40h: a Q4_0 file's)."""
        if self.kind in ("q4k", "q6k"):  # their super-block scales: float16 (the file's) or float32
            return self.kind + ("h" if self.m is not None and self.m.dtype == np.float16 else "")
        implied = "0" if self.kind == "q4" and self.m is None else ""
        return self.kind + implied + ("h" if self.d.dtype == np.float16 else "")

    @property
    def group(self) -> int:
        return self.shape[1] // self.d.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + sum(a.nbytes for a in (self.d, self.m) if a is not None)

    @property
    def xs_group(self) -> int:
        """Values of x per sum the kernels take (what a minimum multiplies): 16 for q6k."""
        return 16 if self.kind == "q6k" else BLOCK

    def planar(self, r0: int = 0, r1: int | None = None) -> BlockWeight:
        """Rows [r0, r1) back in the planar layout (for lookups and prefill tiles)."""
        r1 = self.n if r1 is None else r1
        if self.kind in ("q4k", "q6k"):
            return _k_planar(self, r0, r1)
        t0, t1 = r0 // ROWS, -(-r1 // ROWS)
        T, nb, ng = t1 - t0, self.qs.shape[1], self.d.shape[1]
        d = self.d[t0:t1].transpose(0, 2, 1).reshape(T * ROWS, ng).astype(np.float32)
        if self.m is not None:
            m = self.m[t0:t1].transpose(0, 2, 1).reshape(T * ROWS, ng).astype(np.float32)
        else:
            m = -8 * d if self.kind == "q4" else None  # Q4_0's minimum
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


def _rows8(a: np.ndarray, T: int) -> np.ndarray:
    """[N, ...] -> [T, 8, ...], zero rows after N."""
    pad = T * ROWS - a.shape[0]
    if pad:
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
    return a.reshape((T, ROWS) + a.shape[1:])


def _lanes(a: np.ndarray, T: int) -> np.ndarray:
    """Per-row values [N, B] -> [T, B, 8]: the 8 rows of a tile side by side."""
    return _rows8(a, T).transpose(0, 2, 1)


def _nibbles(q4: np.ndarray, T: int, nb: int) -> np.ndarray:
    """Planar q4 bytes [N, K/2] -> the tiles' [T, nb, 4, 32]."""
    q = _rows8(q4, T).reshape(T, ROWS, nb, 4, 4).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(q).reshape(T, nb, 4, ROWS * 4)


def _repack_k(w: BlockWeight, digits: int, outliers: bool) -> TiledWeight:
    """Q4_K / Q6_K with whole super-blocks, keeping the file's integer scales."""
    assert w.ks is not None
    N, K = w.shape
    nb, T = K // BLOCK, -(-N // ROWS)
    ks = w.ks
    if w.source == "Q4_K":
        d = np.concatenate([_lanes(ks["sc"], T), _lanes(ks["mn"], T)], axis=2)
        m = np.concatenate([_lanes(ks["d"], T), _lanes(ks["dmin"], T)], axis=2)
        m = m.astype(np.float16) if _halves(m) else m
        return TiledWeight("q4k", _nibbles(w.qs, T, nb), np.ascontiguousarray(d), np.ascontiguousarray(m), N,
                           w.source, digits, outliers)  # fmt: skip
    u = (w.qs.astype(np.int16) + 32).astype(np.uint8).reshape(N, nb, 2, 16)  # 0..63
    lo = (u[:, :, 0] & 15) | ((u[:, :, 1] & 15) << 4)  # as Q4_0 packs a block: [N, nb, 16]
    hi = (u >> 4).reshape(N, nb, 2, 4, 4)  # [.., half, group g, j]
    hb = (hi << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)).sum(axis=3, dtype=np.uint8)  # [N, nb, 2, 4]
    hv = _rows8(hb, T).transpose(0, 2, 3, 1, 4).reshape(T, nb, 2, ROWS * 4)
    qs = np.concatenate([_nibbles(lo.reshape(N, nb * 16), T, nb), hv], axis=2)
    sc = _rows8(ks["sc"].reshape(N, nb, 2), T).transpose(0, 2, 3, 1).reshape(T, nb, 2 * ROWS)
    dd = np.ascontiguousarray(_lanes(ks["d"], T))
    return TiledWeight("q6k", np.ascontiguousarray(qs), np.ascontiguousarray(sc),
                       dd.astype(np.float16) if _halves(dd) else dd, N, w.source, digits, outliers)  # fmt: skip


def _k_planar(t: TiledWeight, r0: int, r1: int) -> BlockWeight:
    """Rows [r0, r1) of a q4k/q6k tiled weight as the planar weight it came from."""
    t0, t1 = r0 // ROWS, -(-r1 // ROWS)
    T, nb = t1 - t0, t.qs.shape[1]
    a, b = r0 - t0 * ROWS, r1 - t0 * ROWS

    def rows(v: np.ndarray) -> np.ndarray:  # [T, B, 8] -> [rows, B]
        return v.transpose(0, 2, 1).reshape(T * ROWS, -1)[a:b]

    lo = t.qs[t0:t1, :, :4].reshape(T, nb, 4, ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(T * ROWS, nb * 16)[a:b]
    S = nb * BLOCK // SUPER
    assert t.m is not None
    if t.kind == "q4k":
        sc, mn = rows(t.d[t0:t1, :, :ROWS]), rows(t.d[t0:t1, :, ROWS:])
        dd, dmin = rows(t.m[t0:t1, :, :ROWS]).astype(np.float32), rows(t.m[t0:t1, :, ROWS:]).astype(np.float32)
        d = (dd[:, :, None] * sc.reshape(-1, S, 8).astype(np.float32)).reshape(-1, nb)
        m = -(dmin[:, :, None] * mn.reshape(-1, S, 8).astype(np.float32)).reshape(-1, nb)
        ks = {"sc": sc, "mn": mn, "d": dd, "dmin": dmin}
        return BlockWeight("q4", np.ascontiguousarray(lo), d, m, t.source, ks)
    hv = t.qs[t0:t1, :, 4:].reshape(T, nb, 2, ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(T * ROWS, nb, 2, 1, 4)[a:b]
    hi = (hv >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # [rows, nb, half, g, j]
    lo2 = lo.reshape(-1, nb, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1) & 15  # [rows, nb, half, 16]
    u = lo2 | (hi.reshape(-1, nb, 2, 16) << 4)
    q = (u.astype(np.int16) - 32).astype(np.int8).reshape(-1, nb * BLOCK)
    sc = t.d[t0:t1].reshape(T, nb, 2, ROWS).transpose(0, 3, 1, 2).reshape(T * ROWS, 2 * nb)[a:b]
    dd = rows(t.m[t0:t1]).astype(np.float32)
    d = (dd[:, :, None] * sc.reshape(-1, S, 16).astype(np.float32)).reshape(-1, 2 * nb)
    return BlockWeight("q8", q, d, None, t.source, {"sc": np.ascontiguousarray(sc), "d": dd})


def repack(w: BlockWeight, digits: int = 1, outliers: bool = False) -> TiledWeight:
    """A planar q4/q8 weight in tiles (a copy; the planar arrays can be dropped). Q4_K and
    Q6_K with whole super-blocks keep their integer scales (q4k, q6k)."""
    if w.kind not in ("q4", "q8"):
        raise ValueError(f"no tiles for {w.kind} weights")
    if w.ks is not None and w.source in ("Q4_K", "Q6_K") and w.shape[1] % SUPER == 0:
        return _repack_k(w, digits, outliers)
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
    m = w.m if w.kind == "q4" else None
    if m is not None and np.array_equal(m, -8 * w.d):
        m = None  # Q4_0: the kernels form -8·d
    dt = np.float16 if all(_halves(a) for a in (w.d, m) if a is not None) else np.float32
    return TiledWeight(w.kind, qs, scales(w.d).astype(dt), None if m is None else scales(m).astype(dt), N, w.source,
                       digits, outliers)  # fmt: skip


def _halves(a: np.ndarray) -> bool:
    """Every value of ``a`` is a float16 exactly (a file's scales; not formed products)."""
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))
