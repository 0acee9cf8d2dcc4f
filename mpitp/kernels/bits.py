"""Reading 16-bit floats inside numba kernels, which have no float16 type: a bit cast.

``f32_bits(u)`` is the float32 whose bits are ``u`` (one LLVM ``bitcast``, no memory);
:func:`h2f` widens IEEE half-precision bits exactly: the sign moves to bit 31, exponent
and mantissa shift into float32's fields, and a multiply by 2^112 rebiases the exponent
(15 -> 127), which also makes half's subnormals exact float32 normals. Inf and NaN are
not kept (weights and their scales hold none).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

REBIAS = np.float32(2.0**112)


@intrinsic
def f32_bits(typingctx, u):
    """The float32 whose bits are the low 32 bits of integer ``u``."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, context.get_value_type(types.float32))

    return types.float32(u), codegen


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def h2f(bits):
    """IEEE half-precision ``bits`` (any unsigned integer type) -> float32, exactly."""
    h = np.uint32(bits)
    return f32_bits(((h & np.uint32(0x8000)) << 16) | ((h & np.uint32(0x7FFF)) << 13)) * REBIAS
