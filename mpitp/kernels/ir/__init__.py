"""The kernels written as LLVM IR (numba cannot emit integer dot-product or tile
instructions), built as text and compiled by :mod:`mpitp.kernels.jit`::

    build      the toolkit every generator writes with (SSA names, splats, loads, chains)
    blocks     the tiles' weight blocks decoded (scales, K-quant scales and minimums, Q6_K)
    frame      the function every int8 kernel's body sits in (tile and block loops)
    vector     int8 kernels on vector registers: avx512, vnni, avx2, portable
    amx        int8 kernels on AMX's tiles
    quantize   int8o's and int8x2's activation quantizers
    attend     decode attention's core
"""
