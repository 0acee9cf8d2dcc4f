"""Reduction operations and the dtypes MPI carries.

``ReduceOp`` names an operation once; from it come MPI's own op (for ``algorithm="mpi"``)
and the element-wise ufunc the hand-written algorithms apply on the array's own device.
``avg`` is a sum divided by the number of ranks afterwards (Horovod's and torch's AVG,
floating dtypes only); ``band``/``bor``/``bxor`` are bitwise, for integers and bool.
bfloat16 (``ml_dtypes``) travels as 16-bit words; each addition of two bfloat16 operands
is computed in float32 and rounded once (ml_dtypes' ufuncs), as torch's bf16 all-reduce
does per hop, and MPI's own call reduces it with a user op applying the same ufunc.
ml_dtypes is imported only when bfloat16 is asked for (:func:`bfloat16`): its import takes
about a second, which every rank of every launch would pay; a bfloat16 array is known by
its dtype's name, so recognising one needs no import (one exists only once it is loaded).
"""

from __future__ import annotations

import enum
from functools import cache

import numpy as np
from mpi4py import MPI

from ..errors import UnsupportedOperation


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @property
    def base(self) -> ReduceOp:
        """The op the algorithms run (avg: a sum, divided afterwards)."""
        return ReduceOp.SUM if self is ReduceOp.AVG else self

    @property
    def commutative(self) -> bool:
        return True  # all built-in ops; user ops would set this

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            names = ", ".join(o.value for o in cls)
            raise UnsupportedOperation(f"unknown reduction op {op!r}; expected one of {names}") from None


@cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 (imported on first use)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def is_bf16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16" and dtype.itemsize == 2


SUPPORTED = ("bfloat16",) + tuple(  # the dtypes' names
    t
    for t in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
    )
)
_NATIVE = tuple(np.dtype(t) for t in SUPPORTED[1:])

_UFUNC = {
    ReduceOp.SUM: "add",
    ReduceOp.PROD: "multiply",
    ReduceOp.MAX: "maximum",
    ReduceOp.MIN: "minimum",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}
_MPI_OP = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.PROD: MPI.PROD,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _NATIVE and not is_bf16(dtype):
        raise UnsupportedOperation(
            f"dtype {dtype} cannot be carried by mpitp collectives; supported: " + ", ".join(SUPPORTED)
        )
    return dtype


def check_reducible(op: ReduceOp, dtype: np.dtype) -> None:
    """Refuse combinations that have no meaning (bool sum, complex max, float xor, ...)."""
    if op in _BITWISE and dtype.kind not in "iub":
        raise UnsupportedOperation(f"op {op.value!r} is bitwise: it needs an integer or bool dtype, not {dtype}")
    if op is ReduceOp.AVG and not (dtype.kind in "fc" or is_bf16(dtype)):
        raise UnsupportedOperation(
            f"op 'avg' needs a floating dtype (an average of {dtype} is not one); use 'sum' and divide"
        )
    if dtype == np.bool_ and op in (ReduceOp.SUM, ReduceOp.PROD):
        raise UnsupportedOperation(f"op {op.value!r} is not defined for bool arrays (use 'max' or 'min')")
    if dtype.kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
        raise UnsupportedOperation(f"op {op.value!r} is not defined for complex arrays")


def average(a, n: int):
    """``a / n`` in place (bfloat16 through float32, rounded once)."""
    if n == 1:
        return a
    if is_bf16(a.dtype):
        a[...] = (a.astype(np.float32) / n).astype(a.dtype)
    else:
        a /= n
    return a


def ufunc(op: ReduceOp, xp=np):
    """Element-wise binary function of ``op`` (its ``base``) in namespace ``xp`` (numpy or cupy)."""
    return getattr(xp, _UFUNC[op.base])


@cache
def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """MPI's predefined datatype for a NumPy dtype (the one mpi4py infers from a buffer of
    it); 16-bit words for bfloat16, and for float16 where the MPI library has no half type
    (reductions then use a user op).

    Predefined, not ``dtlib.from_numpy_dtype``'s: that returns a duplicate of it, a derived
    type on which MPI's own SUM/MAX/... are undefined (MPICH refuses them), so every
    reduction fell back to the Python user op."""
    dtype = np.dtype(dtype)
    if is_bf16(dtype):
        return MPI.UINT16_T
    try:
        dt = MPI.Datatype.fromcode(dtype.char)
    except (KeyError, ValueError):
        dt = MPI.DATATYPE_NULL
    if dt == MPI.DATATYPE_NULL:
        if dtype.itemsize == 2:
            return MPI.UINT16_T
        raise UnsupportedOperation(f"MPI has no datatype for {dtype}")
    return dt


@cache
def inferred(dtype: np.dtype) -> bool:
    """Whether mpi4py infers ``mpi_datatype(dtype)`` from a buffer of this dtype by itself
    (then a plain array may be handed to MPI without a datatype)."""
    dtype = np.dtype(dtype)
    try:
        return not is_bf16(dtype) and MPI.Datatype.fromcode(dtype.char) == mpi_datatype(dtype)
    except (KeyError, ValueError):
        return False


def _probe_values(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Operands that expose wrong integer semantics (saturation instead of wrap-around)."""
    n = 256  # long enough to take vectorised code paths
    if dtype == np.bool_:
        a = np.arange(n) % 2 == 0
        return a, np.arange(n) % 3 == 0
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = np.resize(np.array([info.max, info.min, info.max - 1, 3, 0], dtype), n)
        return a, np.resize(np.array([info.max, info.min, 2, 5, 1], dtype), n)
    a = (np.arange(n) % 7 - 3).astype(dtype)
    return a, (np.arange(n) % 5 - 2).astype(dtype)


@cache
def _native_reduction_ok(op: ReduceOp, dtype_char: str) -> bool:
    """Does MPI's predefined ``op`` compute this dtype the way NumPy does?

    Probed once per (op, dtype) with ``Op.Reduce_local``: some MPI builds lack an op for a
    type (MPICH has no bool SUM), and some compute it wrongly (Open MPI 5.0's AVX op
    component saturates 8- and 16-bit integer sums instead of wrapping). Either way mpitp
    then uses a user-defined op that applies the NumPy ufunc.
    """
    dtype = _dtype(dtype_char)
    if is_bf16(dtype):  # 16-bit words to MPI: its SUM would add the bit patterns
        return False
    a, b = _probe_values(dtype)
    want = ufunc(op)(a, b)
    mpi_op = _bool_op(op) if dtype == np.bool_ else _MPI_OP[op]
    dt = mpi_datatype(dtype)
    try:
        with np.errstate(all="ignore"):
            mpi_op.Reduce_local([a, dt], [b, dt])
    except MPI.Exception:
        return False
    return bool(np.array_equal(b, want))


def _bool_op(op: ReduceOp) -> MPI.Op:
    # MPI defines MAX/MIN only for numbers; on booleans they are logical or / and.
    return MPI.LOR if op is ReduceOp.MAX else MPI.LAND


@cache
def _user_op(op: ReduceOp, dtype_char: str) -> MPI.Op:
    """A user-defined MPI op applying the NumPy ufunc, for dtypes MPI cannot reduce itself."""
    dtype = _dtype(dtype_char)
    fn = ufunc(op)

    def apply(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, dtype)
        b = np.frombuffer(inoutbuf, dtype)
        fn(a, b, out=b)

    return MPI.Op.Create(apply, commute=True)


def _dtype(char: str) -> np.dtype:
    try:
        return np.dtype(char)
    except TypeError:  # bfloat16's "E" (NumPy knows it by its type only): ml_dtypes is loaded
        dt = bfloat16()
        if dt.char != char:
            raise
        return dt


def mpi_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
    """The MPI op to hand to MPI's own collectives for ``op`` (its ``base``) on ``dtype``."""
    dtype = np.dtype(dtype)
    check_reducible(op, dtype)
    op = op.base
    if _native_reduction_ok(op, dtype.char):
        return _bool_op(op) if dtype == np.bool_ else _MPI_OP[op]
    return _user_op(op, dtype.char)
