"""Where a run's parameters come from: fresh (transformers' LLaMA init), a Hugging Face
checkpoint (fine-tuning), or a training checkpoint (resume, at any N). Each rank fills
only the range it owns, reading just those rows (safetensors ``get_slice``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..models.config import LlamaConfig
from ..models.loader import CheckpointError, checkpoint_files, open_safetensors
from ..tp import SafetensorsSource
from .layout import UnitLayout, init_unit

PRESETS: dict[str, dict[str, Any]] = {
    # small enough for tests, with grouped-query attention
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=672,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
}


def preset_config(name: str) -> LlamaConfig:
    if name in PRESETS:
        c = PRESETS[name]
        return LlamaConfig(
            **c,
            head_dim=c["hidden_size"] // c["num_attention_heads"],
            rms_norm_eps=1e-5,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    return LlamaConfig.from_path(Path(name))


def fresh_range(layout: UnitLayout, unit: int, lo: int, hi: int, seed: int, dtype) -> np.ndarray:
    return init_unit(layout, seed * 1000 + unit)[lo:hi].astype(dtype)


class HFReader:
    """Ranges of units read from a Hugging Face safetensors checkpoint."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.handles, self.where = [], {}
        for f in checkpoint_files(self.path):
            h = open_safetensors(f)
            self.handles.append(h)
            for name in h.keys():
                self.where[name] = h
        self.bytes_read = 0

    def read(self, layout: UnitLayout, lo: int, hi: int, dtype) -> np.ndarray:
        out = np.zeros(hi - lo, dtype)
        for t in layout.tensors:
            s, e = max(t.offset, lo), min(t.offset + t.size, hi)
            if s >= e:
                continue
            if t.name not in self.where:
                hint = " (the config does not tie word embeddings)" if t.name == "lm_head.weight" else ""
                raise CheckpointError(f"{self.path}: missing tensor {t.name}{hint}")
            src = SafetensorsSource(self.where[t.name], t.name, dtype=dtype)
            if tuple(src.shape) != t.shape:
                raise CheckpointError(f"{t.name}: checkpoint shape {tuple(src.shape)}, config expects {t.shape}")
            row = t.size // t.shape[0]
            r0, r1 = (s - t.offset) // row, -(-(e - t.offset) // row)
            block = src.rows(r0, r1).reshape(-1)
            self.bytes_read += src.bytes_read
            a = s - t.offset - r0 * row
            out[s - lo : e - lo] = block[a : a + e - s]
        return out
