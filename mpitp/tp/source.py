"""Where a weight comes from: a slice-able tensor that is read only where asked.

``rows(a, b)`` / ``cols(a, b)`` return float32 (or the requested dtype) NumPy arrays of
just that block; safetensors reads only those bytes (``get_slice``), so a rank never
reads the shards of other ranks. bf16 tensors are upcast through ``ml_dtypes``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

try:  # registers bfloat16 with NumPy, so safetensors can hand bf16 tensors over
    import ml_dtypes  # noqa: F401
except ImportError:  # pragma: no cover
    pass


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

    def _take(self, block) -> np.ndarray:
        self.bytes_read += block.nbytes
        return _upcast(block, self.dtype)

    def read(self) -> np.ndarray:
        return self._take(self._slice[:])

    def rows(self, a: int, b: int) -> np.ndarray:
        return self._take(self._slice[a:b])

    def cols(self, a: int, b: int) -> np.ndarray:
        return self._take(self._slice[:, a:b])
