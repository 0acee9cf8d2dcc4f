"""Calling the compiled IR kernels (:mod:`.jit`) from numba by address.

numba can call a ctypes function object, but passing one into a jitted function costs
~1.1 µs of type dispatch per call (it is typed anew each time); an integer costs ~0.03.
So the kernels travel as their addresses (:func:`address`), and these intrinsics call
them: ``inttoptr`` to a function of i64 arguments (pointers and integers go in the same
registers on x86-64 System V), then ``call``. The three shapes are :mod:`.jit`'s::

    kernel_at(f, qs, d, m, xq, xd, xs, y, T, nb, M, ldy)          PROTO:  the int8 matmuls
    quantizer_at(f, x, xq, xd, xs, M, K, halves)                  QPROTO: the IR quantizers
    attention_at(f, q, k, v, valid, out, sc, knew, vnew, S, stride, masked)   APROTO
"""

from __future__ import annotations

import ctypes

from numba import types
from numba.extending import intrinsic


def address(fn) -> int:
    """The entry point of a ctypes function (what the intrinsics take)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _call(typingctx, args):
    """Typing and code of ``call(f, a1, ..., an)``: every argument an integer, no result."""
    if not all(isinstance(a, types.Integer) for a in args):
        return None

    def codegen(context, builder, signature, llargs):
        from llvmlite import ir

        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64] * (len(llargs) - 1))
        vals = [v if v.type.width == 64 else builder.sext(v, i64) for v in llargs[1:]]
        builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), vals)
        return context.get_dummy_value()

    return types.void(*args), codegen


@intrinsic
def kernel_at(typingctx, f, qs, d, m, xq, xd, xs, y, T, nb, M, ldy):
    """The int8 matmul kernel at address ``f`` (:data:`.jit.PROTO`)."""
    return _call(typingctx, (f, qs, d, m, xq, xd, xs, y, T, nb, M, ldy))


@intrinsic
def quantizer_at(typingctx, f, x, xq, xd, xs, M, K, halves):
    """The IR quantizer at address ``f`` (:data:`.jit.QPROTO`)."""
    return _call(typingctx, (f, x, xq, xd, xs, M, K, halves))


@intrinsic
def attention_at(typingctx, f, q, k, v, valid, out, sc, knew, vnew, S, stride, masked):
    """Decode attention's core at address ``f`` (:data:`.jit.APROTO`)."""
    return _call(typingctx, (f, q, k, v, valid, out, sc, knew, vnew, S, stride, masked))
