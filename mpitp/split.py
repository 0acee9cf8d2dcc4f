"""Splitting n things into p parts: the one rule every layer uses.

The ring's chunks, a tensor-parallel cut, a rank's share of a batch and the plan's byte
counts all split the same way, ``numpy.array_split``'s::

    n = 10, p = 4:   counts [3, 3, 2, 2]   offsets [0, 3, 6, 8]

the first ``n % p`` parts one larger. ``even`` does it in whole blocks (vocabulary rows in
blocks of 64, the MLP on 32-weight quant blocks). A leaf: it imports nothing of mpitp.
"""

from __future__ import annotations


def chunk_counts(n: int, parts: int) -> list[int]:
    """``numpy.array_split`` sizes: the first ``n % parts`` chunks get one extra element."""
    q, rem = divmod(n, parts)
    return [q + (1 if i < rem else 0) for i in range(parts)]


def offsets(counts: list[int]) -> list[int]:
    """Where each part begins."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def even(n: int, p: int, block: int = 1) -> list[int]:
    """``n`` (a multiple of ``block``) in ``p`` parts that differ by at most one block."""
    return [c * block for c in chunk_counts(n // block, p)]
