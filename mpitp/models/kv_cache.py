"""The KV cache of a decode: its arrays, and the type it holds (``--kv-cache-dtype``)."""

from __future__ import annotations

import numpy as np

KV_CACHE_DTYPES = ("auto", "float32", "float16")


def kv_cache_choice(choice: str | None) -> str:
    """``choice``, else ``MPITP_KV_CACHE_DTYPE``, else ``auto``: checked, lower case."""
    from .. import settings
    from .config import ConfigError

    c = (choice or settings.current().kv_cache_dtype or "auto").lower()
    if c not in KV_CACHE_DTYPES:
        raise ConfigError(f"KV cache dtype {c!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    return c


def kv_cache_dtype(choice: str | None, model) -> np.dtype:
    """The KV cache's type: ``choice``, else ``MPITP_KV_CACHE_DTYPE``, else ``auto``. auto is
    float16 where the model multiplies on int8 tiles on the CPU and decode attention's IR
    core reads float16 (a head dimension that is a multiple of 16): as llama.cpp keeps its
    cache by default, half the bytes a decode step's attention reads, rounded to nearest,
    ~5e-4 relative, far inside int8 activations' own rounding. Else the model's dtype:
    float32 activations stay the exact reference."""
    c = kv_cache_choice(choice)
    if c != "auto":
        return np.dtype(c)
    if model.xp is np and model.layers and model.int8_tiles():
        a = model.layers[0].self_attn  # decode attention's IR core reads float16 (not on the baseline x86-64)
        if _decode_core(a.head_dim, a.nh // a.nkv, np.float16) is not None:
            return np.dtype(np.float16)
    return np.dtype(model.dtype)


def _decode_core(D: int, G: int, dtype):
    from ..kernels import decode

    return decode.core(D, G, dtype)


class KVCache:
    """Preallocated keys and values: [batch, max_len, local kv heads, head_dim] per layer.
    Sequences are left-padded so that all share one timeline; ``valid`` masks the pads."""

    def __init__(self, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype, xp=np):
        shape = (batch, max_len, kv_heads, head_dim)
        self.k = [xp.zeros(shape, dtype) for _ in range(layers)]
        self.v = [xp.zeros(shape, dtype) for _ in range(layers)]
        self.valid = xp.zeros((batch, max_len), bool)
        self.length = 0
        self.max_len = max_len
        self.owner = None  # a packed prefill: which prompt each column belongs to (see Step)
