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
32 weights over the file (4 for Q4_1). K-quants (Q4_K, Q5_K, Q6_K, ...) and the other
types the ``gguf`` package decodes are converted once at load to Q8_0, whose error
(half a step of amax/127 per block of 32) is far below theirs.

F16 and BF16 tensors stay 16-bit (kinds ``f16``/``bf16``: ``qs`` [N, K] uint16, the
file's bits; no scales), widened to float32 inside the kernels (:mod:`.half`).

Row slices are whole output rows (column-parallel cuts); column slices are whole blocks
(row-parallel cuts on multiples of 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32
HALF = {"F16": "f16", "BF16": "bf16"}  # ggml type -> kind of the 16-bit floats kept as bits


@dataclass
class BlockWeight:
    kind: str  # "q4" (Q4_0, Q4_1), "q8" (Q8_0), "f16" or "bf16" (16-bit floats)
    qs: np.ndarray
    d: np.ndarray | None  # None for f16/bf16
    m: np.ndarray | None
    source: str  # the file's type name (Q4_1, Q8_0, Q6_K->Q8_0, ...)
    layout = "planar"  # (int8 kernels' tiles: mpitp.kernels.tiles)

    @property
    def shape(self) -> tuple[int, int]:
        if self.d is None:  # 16-bit floats: one weight per element
            return self.qs.shape[0], self.qs.shape[1]
        return self.qs.shape[0], self.d.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + sum(a.nbytes for a in (self.d, self.m) if a is not None)

    def rows(self, a: int, b: int) -> BlockWeight:
        d, m = (None if f is None else f[a:b] for f in (self.d, self.m))
        return BlockWeight(self.kind, self.qs[a:b], d, m, self.source)

    def cols(self, a: int, b: int) -> BlockWeight:
        if self.d is None:
            return BlockWeight(self.kind, self.qs[:, a:b], None, None, self.source)
        if a % BLOCK or b % BLOCK:
            raise ValueError(f"columns [{a}, {b}) are not on {BLOCK}-weight block boundaries")
        per = BLOCK // 2 if self.kind == "q4" else BLOCK
        ba, bb = a // BLOCK, b // BLOCK
        m = None if self.m is None else self.m[:, ba:bb]
        return BlockWeight(self.kind, self.qs[:, ba * per : bb * per], self.d[:, ba:bb], m, self.source)

    def contiguous(self) -> BlockWeight:
        d, m = (None if f is None else np.ascontiguousarray(f) for f in (self.d, self.m))
        return BlockWeight(self.kind, np.ascontiguousarray(self.qs), d, m, self.source)

    def dequantize(self) -> np.ndarray:
        from .matmul import dequantize_rows

        return dequantize_rows(self.contiguous(), 0, self.shape[0])


def empty(kind: str, n: int, k: int, source: str) -> BlockWeight:
    """Zeros (value 0: d = 0, m = 0) of ``n`` rows, ``k`` columns."""
    nb = k // BLOCK
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
    d = None if parts[0].d is None else np.concatenate([p.d for p in parts])
    m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
    sources = sorted({p.source for p in parts})
    return BlockWeight(parts[0].kind, np.concatenate([p.qs for p in parts]), d, m, "+".join(sources))


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
    import gguf

    w = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[type_name])
    q = quantize_q8_0(np.asarray(w, np.float32).reshape(n, -1))
    q.source = f"{type_name}->Q8_0"
    return q


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
