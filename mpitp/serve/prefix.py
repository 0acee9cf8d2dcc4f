"""Prefix cache: the keys and values of prompt blocks, kept for later requests (vLLM's
automatic prefix caching).

A block is ``BLOCK`` tokens at fixed positions. Its key hashes its tokens and its
parent's key, so one key names the whole prefix up to the block's end::

    request 1   [ system turn ....... | user turn 1 ...... | reply 1 .... ]
    request 2   [ system turn ....... | user turn 1 ...... | reply 1 .... | user turn 2 ]
    blocks      [b0      ][b1      ][b2      ][b3      ][b4      ][b5  …   (partial: not kept)
                 hits ─────────────────────────────────────────────┘  prefilled

    key(b2) = H(key(b1), tokens of b2)

Blocks live in one pool per layer, ``[blocks, BLOCK, kv heads, head_dim]``, allocated
once (untouched pages cost no memory) and evicted least recently used first. Every
tensor-parallel rank runs the same lookups and stores in the same order, so the ranks'
caches agree without a message; each holds the blocks of its own KV heads.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

BLOCK = 16


def block_keys(ids, blocks: int) -> list[bytes]:
    """The keys of the first ``blocks`` full blocks of ``ids``."""
    keys, parent = [], b""
    arr = np.asarray(ids[: blocks * BLOCK], np.int64)
    for b in range(blocks):
        parent = hashlib.blake2b(parent + arr[b * BLOCK : (b + 1) * BLOCK].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Up to ``budget`` bytes of blocks; ``queries`` and ``hits`` count prompt tokens looked
    up and found (vLLM's prefix_cache_queries / prefix_cache_hits)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, budget: int, xp=np, most_heads: int = 0):
        """``most_heads``: the most KV heads any rank holds. The number of blocks follows from
        it, so that every rank keeps (and evicts) the same blocks even where the heads do not
        divide evenly; a rank with fewer heads uses less than ``budget``."""
        per_block = 2 * layers * BLOCK * max(kv_heads, most_heads) * head_dim * np.dtype(dtype).itemsize
        self.capacity = max(0, int(budget) // per_block)
        shape = (self.capacity, BLOCK, kv_heads, head_dim)
        self.k = [xp.zeros(shape, dtype) for _ in range(layers)] if self.capacity else []
        self.v = [xp.zeros(shape, dtype) for _ in range(layers)] if self.capacity else []
        self.table: OrderedDict[bytes, int] = OrderedDict()  # key -> pool slot, least recent first
        self.spare = list(range(self.capacity - 1, -1, -1))
        self.queries = self.hits = 0
        self.block_bytes = per_block

    def __len__(self) -> int:
        return len(self.table)

    def match(self, ids, limit: int) -> list[int]:
        """Pool slots of the longest run of cached blocks that starts ``ids`` and lies within
        its first ``limit`` tokens (marked as just used)."""
        self.queries += len(ids)
        slots: list[int] = []
        if not self.capacity:
            return slots
        for key in block_keys(ids, limit // BLOCK):
            slot = self.table.get(key)
            if slot is None:
                break
            self.table.move_to_end(key)
            slots.append(slot)
        self.hits += len(slots) * BLOCK
        return slots

    def read(self, slots: list[int], layer: int):
        """Keys and values [len(slots) * BLOCK, kv heads, head_dim] of ``slots`` at ``layer``."""
        k, v = self.k[layer][slots], self.v[layer][slots]
        return k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])

    def store(self, ids, kv) -> int:
        """Keep the full blocks of ``ids`` not yet kept; ``kv(layer, lo, hi)`` gives the keys
        and values of positions lo … hi-1 at ``layer``. Returns how many were added."""
        if not self.capacity:
            return 0
        keys = block_keys(ids, len(ids) // BLOCK)
        first = next((b for b, key in enumerate(keys) if key not in self.table), len(keys))
        for key in keys[:first]:  # the parents stay younger than what gets evicted
            self.table.move_to_end(key)
        new = keys[first:][: max(0, self.capacity - first)]
        if not new:
            return 0
        slots = []
        for key in new:
            if self.spare:
                slot = self.spare.pop()
            else:
                _, slot = self.table.popitem(last=False)
            self.table[key] = slot
            slots.append(slot)
        lo, hi = first * BLOCK, (first + len(new)) * BLOCK
        for layer in range(len(self.k)):
            k, v = kv(layer, lo, hi)
            self.k[layer][slots] = k.reshape(len(new), BLOCK, *k.shape[1:])
            self.v[layer][slots] = v.reshape(len(new), BLOCK, *v.shape[1:])
        return len(new)
