"""Weights in their block formats, held planar for the kernels.

ggml stores a weight ``[N, K]`` as N rows of K/32 blocks (block layouts in the ``gguf``
package's ``quants.py``)::

    Q8_0  per block: fp16 d, 32 x int8 q                 w = d·q
    Q4_0  per block: fp16 d, 16 bytes (two 4-bit q each)  w = d·(q - 8)
    Q4_1  per block: fp16 d, fp16 m, 16 bytes             w = d·q + m

:class:`BlockWeight` keeps the same quants, moved into one array per field (a "repack",
as ggml's own CPU backend does): ``qs`` [N, K/2] uint8 or [N, K] int8, and the scales
(and minimums) as float32 [N, K/32], converted once at load so that the inner loop
multiplies without a conversion (numba has no float16). The values are exactly the
file's: Q4_0 becomes the q4 case ``m = -8d`` (exact in float32). It costs 2 bytes per
32 weights over the file (4 for Q4_1). Other types are repacked exactly where a planar
form holds them::

    Q4_K  per 256: fp16 d, dmin, 8 six-bit scales sc and mins m, 4-bit q
          -> q4, per 32: d·sc and -dmin·m (float32, exact), q as Q4_0 lays it out
    Q6_K  per 256: 6-bit q (4 + 2 bits), int8 scale per 16, fp16 d
          -> q8 with a scale per 16 (d·sc, exact), q - 32 as int8
    Q5_0  per 32: fp16 d, 5-bit q  -> q8: q - 16 as int8

and the values equal the ``gguf`` package's dequantization bit for bit. The remaining
types the ``gguf`` package decodes (Q5_K, Q2_K, ...) are converted once at load to Q8_0,
whose error (half a step of amax/127 per block of 32) is far below theirs.

``q8`` scales are per 32 weights, or per 16 (Q6_K): ``group`` = K / scales per row.

F16 and BF16 tensors stay 16-bit (kinds ``f16``/``bf16``: ``qs`` [N, K] uint16, the
file's bits; no scales), widened to float32 inside the kernels (:mod:`.half`).

Row slices are whole output rows (column-parallel cuts); column slices are whole blocks
(row-parallel cuts on multiples of 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dequant import dequantize_rows

BLOCK = 32
SUPER = 256  # weights per K-quant super-block
HALF = {"F16": "f16", "BF16": "bf16"}  # ggml type -> kind of the 16-bit floats kept as bits


@dataclass
class BlockWeight:
    kind: str  # "q4" (Q4_0, Q4_1), "q8" (Q8_0), "f16" or "bf16" (16-bit floats)
    qs: np.ndarray
    d: np.ndarray | None  # None for f16/bf16
    m: np.ndarray | None
    source: str  # the file's type name (Q4_1, Q8_0, Q6_K->Q8_0, ...)
    # Q4_K / Q6_K: the file's super-block form beside the planar one, for the int8 tiles
    # (mpitp.kernels.tiles), each array [N, K/per] (per = 32, 16 or 256 weights):
    #   Q4_K  sc, mn uint8 per 32; d, dmin float32 per 256   planar d = d·sc, m = -(dmin·mn)
    #   Q6_K  sc int8 per 16; d float32 per 256               planar d = d·sc
    # None where a cut missed a super-block boundary or pieces of other types were joined.
    ks: dict[str, np.ndarray] | None = None
    layout = "planar"  # (int8 kernels' tiles: mpitp.kernels.tiles)

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "q4":  # two weights a byte
            return self.qs.shape[0], self.qs.shape[1] * 2
        return self.qs.shape[0], self.qs.shape[1]  # q8: int8, f16/bf16: 16 bits a weight

    @property
    def group(self) -> int:
        """Weights per scale (32; 16 for Q6_K's)."""
        return BLOCK if self.d is None else self.shape[1] // self.d.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + sum(a.nbytes for a in (self.d, self.m) if a is not None)

    def rows(self, a: int, b: int) -> BlockWeight:
        d, m = (None if f is None else f[a:b] for f in (self.d, self.m))
        ks = None if self.ks is None else {k: v[a:b] for k, v in self.ks.items()}
        return BlockWeight(self.kind, self.qs[a:b], d, m, self.source, ks)

    def cols(self, a: int, b: int) -> BlockWeight:
        if self.d is None:
            return BlockWeight(self.kind, self.qs[:, a:b], None, None, self.source)
        if a % BLOCK or b % BLOCK:
            raise ValueError(f"columns [{a}, {b}) are not on {BLOCK}-weight block boundaries")
        per = BLOCK // 2 if self.kind == "q4" else BLOCK
        ba, bb = a // BLOCK, b // BLOCK
        m = None if self.m is None else self.m[:, ba:bb]
        g = self.group
        ks = None  # kept only for a cut on super-block boundaries
        if self.ks is not None and a % SUPER == 0 and b % SUPER == 0:
            K = self.shape[1]
            ks = {k: v[:, a * v.shape[1] // K : b * v.shape[1] // K] for k, v in self.ks.items()}
        return BlockWeight(self.kind, self.qs[:, ba * per : bb * per], self.d[:, a // g : b // g], m, self.source, ks)

    def contiguous(self) -> BlockWeight:
        d, m = (None if f is None else np.ascontiguousarray(f) for f in (self.d, self.m))
        ks = None if self.ks is None else {k: np.ascontiguousarray(v) for k, v in self.ks.items()}
        return BlockWeight(self.kind, np.ascontiguousarray(self.qs), d, m, self.source, ks)

    def dequantize(self) -> np.ndarray:
        return dequantize_rows(self.contiguous(), 0, self.shape[0])


@dataclass
class Pieces:
    """A merged weight whose row ranges are held in different kinds (a Q4_K_M file's qkv:
    Q4_K q and k beside a Q6_K v), each piece exactly as its file holds it::

        rows [0, n0)        piece 0   (q4: q and k)
        rows [n0, n0 + n1)  piece 1   (q8: v)

    The matmul runs each piece's kernel into its columns of y."""

    parts: list  # BlockWeight or TiledWeight, in row order
    kind = "pieces"
    layout = "pieces"

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(p.source for p in self.parts))

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for p in self.parts:
            out.append(at)
            at += p.shape[0]
        return out

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts])


def leaves(w) -> list:
    """The weights that hold arrays: a :class:`Pieces`' parts, else ``w`` itself."""
    return list(w.parts) if getattr(w, "layout", "") == "pieces" else [w]


def join_pieces(parts: list[BlockWeight]) -> BlockWeight | Pieces:
    """Row pieces of one weight: one weight where they are of one kind, else runs of the
    same kind joined, each kept exactly as it is."""
    runs: list[list[BlockWeight]] = []
    for p in parts:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = [r[0].contiguous() if len(r) == 1 else concat_rows(r) for r in runs]
    return joined[0] if len(joined) == 1 else Pieces(joined)


def empty(kind: str, n: int, k: int, source: str, like: BlockWeight | None = None) -> BlockWeight:
    """Zeros (value 0: d = 0, m = 0) of ``n`` rows, ``k`` columns (with a super-block form
    of zeros too where ``like`` has one, so that joining them keeps it)."""
    nb = k // BLOCK
    if like is not None and like.ks is not None:
        z = empty(kind, n, k, source)
        z.ks = {key: np.zeros((n,) + v.shape[1:], v.dtype) for key, v in like.ks.items()}
        return z
    if kind in HALF.values():
        return BlockWeight(kind, np.zeros((n, k), np.uint16), None, None, source)
    if kind == "q4":
        return BlockWeight(kind, np.zeros((n, nb * 16), np.uint8), np.zeros((n, nb), np.float32),
                           np.zeros((n, nb), np.float32), source)  # fmt: skip
    return BlockWeight(kind, np.zeros((n, k), np.int8), np.zeros((n, nb), np.float32), None, source)


def concat_rows(parts: list[BlockWeight]) -> BlockWeight:
    """One weight of the parts' rows, in order (all of one kind and width)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("concat_rows: parts differ in kind or width")
    if parts[0].d is None:
        d = None
    else:  # q8 with a scale per 32 beside one per 16 (Q6_K): each per-32 scale twice, exactly
        g = min(p.group for p in parts)
        scales = [p.d for p in parts if p.d is not None]
        if len(scales) != len(parts):
            raise ValueError("concat_rows: some parts have no scales")
        d = np.concatenate([np.repeat(s, p.group // g, axis=1) for s, p in zip(scales, parts)])
    m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
    sources = sorted({p.source for p in parts})
    ks = None
    if len(sources) == 1 and all(p.ks is not None for p in parts):
        keys = parts[0].ks.keys()  # type: ignore[union-attr]
        ks = {k: np.concatenate([p.ks[k] for p in parts]) for k in keys}  # type: ignore[index]
    return BlockWeight(parts[0].kind, np.concatenate([p.qs for p in parts]), d, m, "+".join(sources), ks)


def from_ggml(raw: np.ndarray, type_name: str) -> BlockWeight:
    """A ggml tensor's bytes [N, row bytes] (uint8) as a planar weight. Native types keep
    their quants; any other type the ``gguf`` package decodes becomes Q8_0."""
    n = raw.shape[0]
    if type_name in HALF:  # the reader may hand the tensor over as float16 or as bytes
        bits = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1).view(np.uint16)
        return BlockWeight(HALF[type_name], bits.copy(), None, None, type_name)
    if type_name == "Q8_0":
        blk = raw.reshape(n, -1, 34)
        d = blk[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        return BlockWeight("q8", blk[:, :, 2:].reshape(n, -1).view(np.int8).copy(), d, None, "Q8_0")
    if type_name == "Q4_1":
        blk = raw.reshape(n, -1, 20)
        d = blk[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        m = blk[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
        return BlockWeight("q4", blk[:, :, 4:].reshape(n, -1).copy(), d, m, "Q4_1")
    if type_name == "Q4_0":
        blk = raw.reshape(n, -1, 18)
        d = blk[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        return BlockWeight("q4", blk[:, :, 2:].reshape(n, -1).copy(), d, -8 * d, "Q4_0")
    if type_name in REPACK:
        return REPACK[type_name](np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1))
    import gguf

    w = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[type_name])
    q = quantize_q8_0(np.asarray(w, np.float32).reshape(n, -1))
    q.source = f"{type_name}->Q8_0"
    return q


def _f16(a: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] of float16 -> float32 [...]."""
    return a.copy().view(np.float16)[..., 0].astype(np.float32)


def from_q4_k(raw: np.ndarray) -> BlockWeight:
    """Q4_K rows [N, 144·K/256] -> q4 (the ``gguf`` package's Q4_K.get_scale_min unpacking)."""
    n = raw.shape[0]
    blk = raw.reshape(n, -1, 144)
    d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])  # [N, S]
    sc6 = blk[..., 4:16].reshape(n, -1, 3, 4)
    a, b, c = sc6[..., 0, :], sc6[..., 1, :], sc6[..., 2, :]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [N, S, 8]
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    nib = blk[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    q = (nib & 0x0F).reshape(n, -1, 8, 32)  # [N, S, sub-block, 32 weights]
    packed = q[..., :16] | (q[..., 16:] << 4)  # as Q4_0 lays a block out
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    low = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    ks = {"sc": sc.reshape(n, -1), "mn": mn.reshape(n, -1), "d": d, "dmin": dmin}
    return BlockWeight("q4", packed.reshape(n, -1), scale, low, "Q4_K", ks)


def from_q6_k(raw: np.ndarray) -> BlockWeight:
    """Q6_K rows [N, 210·K/256] -> q8 with a scale per 16 weights."""
    n = raw.shape[0]
    blk = raw.reshape(n, -1, 210)
    lo4 = blk[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    hi2 = blk[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    ql, qh = (lo4 & 0x0F).reshape(n, -1, 2, 128), (hi2 & 0x03).reshape(n, -1, 2, 128)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    sci = blk[..., 192:208].copy().view(np.int8)  # [N, S, 16]
    d = _f16(blk[..., 208:210])
    ks = {"sc": sci.reshape(n, -1), "d": d}
    return BlockWeight("q8", q.reshape(n, -1), (d[..., None] * sci.astype(np.float32)).reshape(n, -1), None, "Q6_K", ks)


def from_q5_0(raw: np.ndarray) -> BlockWeight:
    """Q5_0 rows [N, 22·K/32] -> q8 (q - 16 as int8)."""
    n = raw.shape[0]
    blk = raw.reshape(n, -1, 22)
    d = _f16(blk[..., 0:2])
    qh = blk[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [N, B, 32]
    ql = blk[..., 6:22].reshape(n, -1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (ql & 0x0F).reshape(n, -1, 32) | (((qh & 1).astype(np.uint8)) << 4)
    return BlockWeight("q8", (q.astype(np.int8) - np.int8(16)).reshape(n, -1), d, None, "Q5_0")


REPACK = {"Q4_K": from_q4_k, "Q6_K": from_q6_k, "Q5_0": from_q5_0}


def quantize_q8_0(w: np.ndarray) -> BlockWeight:
    """float [N, K] (K a multiple of 32) -> Q8_0, as ggml quantizes it (d = amax/127 in
    fp16, q = round(w/d) half away from zero)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs rows that are a multiple of {BLOCK} long, got {k}")
    blk = np.asarray(w, np.float32).reshape(n, k // BLOCK, BLOCK)
    d = np.abs(blk).max(axis=-1) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    x = blk * inv[..., None]
    q = (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.int8)  # ggml's roundf
    return BlockWeight("q8", q.reshape(n, k), d.astype(np.float16).astype(np.float32), None, "Q8_0")
