"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to whole blocks of ``PAD`` rows (at least one per rank) and cut
into ``p`` runs of blocks that differ by at most one block::

    vocab 250, p = 4, PAD = 64  ->  padded 256, rank r holds ids [64r, 64r+64)
    rank 3 rows 250..255 are padding: zero, never looked up, trimmed from the logits
    vocab 1001, p = 3           ->  padded 1024 (16 blocks): 6 + 5 + 5 blocks

Embedding: each rank looks up the ids in its block (others give zero rows), then one
all-reduce sums the blocks. LM head: each rank computes the logits of its block, an
all-gather puts them side by side, and the padding is trimmed.
"""

from __future__ import annotations

import numpy as np

from ..backend import to_host
from ..kernels.weights import formats
from . import partition
from .linear import ShardingError, gather_last_dim
from .partition import PAD  # noqa: F401  (re-exported)
from .source import TensorSource


class VocabParallelEmbedding:
    """``weights`` as :class:`~mpitp.tp.linear.LinearBase`'s: with block weights the rank's
    rows stay quantized (``qweight``, padding rows zero blocks); a lookup decodes only the
    rows asked for, and the head runs the matmul kernel over them."""

    weights = "float32"

    def __init__(self, vocab_size: int, hidden: int, *, comm=None, dtype=np.float32, xp=np):
        self.comm, self.xp, self.dtype = comm, xp, np.dtype(dtype)
        p = comm.size if comm is not None else 1
        self.tp_size, self.tp_rank = p, (comm.rank if comm is not None else 0)
        self.vocab_size, self.hidden = vocab_size, hidden
        self.padded, self.sizes = partition.vocab(vocab_size, p)
        self.per_rank = self.sizes[self.tp_rank]
        self.start = partition.starts(self.sizes)[self.tp_rank]
        self.end = self.start + self.per_rank
        self._wt = xp.zeros((hidden, self.per_rank), self.dtype)  # [hidden, rows]: the head's GEMV
        self.weight = self._wt.T  # [rows, hidden] view
        self.qweight: formats.BlockWeight | None = None
        self.real = max(0, min(self.end, vocab_size) - self.start)  # rows of real tokens; the rest padding

    def _blocks(self, src: TensorSource, real_end: int) -> formats.BlockWeight | None:
        if self.weights == "float32" or self.xp is not np or self.hidden % formats.BLOCK:
            return None
        if self.weights == "auto":
            if not getattr(src, "quantized", False):
                return None
            bw = src.block_rows(self.start, real_end)  # type: ignore[attr-defined]
        else:
            bw = formats.quantize_q8_0(src.rows(self.start, real_end))
        pad = self.per_rank - (real_end - self.start)
        return (
            bw if pad == 0 else formats.concat_rows([bw, formats.empty(bw.kind, pad, self.hidden, bw.source, like=bw)])
        )

    def finish(self) -> None:
        if self.qweight is not None:
            self.qweight = self.qweight.contiguous()
            self._wt = self.weight = None  # never written: no memory held

    def weight_loader(self, param: str, src: TensorSource, shard_id=None) -> None:
        if tuple(src.shape) != (self.vocab_size, self.hidden):
            raise ShardingError(
                f"{src.name}: checkpoint shape {tuple(src.shape)}, model expects {(self.vocab_size, self.hidden)}"
            )
        real_end = min(self.end, self.vocab_size)
        if real_end > self.start and (bw := self._blocks(src, real_end)) is not None:
            self.qweight = bw
            return
        self.weight[...] = 0  # padding rows stay zero
        if real_end > self.start:
            self.weight[: real_end - self.start] = self.xp.asarray(src.rows(self.start, real_end), self.dtype)

    def __call__(self, ids):
        xp = self.xp
        ids = xp.asarray(ids)
        mine = (ids >= self.start) & (ids < self.end)
        if self.qweight is not None:
            from ..kernels.weights.dequant import take

            local = np.where(mine, ids - self.start, -1).astype(np.int64)
            out = take(self.qweight, local.reshape(-1)).reshape(*ids.shape, self.hidden)
        else:
            local = xp.where(mine, ids - self.start, 0)
            out = self.weight[local] * mine[..., None].astype(self.dtype)
        if self.tp_size > 1:
            self.comm.allreduce(out, out=out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary on every rank. ``tie(embedding)`` shares the
    embedding's shard (same array), as tied checkpoints expect."""

    def __init__(self, vocab_size: int, hidden: int, *, comm=None, dtype=np.float32, xp=np):
        super().__init__(vocab_size, hidden, comm=comm, dtype=dtype, xp=xp)
        self.tied = False

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self._wt, self.weight = embedding._wt, embedding.weight
        self.tied, self._tied_to = True, embedding

    def finish(self) -> None:
        if self.tied:
            self.qweight, self._wt, self.weight = self._tied_to.qweight, self._tied_to._wt, self._tied_to.weight
        else:
            super().finish()

    def _shard(self, h):
        """This rank's logits [..., per_rank] (its block of the vocabulary, padding included)."""
        if self.qweight is not None:
            from ..kernels.matmul import matmul

            return matmul(h, self.qweight)
        return h @ self._wt

    def __call__(self, h):
        logits = self._shard(h)
        if self.tp_size > 1:
            logits = gather_last_dim(self.comm, logits, self.sizes)
        return logits[..., : self.vocab_size]

    def greedy(self, h) -> np.ndarray:
        """The most likely token of each row of ``h`` [..., hidden] (int64 [...], on the
        host), as ``self(h).argmax(-1)`` picks it, without gathering the logits: each rank
        takes the argmax of its own block of the vocabulary, and one all-gather of the
        (value, token) pairs, 16 bytes a row a rank, picks the largest; ranks hold the
        vocabulary in order, so the first rank with it has the lowest token of a tie (and
        of NaNs), as argmax::

            rank 0  logits[:, 0 : V/p]    -> (max, token) ┐
            rank 1  logits[:, V/p : 2V/p] -> (max, token) ┼ all-gather -> the first rank's max
            ...                                            ┘

        Across nodes this replaces V·4 bytes a row (151936 tokens: 608 kB) by 16 a rank."""
        logits = self._shard(h)
        real = self.real
        pairs = np.zeros((1, *logits.shape[:-1], 2))
        pairs[..., 0] = -np.inf
        if real:
            mine = logits[..., :real]
            at = self.xp.argmax(mine, axis=-1)
            best = self.xp.take_along_axis(mine, at[..., None], axis=-1)[..., 0]
            pairs[0, ..., 0] = to_host(best)
            pairs[0, ..., 1] = to_host(at) + self.start
        if self.tp_size > 1:
            pairs = self.comm.allgather(pairs)  # [p, ..., 2]
        first = np.argmax(pairs[..., 0], axis=0)  # NaN counts as the largest, as in argmax
        return np.take_along_axis(pairs[..., 1], first[None], axis=0)[0].astype(np.int64)
