"""Where a weight comes from: a slice-able tensor that is read only where asked.

``rows(a, b)`` / ``cols(a, b)`` return float32 (or the requested dtype) NumPy arrays of
just that block; safetensors reads only those bytes (``get_slice``), so a rank never
reads the shards of other ranks. bf16 tensors are upcast through ``ml_dtypes`` (imported
when a checkpoint holds one).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TensorSource(Protocol):
    name: str
    shape: tuple

    def read(self) -> np.ndarray: ...
    def rows(self, a: int, b: int) -> np.ndarray: ...
    def cols(self, a: int, b: int) -> np.ndarray: ...


def _upcast(a: np.ndarray, dtype) -> np.ndarray:
    # bf16 arrives as ml_dtypes.bfloat16, which NumPy converts exactly to float32
    return np.asarray(a).astype(dtype, copy=False)


class ArraySource:
    """An in-memory tensor (tests, freshly made models)."""

    def __init__(self, name: str, array: np.ndarray, dtype=np.float32):
        self.name, self._a, self.dtype = name, np.asarray(array), dtype
        self.shape = tuple(self._a.shape)

    def read(self) -> np.ndarray:
        return _upcast(self._a, self.dtype)

    def rows(self, a: int, b: int) -> np.ndarray:
        return _upcast(self._a[a:b], self.dtype)

    def cols(self, a: int, b: int) -> np.ndarray:
        return _upcast(self._a[:, a:b], self.dtype)


class SafetensorsSource:
    """One tensor of an open safetensors file (``safe_open(path, "numpy")``)."""

    def __init__(self, handle, name: str, dtype=np.float32):
        self.name, self.dtype = name, dtype
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.bytes_read = 0
        if self.type_name == "BF16":  # safetensors hands bf16 over as ml_dtypes' type (imported only then:
            import ml_dtypes  # noqa: F401  # its import costs every rank about a second)

    def _take(self, block) -> np.ndarray:
        self.bytes_read += block.nbytes
        return _upcast(block, self.dtype)

    def read(self) -> np.ndarray:
        return self._take(self._slice[:])

    def rows(self, a: int, b: int) -> np.ndarray:
        return self._take(self._slice[a:b])

    def cols(self, a: int, b: int) -> np.ndarray:
        return self._take(self._slice[:, a:b])

    @property
    def type_name(self) -> str:
        """The stored type as ggml names it (F32, F16, BF16, ...)."""
        return str(self._slice.get_dtype())

    @property
    def quantized(self) -> bool:
        """16-bit floats are kept as they are stored (``block_rows``/``block_cols``)."""
        return self.type_name in ("F16", "BF16")

    def _bits(self, block):
        from ..kernels.weights.formats import from_ggml

        self.bytes_read += block.nbytes
        return from_ggml(np.asarray(block), self.type_name)

    def block_rows(self, a: int, b: int):
        return self._bits(self._slice[a:b])

    def block_cols(self, a: int, b: int):
        return self._bits(self._slice[:, a:b])


class GGUFSource:
    """One tensor of a GGUF file, memory-mapped: ``raw`` is its bytes [rows, row bytes]
    (a view of the file; nothing is read until a slice is asked for). ``perm`` reorders
    the rows (llama.cpp's q/k layout back to Hugging Face's) without touching the others.

    ``rows``/``cols``/``read`` give floats (dequantized, the ``gguf`` package's decoder);
    ``block_rows``/``block_cols`` give the quants themselves
    (:class:`~mpitp.kernels.weights.formats.BlockWeight`), only of the rows asked for."""

    def __init__(self, name: str, raw, type_name: str, shape: tuple, perm=None, dtype=np.float32):
        self.name, self._raw, self.type_name, self.dtype = name, raw, type_name, dtype
        self.shape = tuple(shape)
        self._perm = perm
        self.bytes_read = 0

    @property
    def quantized(self) -> bool:
        """Kept as the file stores it (block formats, 16-bit floats) rather than as float32."""
        return self.type_name not in ("F32", "F64")

    def _raw_rows(self, a: int, b: int):
        raw = self._raw if len(self.shape) > 1 else self._raw.reshape(1, -1)
        return raw[a:b] if self._perm is None else raw[self._perm[a:b]]

    def _count(self, block):
        self.bytes_read += block.nbytes
        return block

    def _floats(self, raw) -> np.ndarray:
        import gguf

        w = gguf.quants.dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[self.type_name])
        return np.asarray(w).astype(self.dtype, copy=False)

    def read(self) -> np.ndarray:
        if len(self.shape) == 1:
            return self._floats(self._count(self._raw_rows(0, 1))).reshape(self.shape)
        return self.rows(0, self.shape[0])

    def rows(self, a: int, b: int) -> np.ndarray:
        return self._floats(self._count(self._raw_rows(a, b))).reshape(b - a, *self.shape[1:])

    def cols(self, a: int, b: int) -> np.ndarray:
        import gguf

        per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type_name]]
        lo, hi = a // per, -(-b // per)  # the blocks that hold the columns
        raw = self._raw_rows(0, self.shape[0])
        raw = raw.view(np.uint8).reshape(raw.shape[0], -1)[:, lo * size : hi * size]
        w = self._floats(self._count(np.ascontiguousarray(raw))).reshape(self.shape[0], -1)
        return w[:, a - lo * per : b - lo * per]

    def block_rows(self, a: int, b: int):
        from ..kernels.weights.formats import from_ggml

        return from_ggml(self._count(self._raw_rows(a, b)), self.type_name)

    def block_cols(self, a: int, b: int):
        """Columns [a, b) of every row, on block boundaries. Only the blocks that hold them
        are converted (whole blocks of 32, or super-blocks of 256 for K-quants)."""
        import gguf

        from ..kernels.weights.formats import from_ggml

        per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type_name]]
        raw = self._raw_rows(0, self.shape[0])
        raw = raw.view(np.uint8).reshape(raw.shape[0], -1)  # bytes, whatever type the reader gave
        if a % per == 0 and b % per == 0:
            raw = raw[:, a // per * size : b // per * size]
            return from_ggml(self._count(np.ascontiguousarray(raw)), self.type_name)
        lo, hi = a // per * per, -(-b // per) * per  # the super-blocks around [a, b)
        raw = raw[:, lo // per * size : hi // per * size]
        return from_ggml(self._count(np.ascontiguousarray(raw)), self.type_name).cols(a - lo, b - lo)
