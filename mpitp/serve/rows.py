"""The KV cache's rows as continuous batching uses them (:mod:`.engine`): running requests
hold rows 0 … k-1 on one timeline of columns; a complete prompt is placed right-aligned at
the current column, a finished row is filled by the last running one, the timeline shifts
right for a prompt longer than it and is compacted left when full."""

from __future__ import annotations

import numpy as np


def place(c, r: int, k: list, v: list) -> None:
    """A prompt's keys and values (per layer [P, kv heads, head_dim]) into row ``r``,
    right-aligned at the current column; its other columns masked."""
    P, L = len(k[0]), c.length
    for layer in range(len(c.k)):
        c.k[layer][r, L - P : L] = k[layer]
        c.v[layer][r, L - P : L] = v[layer]
    c.valid[r, :] = False
    c.valid[r, L - P : L] = True


def move(c, src: int, dst: int) -> None:
    """Row ``src``'s keys, values and mask into row ``dst``; ``src`` masked out."""
    L = c.length
    for arrs in (c.k, c.v):
        for a in arrs:
            a[dst, :L] = a[src, :L]
    c.valid[dst] = c.valid[src]
    c.valid[src, :] = False


def unused(c, k: int) -> int:
    """Leading columns of the timeline that none of the first ``k`` rows attends to."""
    used = c.valid[:k, : c.length].any(axis=0)
    return int(np.argmax(used)) if used.any() else c.length


def shift(c, by: int) -> None:
    """Move every row's columns right by ``by`` (a new prompt longer than the timeline)."""
    L = c.length
    for arrs in (c.k, c.v):
        for a in arrs:
            a[:, by : by + L] = a[:, :L].copy()
    c.valid[:, by : by + L] = c.valid[:, :L].copy()
    c.valid[:, :by] = False
    c.length = L + by


def compact(c) -> None:
    """Drop the leading columns no row uses."""
    used = c.valid[:, : c.length].any(axis=0)
    first = int(np.argmax(used)) if used.any() else c.length
    if first == 0:
        raise RuntimeError("the KV cache is full: a request longer than the context is running")
    L = c.length - first
    for arrs in (c.k, c.v):
        for a in arrs:
            a[:, :L] = a[:, first : first + L].copy()
    c.valid[:, :L] = c.valid[:, first : first + L].copy()
    c.valid[:, L:] = False
    c.length = L


class Rows:
    """The first ``k`` rows of a KV cache, as the model's forward sees a cache (views)."""

    def __init__(self, c, k: int):
        self.k = [a[:k] for a in c.k]
        self.v = [a[:k] for a in c.v]
        self.valid = c.valid[:k]
        self.length, self.max_len = c.length, c.max_len
