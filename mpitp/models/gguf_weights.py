"""The tensors of a GGUF file as weight sources, under their Hugging Face names.

An imported GGUF model directory (:mod:`mpitp.models.gguf_import`) holds config.json,
the tokenizer and ``model.gguf``, a link to the file itself: the weights are read from
it in place (memory-mapped), never copied as float32. llama.cpp's converter reorders the
rows of q and k per head (rotate-half -> interleaved); the sources undo that by row
index, so a rank still reads only its own rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..tp.source import GGUFSource
from .gguf_import import GGUFError, hf_name, stacked, unpermute
from .gguf_tensors import read_tensors

FILE = "model.gguf"


def is_gguf_dir(path: Path) -> bool:
    return (Path(path) / FILE).exists()


def _perm(rows: int, heads: int) -> np.ndarray:
    return unpermute(np.arange(rows)[:, None], heads)[:, 0]


def sources(
    path: Path, heads: int, kv_heads: int, dtype=np.float32, permuted: bool = True
) -> Iterator[tuple[str, GGUFSource]]:
    """(Hugging Face name, source) of every tensor of the file; ``permuted``: the file's q/k
    rows are in llama.cpp's per-head order (LLaMA; Qwen's converters keep Hugging Face's).
    A stacked experts tensor [n_expert, rows, cols] becomes one source per expert, each a
    view of its own rows of the mapped file (a rank reads only the experts it holds)."""
    f = Path(path) / FILE
    try:
        tensors = read_tensors(f)
    except Exception as e:
        raise GGUFError(f"{f}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    for t in tensors:
        shape = tuple(reversed(t.shape))
        if stacked(t.name):
            for expert in range(shape[0]):
                name = hf_name(t.name, expert)
                yield name, GGUFSource(name, t.data[expert], t.type_name, shape[1:], None, dtype)
            continue
        perm = None
        if permuted and t.name.endswith("attn_q.weight"):
            perm = _perm(shape[0], heads)
        elif permuted and t.name.endswith("attn_k.weight"):
            perm = _perm(shape[0], kv_heads)
        yield hf_name(t.name), GGUFSource(hf_name(t.name), t.data, t.type_name, shape, perm, dtype)
