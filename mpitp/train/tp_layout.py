"""Units cut for tensor parallelism: rank t of a tp group of T holds its slice of every
tensor of a unit, back to back in the unit's own order — a smaller unit, which the dp
dimension then shards as before (FSDP / ZeRO over the slices)::

    tensor                     cut over tp         rank t holds
    q, k, v  (+ their biases)  rows, by KV group   the heads of KV heads chunk(kv)[t]
    o                          columns             the same heads' input columns
    gate, up (+ their biases)  rows                chunk(I)[t]
    down                       columns             chunk(I)[t]
    embed, lm_head             rows (vocabulary)   chunk(V)[t]
    norms, o / down biases     replicated          all of it

    layer unit, T = 2, one rank's slice of it:
    whole     | ln1 | q0 q1 | k0 k1 | v0 v1 | o[:, 0] o[:, 1] | ln2 | g0 g1 | u0 u1 | down[:, 0] down[:, 1] |
    rank 0    | ln1 | q0    | k0    | v0    | o[:, 0]         | ln2 | g0    | u0    | down[:, 0]            |

chunk(n)[t] is ``numpy.array_split``'s cut. Each local element comes from one place of the
whole unit's flat buffer (:meth:`TPCut.index`), which is how checkpoints stay in the
whole model's layout and load on any mesh. Replicated tensors get the same gradient on
every tp rank (their inputs' gradients are all-reduced first), so they stay equal without
communication; the gradient norm counts them once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import MpitpError
from ..models.config import LlamaConfig
from ..split import chunk_counts, offsets
from ..tp.partition import attention
from .layout import UnitLayout

ROWS_Q = ("q", "bq")
ROWS_KV = ("k", "v", "bk", "bv")
ROWS_I = ("gate", "up", "bgate", "bup")
ROWS_V = ("embed", "head")


class TPError(MpitpError, ValueError):
    """A model that cannot be trained at this tensor-parallel size."""


def _span(n: int, p: int, t: int) -> tuple[int, int]:
    c = chunk_counts(n, p)
    s = offsets(c)[t]
    return s, s + c[t]


class TPCut:
    """Rank ``t``'s slice of every unit of ``cfg`` at tensor-parallel size ``T``."""

    def __init__(self, cfg: LlamaConfig, T: int, t: int, units: list[UnitLayout]):
        if T < 1 or not 0 <= t < T:
            raise TPError(f"tensor-parallel rank {t} of {T}")
        nkv = cfg.num_key_value_heads
        if T > nkv:
            raise TPError(
                f"--tp {T} exceeds the model's {nkv} KV heads: training cuts attention by whole KV heads "
                f"(no KV replication); use --tp <= {nkv}"
            )
        if T > 1 and cfg.vocab_size < T:
            raise TPError(f"--tp {T} exceeds the vocabulary ({cfg.vocab_size} rows)")
        self.cfg, self.T, self.t, self.whole = cfg, T, t, units
        att = attention(cfg.num_attention_heads, nkv, T)
        q, q0, kv, kv0 = att.rank(t)
        d = cfg.head_dim
        self.heads, self.kv_heads = q, kv
        self.i0, self.i1 = _span(cfg.intermediate_size, T, t)
        self.v0, self.v1 = _span(cfg.vocab_size, T, t)
        self._rows = {
            **dict.fromkeys(ROWS_Q, (q0 * d, (q0 + q) * d)),
            **dict.fromkeys(ROWS_KV, (kv0 * d, (kv0 + kv) * d)),
            **dict.fromkeys(ROWS_I, (self.i0, self.i1)),
            **dict.fromkeys(ROWS_V, (self.v0, self.v1)),
        }
        self._cols = {"o": (q0 * d, (q0 + q) * d), "down": (self.i0, self.i1)}
        self.units = [self._local(u) for u in units]

    @property
    def local_config(self) -> LlamaConfig:
        """The config a rank's slice of a layer computes with: its heads, its columns."""
        return dataclasses.replace(
            self.cfg,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.i1 - self.i0,
        )

    def _cut(self, key: str) -> tuple[str, int, int] | None:
        if self.T == 1:
            return None
        if key in self._rows:
            return ("rows",) + self._rows[key]
        if key in self._cols:
            return ("cols",) + self._cols[key]
        return None

    def _local(self, u: UnitLayout) -> UnitLayout:
        specs = []
        for ten in u.tensors:
            cut = self._cut(ten.key)
            shape = ten.shape
            if cut is not None:
                a, b = cut[1], cut[2]
                shape = (b - a,) + shape[1:] if cut[0] == "rows" else (shape[0], b - a)
            specs.append((ten.key, ten.name, shape))
        return UnitLayout(u.name, specs, u.fused)

    def replicated(self, i: int) -> list[tuple[int, int]]:
        """[start, end) runs of unit i's local buffer held whole by every tp rank."""
        if self.T == 1:
            return []
        return [(x.offset, x.offset + x.size) for x in self.units[i].tensors if self._cut(x.key) is None]

    def index(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Positions in the whole unit's flat buffer of unit i's local elements [lo, hi)."""
        local, whole = self.units[i], self.whole[i]
        parts = []
        for lt, wt in zip(local.tensors, whole.tensors):
            s, e = max(lt.offset, lo), min(lt.offset + lt.size, hi)
            if s >= e:
                continue
            cut = self._cut(wt.key)
            if cut is None:
                idx = np.arange(s - lt.offset, e - lt.offset)
            else:
                kind, a, b = cut
                row = wt.size // wt.shape[0]
                pos = np.arange(s - lt.offset, e - lt.offset)
                if kind == "rows":
                    idx = a * row + pos
                else:  # columns [a, b) of a [R, C] matrix
                    r, c = np.divmod(pos, b - a)
                    idx = r * wt.shape[1] + a + c
            parts.append(wt.offset + idx)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def runs(index: np.ndarray) -> list[list[int]]:
    """``index`` as [start, end) runs of consecutive positions, in order."""
    if index.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [index.size]])
    return [[int(index[a]), int(index[b - 1]) + 1] for a, b in zip(starts, ends)]


def gather_whole(read, index: np.ndarray) -> np.ndarray:
    """Values at ``index`` (not empty) of a whole unit, given ``read(lo, hi)`` of its flat
    buffer: one read of the span they lie in."""
    lo, hi = int(index.min()), int(index.max()) + 1
    return read(lo, hi)[index - lo]
