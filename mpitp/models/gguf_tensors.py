"""The tensor table of a GGUF file, read without building its metadata.

``gguf.GGUFReader`` builds a NumPy view for every part of every metadata value: for a
file carrying its tokenizer (SmolLM2's 49,152 tokens and 48,900 merges) that is ~250,000
views and 3-4 s on every rank of every load. Loading weights needs only the tensor table,
so this walks the metadata by its lengths (struct over the memory map) and reads the
tensor infos; values come out as the reader's would (same dtype and shape per tensor:
native types as their NumPy dtype, quantized ones as bytes [rows, row bytes]).

Layout (little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, value type u32, value)      string = u64 length + bytes
    n_tensors x (name: string, n_dims u32, dims u64 x n_dims, type u32, offset u64)
    padding to general.alignment (32 by default) | tensor data (offsets from here)

Anything else (big-endian files, version 1) goes through ``gguf.GGUFReader``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# sizes of GGUF's scalar value types (gguf.GGUFValueType: 8 is string, 9 array)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_NATIVE = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
           "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass
class Tensor:
    name: str
    type_name: str  # gguf.GGMLQuantizationType's name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # ggml's order (innermost first), as GGUFReader's ``shape``
    data: np.ndarray  # a read-only view of the file


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return v if len(v) > 1 else v[0]

    def string(self) -> bytes:
        n = self.take("Q")
        s = self.buf[self.at : self.at + n]
        if len(s) != n:
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return bytes(s)

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.at += _SCALAR[vtype]
        elif vtype == _STRING:
            n = self.take("Q")  # the length (read before adding: it moves self.at)
            self.at += n
        elif vtype == _ARRAY:
            itype, count = self.take("IQ")
            if itype in _SCALAR:
                self.at += _SCALAR[itype] * count
            elif itype == _STRING:  # a tokenizer's vocabulary: ~50,000 of them
                buf, at, unpack = self.buf, self.at, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    at += 8 + unpack(buf, at)[0]
                self.at = at
            else:
                for _ in range(count):
                    self.skip_value(itype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")
        if self.at > len(self.buf):
            raise ValueError("the metadata runs past the end of the file")


def read_tensors(path: str | Path) -> list[Tensor]:
    """The tensors of the GGUF file at ``path`` (raises ValueError or struct.error on a
    malformed or truncated file)."""
    import gguf

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{size} bytes: too short for a GGUF header")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    magic, version = c.take("4sI")
    if magic != b"GGUF":
        raise ValueError(f"not a GGUF file (magic {magic!r})")
    if version not in (2, 3):  # big-endian files read version as 2<<24 or 3<<24; v1 is older
        return [_from_reader(t) for t in gguf.GGUFReader(str(path)).tensors]
    n_tensors, n_kv = c.take("QQ")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = c.string(), c.take("I")
        if key == b"general.alignment" and vtype == _UINT32:
            alignment = c.take("I")
        else:
            c.skip_value(vtype)
    infos, names = [], set()
    for _ in range(n_tensors):
        name = c.string().decode("utf-8")
        if name in names:
            raise ValueError(f"duplicated tensor {name}")
        names.add(name)
        n_dims = c.take("I")
        dims = tuple(int(d) for d in struct.unpack_from(f"<{n_dims}Q", buf, c.at))
        c.at += 8 * n_dims
        ttype, offset = c.take("IQ")
        infos.append((name, gguf.GGMLQuantizationType(ttype), dims, offset))
    start = -(-c.at // alignment) * alignment
    tensors = []
    for name, qtype, dims, offset in infos:
        n = int(np.prod(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        np_dims = tuple(reversed(dims))
        if qtype.name in _NATIVE:
            dtype, count = np.dtype(_NATIVE[qtype.name]), n
        else:
            dtype, count = np.dtype(np.uint8), n * type_size // block
            np_dims = gguf.quant_shape_to_byte_shape(np_dims, qtype)
        at = start + offset
        if at + count * dtype.itemsize > size:
            raise ValueError(f"tensor {name}'s data runs past the end of the file ({size} bytes)")
        data = np.frombuffer(buf, dtype, count, at).reshape(np_dims)
        tensors.append(Tensor(name, qtype.name, dims, data))
    return tensors


def _from_reader(t) -> Tensor:
    return Tensor(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape.tolist()), t.data)
