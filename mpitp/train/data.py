"""Token streams and global batches.

The stream is cut into windows of ``seq + 1`` tokens, window i starting at token ``i·seq``
(inputs are its first ``seq`` tokens, targets the last ``seq``). Step k takes windows
``k·B … (k+1)·B − 1`` (mod the window count; through a fixed permutation with
``--shuffle SEED``), B the *global* batch; rank r takes its ``numpy.array_split`` piece of
them, so the same command trains on the same data at any N. The last ``eval_fraction`` of
the stream is held out for the eval loss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import MpitpError
from ..split import chunk_counts, offsets

LLMC_MAGIC = 20240520  # llm.c's .bin header: 256 int32, magic, version, token count


class DataError(MpitpError, ValueError):
    """The training data cannot be read or is too short."""


def default_text() -> str:
    """The text of Python's own documentation topics (``pydoc_data``, shipped with CPython)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_ids(path: Path) -> np.ndarray | None:
    """Pre-tokenized ids: ``.npy``, or ``.bin`` of uint16 (nanoGPT raw, or llm.c with its
    header). None for anything else (text)."""
    if path.suffix == ".npy":
        ids = np.load(path, allow_pickle=False)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(f"{path}: expected a 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
        return ids.astype(np.int64)
    if path.suffix == ".bin":
        raw = path.read_bytes()
        head = np.frombuffer(raw[:1024], np.int32) if len(raw) >= 1024 else np.zeros(3, np.int32)
        if head[0] == LLMC_MAGIC:
            n = int(head[2])
            body = np.frombuffer(raw, np.uint16, offset=1024)
            if body.size < n:
                raise DataError(f"{path}: llm.c header says {n} tokens, the file holds {body.size}")
            return body[:n].astype(np.int64)
        if len(raw) % 2:
            raise DataError(f"{path}: a .bin of uint16 token ids has an even size, this one has {len(raw)} bytes")
        return np.frombuffer(raw, np.uint16).astype(np.int64)
    return None


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE with ``vocab_size`` entries learned from ``text`` (GPT-2 style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return tok


class Windows:
    def __init__(self, tokens: np.ndarray, seq: int, what: str = "training data"):
        self.tokens, self.seq = tokens, seq
        self.count = (len(tokens) - 1) // seq
        if self.count < 1:
            raise DataError(f"the {what} has {len(tokens)} tokens: too few for one window of --seq {seq} + 1")

    def batch(self, index: np.ndarray):
        """(inputs, targets) [len(index), seq] for window indices."""
        starts = np.asarray(index, np.int64) * self.seq
        rows = self.tokens[starts[:, None] + np.arange(self.seq + 1)]
        return rows[:, :-1], rows[:, 1:]


def step_windows(step: int, batch: int, count: int, perm: np.ndarray | None = None) -> np.ndarray:
    """The global batch's window indices at 0-based ``step``."""
    idx = (step * batch + np.arange(batch)) % count
    return idx if perm is None else perm[idx]


def local_rows(batch: int, n: int, rank: int) -> slice:
    """Rank's rows of a global batch, as ``numpy.array_split`` cuts it (the ring's chunks)."""
    counts = chunk_counts(batch, n)
    start = offsets(counts)[rank]
    return slice(start, start + counts[rank])


def split_eval(tokens: np.ndarray, fraction: float, seq: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(train, held-out tail): the tail gets ``fraction`` of the stream, if that holds a window."""
    n_eval = int(len(tokens) * fraction)
    if fraction <= 0 or n_eval < seq + 1:
        return tokens, None
    return tokens[:-n_eval], tokens[-n_eval:]
