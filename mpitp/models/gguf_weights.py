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
from .gguf_import import GGUFError, hf_name, unpermute
from .gguf_tensors import read_tensors

FILE = "model.gguf"


def is_gguf_dir(path: Path) -> bool:
    return (Path(path) / FILE).exists()


def _perm(rows: int, heads: int) -> np.ndarray:
    return unpermute(np.arange(rows)[:, None], heads)[:, 0]


def sources(path: Path, heads: int, kv_heads: int, dtype=np.float32) -> Iterator[tuple[str, GGUFSource]]:
    f = Path(path) / FILE
    try:
        tensors = read_tensors(f)
    except Exception as e:
        raise GGUFError(f"{f}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    for t in tensors:
        shape = tuple(reversed(t.shape))
        perm = None
        if t.name.endswith("attn_q.weight"):
            perm = _perm(shape[0], heads)
        elif t.name.endswith("attn_k.weight"):
            perm = _perm(shape[0], kv_heads)
        yield hf_name(t.name), GGUFSource(hf_name(t.name), t.data, t.type_name, shape, perm, dtype)
