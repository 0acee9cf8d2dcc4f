"""Rotary position embedding, Hugging Face's rotate-half layout.

``q * cos + rotate_half(q) * sin`` with ``rotate_half([a, b]) = [-b, a]`` over the two
halves of the head dimension (HF LLaMA q/k weights are stored for this layout).
Frequencies: ``theta^(-2i/d)``, optionally rescaled ("linear", or "llama3": long
wavelengths divided by ``factor``, short ones kept, a smooth blend between).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = scaling.get("rope_type") if scaling else None
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    return inv


class Rotary:
    def __init__(self, head_dim: int, theta: float, scaling: dict, max_positions: int, xp=np, dtype=np.float32):
        inv = inv_frequencies(head_dim, theta, scaling)
        self.xp, self.dtype = xp, dtype
        self.inv = inv
        self._cos: Any = None  # [positions, head_dim] tables, grown on demand
        self._sin: Any = None
        self._grow(max(max_positions, 1))

    def _grow(self, n: int) -> None:
        t = np.arange(n, dtype=np.float64)[:, None] * self.inv[None, :]
        emb = np.concatenate([t, t], axis=-1)
        self._cos = self.xp.asarray(np.cos(emb).astype(self.dtype))
        self._sin = self.xp.asarray(np.sin(emb).astype(self.dtype))

    def tables(self, positions):
        """cos, sin for ``positions`` [batch, seq], shaped [batch, seq, 1, head_dim] to
        broadcast over heads; looked up once per forward and shared by every layer."""
        top = int(positions.max()) if positions.size else 0
        if top >= self._cos.shape[0]:
            self._grow(top + 1)
        return self._cos[positions][:, :, None, :], self._sin[positions][:, :, None, :]

    def apply(self, x, cos, sin):
        """x: [batch, seq, heads, head_dim] rotated in the rotate-half layout."""
        half = x.shape[-1] // 2
        rot = self.xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rot * sin

    def __call__(self, x, positions):
        return self.apply(x, *self.tables(positions))
