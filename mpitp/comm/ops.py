"""Reduction operations and the dtypes MPI carries.

``ReduceOp`` names an operation once; from it come MPI's own op (for ``algorithm="mpi"``)
and the element-wise ufunc the hand-written algorithms apply on the array's own device.
"""
from __future__ import annotations

import enum
from functools import lru_cache

import numpy as np
from mpi4py import MPI

from ..errors import UnsupportedOperation


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"

    @property
    def commutative(self) -> bool:
        return True  # all built-in ops; user ops would set this

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            names = ", ".join(o.value for o in cls)
            raise UnsupportedOperation(f"unknown reduction op {op!r}; expected one of {names}") from None


SUPPORTED_DTYPES = tuple(
    np.dtype(t)
    for t in (
        "float16", "float32", "float64",
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
        "bool",
        "complex64", "complex128",
    )
)

_UFUNC = {ReduceOp.SUM: "add", ReduceOp.PROD: "multiply", ReduceOp.MAX: "maximum", ReduceOp.MIN: "minimum"}
_MPI_OP = {ReduceOp.SUM: MPI.SUM, ReduceOp.PROD: MPI.PROD, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedOperation(
            f"dtype {dtype} cannot be carried by mpitp collectives; supported: "
            + ", ".join(str(d) for d in SUPPORTED_DTYPES)
        )
    return dtype


def check_reducible(op: ReduceOp, dtype: np.dtype) -> None:
    """Refuse combinations that have no meaning (bool sum, complex max, ...)."""
    if dtype == np.bool_ and op in (ReduceOp.SUM, ReduceOp.PROD):
        raise UnsupportedOperation(f"op {op.value!r} is not defined for bool arrays (use 'max' or 'min')")
    if dtype.kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
        raise UnsupportedOperation(f"op {op.value!r} is not defined for complex arrays")


def ufunc(op: ReduceOp, xp=np):
    """Element-wise binary function of ``op`` in namespace ``xp`` (numpy or cupy)."""
    return getattr(xp, _UFUNC[op])


def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """MPI's predefined datatype for a NumPy dtype (C_BOOL for bool, C_FLOAT16-like for half)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return _float16_datatype()
    return MPI._typedict[dtype.char]


@lru_cache(maxsize=None)
def _float16_datatype() -> MPI.Datatype:
    # MPICH carries half floats as MPIX_C_FLOAT16; mpi4py maps typecode 'e' when the MPI
    # library has one. Otherwise ship the bytes (reductions then use a user op).
    dt = MPI._typedict.get("e")
    if dt is not None and dt != MPI.DATATYPE_NULL:
        return dt
    return MPI.UINT16_T


@lru_cache(maxsize=None)
def _native_reduction_ok(op: ReduceOp, dtype_char: str) -> bool:
    """Can MPI's predefined ``op`` reduce this dtype? Probed once on COMM_SELF."""
    dtype = np.dtype(dtype_char)
    x = np.ones(2, dtype)
    y = np.empty_like(x)
    mpi_op = _bool_op(op) if dtype == np.bool_ else _MPI_OP[op]
    try:
        MPI.COMM_SELF.Allreduce([x, mpi_datatype(dtype)], [y, mpi_datatype(dtype)], op=mpi_op)
    except MPI.Exception:
        return False
    return bool(np.all(y == x))


def _bool_op(op: ReduceOp) -> MPI.Op:
    # MPI defines MAX/MIN only for numbers; on booleans they are logical or / and.
    return MPI.LOR if op is ReduceOp.MAX else MPI.LAND


@lru_cache(maxsize=None)
def _user_op(op: ReduceOp, dtype_char: str) -> MPI.Op:
    """A user-defined MPI op applying the NumPy ufunc, for dtypes MPI cannot reduce itself."""
    dtype = np.dtype(dtype_char)
    fn = ufunc(op)

    def apply(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, dtype)
        b = np.frombuffer(inoutbuf, dtype)
        fn(a, b, out=b)

    return MPI.Op.Create(apply, commute=True)


def mpi_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
    """The MPI op to hand to MPI's own collectives for ``op`` on ``dtype``."""
    dtype = np.dtype(dtype)
    check_reducible(op, dtype)
    if _native_reduction_ok(op, dtype.char):
        return _bool_op(op) if dtype == np.bool_ else _MPI_OP[op]
    return _user_op(op, dtype.char)
