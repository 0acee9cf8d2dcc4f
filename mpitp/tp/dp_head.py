"""The LM head under data-parallel attention (``--dp-attention``): every rank has its own
rows, the vocabulary is cut over the ranks (SGLang's layout). One step::

    rank 0  rows a0 a1      ┐                       ┌ logits [a0 a1 b0 b1 b2, V/p·0 … V/p·1)
    rank 1  rows b0 b1 b2   ┴ all-gather (x, T, u1) ┴ logits [a0 a1 b0 b1 b2, V/p·1 … V/p·2)
            each rank, each row, over its block of the vocabulary:
              greedy (T = 0)   (max, argmax)
              sampled (T > 0)  (max of z = logit/T, mass s = Σ exp(z - max), a candidate drawn
                               from its block's softmax with the owner's uniform u1)
            all-gather of those triples (24 bytes a row a rank); each owner, for its rows:
              greedy           the first rank with the largest max (argmax's tie rule)
              sampled          rank q with probability s_q·exp(max_q - M) / Σ (its uniform
                               u0), then q's candidate

Sampling is exact: a token t of block q comes out with probability
(s_q e^{max_q-M} / W) · (e^{z_t-max_q} / s_q) = e^{z_t-M} / W, the softmax at T. Rows that
need the whole distribution (top-k, top-p: T given as NaN) get their logits back instead, each
rank's block of them by all-to-all to the owner — V·4·(p-1)/p bytes, only for those rows.

Bytes a row (all ranks): (H + 5)·4 to every other rank, 24 back from each; the head's weights
a rank hold V/p rows instead of V. With a tied head (the embedding's table, whole on every
rank) nothing is cut and every rank picks its own rows alone.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_host
from .embedding import ParallelLMHead
from .partition import PAD

CHUNK = PAD  # columns summed in float64 at a time when drawing (a block's width is a multiple)
EXTRA = 5  # float32 columns after a row's x: T and u1 (float64, two columns each), the owner rank


class DataParallelHead(ParallelLMHead):
    """The vocabulary cut over ``comm`` (None: whole here), rows differing by rank. Every rank
    calls each method in the same order, a rank without rows with an empty ``h``."""

    def pick(self, h, temperature, uniforms) -> tuple[np.ndarray, np.ndarray]:
        """Next tokens of this rank's rows ``h`` [n, hidden]: ``temperature`` [n] (0 greedy, > 0
        sampled, NaN: the logits wanted instead), ``uniforms`` [n, 2] in [0, 1) of each sampled
        row's own generator. Returns (tokens [n] int64, -1 at NaN rows; logits [m, vocab] of the
        m NaN rows, in order), on the host. A temperature below 0 or infinite on any rank raises
        the same ValueError on every rank."""
        h = to_host(h).reshape(-1, self.hidden).astype(np.float32, copy=False)
        n = h.shape[0]
        T = np.ascontiguousarray(np.asarray(temperature, np.float64).reshape(n))
        u = np.asarray(uniforms, np.float64).reshape(n, 2)
        rank, p = (self.comm.rank, self.comm.size) if self.tp_size > 1 else (0, 1)
        x = np.empty((n, self.hidden + EXTRA), np.float32)
        x[:, : self.hidden] = h
        x[:, self.hidden : self.hidden + 2] = T.view(np.float32).reshape(n, 2)
        x[:, self.hidden + 2 : self.hidden + 4] = u[:, 1].copy().view(np.float32).reshape(n, 2)
        x[:, -1] = rank
        every = self.comm.allgather(x) if p > 1 else x  # [N, hidden + EXTRA], ranks in order
        owner = every[:, -1].astype(np.int64)
        counts = np.bincount(owner, minlength=p)
        lo = int(counts[:rank].sum())
        allT = np.ascontiguousarray(every[:, self.hidden : self.hidden + 2]).view(np.float64)[:, 0]
        u1 = np.ascontiguousarray(every[:, self.hidden + 2 : self.hidden + 4]).view(np.float64)[:, 0]
        bad = np.flatnonzero(~(np.isnan(allT) | ((allT >= 0) & np.isfinite(allT))))
        if len(bad):  # seen alike by every rank: the same error on all, no rank left waiting
            raise ValueError(
                f"DataParallelHead.pick: rank {owner[bad[0]]} gave a row temperature {allT[bad[0]]}; "
                "expected 0 (greedy), a finite T > 0, or NaN (the logits)"
            )
        logits = to_host(self._shard(self.xp.asarray(every[:, : self.hidden]))) if len(every) else None
        stats = self._block_stats(logits, allT, u1)  # [N, 3]
        if p > 1:
            stats = self.comm.allgather(stats, out=np.empty((p * len(stats), 3))).reshape(p, -1, 3)
        else:
            stats = stats[None]
        mine = stats[:, lo : lo + n]  # [p, n, 3]: every block's answer for this rank's rows
        tokens = np.full(n, -1, np.int64)
        greedy, sampled = T == 0, T > 0
        if greedy.any():
            first = np.argmax(mine[:, greedy, 0], axis=0)  # NaN counts as the largest, as in argmax
            tokens[greedy] = np.take_along_axis(mine[:, greedy, 1], first[None], axis=0)[0]
        if sampled.any():
            m, s = mine[:, sampled, 0], mine[:, sampled, 2]
            w = np.where(s > 0, s * np.exp(m - m.max(axis=0)), 0.0)
            c = np.cumsum(w, axis=0)
            q = np.minimum((c <= u[sampled, 0] * c[-1]).sum(axis=0), p - 1)
            tokens[sampled] = np.take_along_axis(mine[:, sampled, 1], q[None], axis=0)[0]
        return tokens, self._whole_rows(logits, np.isnan(allT), owner, np.isnan(T).sum())

    def _block_stats(self, logits, T: np.ndarray, u1: np.ndarray) -> np.ndarray:
        """(max, token, mass) of each row over this rank's block of the vocabulary (-inf, -1, 0
        for a block of padding and for rows that want their logits)."""
        st = np.zeros((len(T), 3))
        st[:, 0], st[:, 1] = -np.inf, -1
        real = self.real  # the rest is padding
        if not real or logits is None:
            return st
        block = logits[:, :real]
        g = np.flatnonzero(T == 0)
        if len(g):
            at = np.argmax(block[g], axis=-1)
            st[g, 0], st[g, 1] = block[g, at], at + self.start
        s = np.flatnonzero(T > 0)
        if len(s):
            top, at, mass = self._draw(logits[s], real, T[s], u1[s])
            st[s, 0], st[s, 1], st[s, 2] = top, at + self.start, mass
        return st

    @staticmethod
    def _draw(logits, real: int, T: np.ndarray, u: np.ndarray):
        """(max of z = logits/T, token drawn from the softmax of z by inverse CDF at ``u``, mass
        Σ e^{z - max}) of each row over its first ``real`` columns. exp in float32, sums in
        float64 by chunks of CHUNK columns, a block being whole chunks (a float32 running sum over
        76k columns would be off by up to ~0.5%; float64 throughout cost 7 ms for 8 rows of 76k
        where this takes ~1)."""
        k = logits.shape[0]
        z = np.asarray(logits, np.float32) * (1 / T).astype(np.float32)[:, None]
        top = z[:, :real].max(axis=-1)
        e = np.exp(z - top[:, None])
        e[:, real:] = 0  # padding rows of the vocabulary
        sums = np.cumsum(e.reshape(k, -1, CHUNK).sum(axis=-1, dtype=np.float64), axis=-1)  # [k, chunks]
        target = u * sums[:, -1]
        chunk = np.minimum((sums <= target[:, None]).sum(axis=-1), sums.shape[1] - 1)
        tokens = np.empty(k, np.int64)
        for i, c in enumerate(chunk):
            part = e[i, c * CHUNK : (c + 1) * CHUNK]
            left = target[i] - (sums[i, c - 1] if c else 0.0)
            j = int((np.cumsum(part, dtype=np.float64) <= left).sum())
            tokens[i] = c * CHUNK + min(j, int(np.flatnonzero(part)[-1]))  # rounding never picks a zero
        return top.astype(np.float64), tokens, sums[:, -1]

    def _whole_rows(self, logits, wanted: np.ndarray, owner: np.ndarray, m: int) -> np.ndarray:
        """The whole logits [m, vocab] of this rank's rows that want them: each rank's block of
        every wanted row sent to its owner (an all-to-all of the blocks, padded to the widest)."""
        V = self.vocab_size
        if not wanted.any():
            return np.zeros((0, V), np.float32)
        if self.tp_size == 1:
            return np.ascontiguousarray(logits[wanted, :V], np.float32)
        p, width = self.comm.size, max(self.sizes)
        send = np.zeros((int(wanted.sum()), width), np.float32)
        send[:, : self.per_rank] = logits[wanted]
        counts = np.bincount(owner[wanted], minlength=p)  # rows ordered by owner: by destination
        got, _ = self.comm.alltoallv(send, counts, sources=[m] * p)
        parts = [got[q * m : (q + 1) * m, : self.sizes[q]] for q in range(p)]
        return np.ascontiguousarray(np.concatenate(parts, axis=-1)[:, :V])

    def __call__(self, h):
        """This rank's rows' logits [..., vocab] (every rank's block of them, returned)."""
        n = int(np.prod(h.shape[:-1], dtype=np.int64))
        _, logits = self.pick(h, np.full(n, np.nan), np.zeros((n, 2)))
        return self.xp.asarray(logits.reshape(*h.shape[:-1], self.vocab_size))

    def greedy(self, h) -> np.ndarray:
        """The most likely token of each of this rank's rows [...], as ``self(h).argmax(-1)``."""
        n = int(np.prod(h.shape[:-1], dtype=np.int64))
        tokens, _ = self.pick(h, np.zeros(n), np.zeros((n, 2)))
        return tokens.reshape(h.shape[:-1])
