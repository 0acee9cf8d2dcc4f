"""Where a run's parameters come from, behind one interface::

    source.read(unit, kind, lo, hi, dtype)   elements [lo, hi) of the whole model's unit
                                             ``unit`` (unpadded flat buffer), ``kind`` one of
                                             param, exp_avg, exp_avg_sq

    Fresh(layouts, seed)       transformers' LLaMA initialisation, the same at any N
    Pretrained(path, layouts)  a model directory (fine-tuning): safetensors, or the GGUF
                               file of an imported model (the default model), dequantized
    Resumed(reader)            a training checkpoint written at any N (parameters and
                               AdamW moments)

Each rank reads only the ranges it owns (safetensors ``get_slice``, GGUF rows). Only a
checkpoint has moments (``has_moments``). :func:`open_model` turns the options into a
:class:`Model`: the config, the tokenizer and which source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MpitpError
from ..models.config import LlamaConfig
from ..models.loader import CheckpointError, checkpoint_files, open_safetensors
from ..models.resolve import model_dir
from ..tp import SafetensorsSource
from . import checkpoint
from .layout import UnitLayout, init_unit
from .presets import preset_config


class Fresh:
    """A fresh initialisation: unit i from seed ``seed * 1000 + i``."""

    has_moments = False

    def __init__(self, layouts: list[UnitLayout], seed: int):
        self.layouts, self.seed = layouts, seed

    def read(self, unit: int, kind: str, lo: int, hi: int, dtype) -> np.ndarray:
        return init_unit(self.layouts[unit], self.seed * 1000 + unit)[lo:hi].astype(dtype)


class Pretrained:
    """Ranges of units read from a model directory's weights (safetensors or GGUF)."""

    has_moments = False

    def __init__(self, path: Path, layouts: list[UnitLayout], cfg: LlamaConfig):
        from ..models.gguf_weights import is_gguf_dir, sources

        self.path, self.layouts = Path(path), layouts
        self.where: dict = {}  # name -> dtype -> TensorSource
        if is_gguf_dir(self.path):  # dequantized to float32 (exact), then cast
            for name, src in sources(self.path, cfg.num_attention_heads, cfg.num_key_value_heads):
                self.where[name] = lambda dtype, src=src: src
        else:
            for f in checkpoint_files(self.path):
                h = open_safetensors(f)
                for name in h.keys():
                    self.where[name] = lambda dtype, h=h, name=name: SafetensorsSource(h, name, dtype=dtype)

    def read(self, unit: int, kind: str, lo: int, hi: int, dtype) -> np.ndarray:
        out = np.zeros(hi - lo, dtype)
        for t in self.layouts[unit].tensors:
            s, e = max(t.offset, lo), min(t.offset + t.size, hi)
            if s >= e:
                continue
            if t.name not in self.where:
                hint = " (the config does not tie word embeddings)" if t.name == "lm_head.weight" else ""
                raise CheckpointError(f"{self.path}: missing tensor {t.name}{hint}")
            src = self.where[t.name](dtype)
            if tuple(src.shape) != t.shape:
                raise CheckpointError(f"{t.name}: checkpoint shape {tuple(src.shape)}, config expects {t.shape}")
            row = t.size // t.shape[0]
            r0, r1 = (s - t.offset) // row, -(-(e - t.offset) // row)
            block = (src.rows(r0, r1) if len(t.shape) > 1 else src.read()[r0:r1]).reshape(-1)
            a = s - t.offset - r0 * row
            out[s - lo : e - lo] = block[a : a + e - s]
        return out


class Resumed:
    """A training checkpoint's parameters and AdamW moments, at any N."""

    has_moments = True

    def __init__(self, reader: checkpoint.Reader):
        self.reader = reader

    def read(self, unit: int, kind: str, lo: int, hi: int, dtype) -> np.ndarray:
        return self.reader.read(unit, kind, lo, hi, dtype)


class SourceError(MpitpError, ValueError):
    """The options name no model to train, or one that is not there."""


@dataclass
class Model:
    """What a run starts from: the config, the tokenizer file (if any), and where the
    parameters come from (``checkpoint`` when resuming)."""

    cfg: LlamaConfig
    tokenizer: Path | None
    directory: Path | None = None  # a model directory (--init)
    checkpoint: checkpoint.Reader | None = None  # a training checkpoint (--resume)

    def source(self, layouts: list[UnitLayout], seed: int) -> Fresh | Pretrained | Resumed:
        if self.checkpoint is not None:
            return Resumed(self.checkpoint)
        if self.directory is not None:
            return Pretrained(self.directory, layouts, self.cfg)
        return Fresh(layouts, seed)


def _tokenizer(path: Path) -> Path | None:
    tok = path / "tokenizer.json"
    return tok if tok.exists() else None


def open_model(config: str | None, init: str | None, resume: str | None, comm=None) -> Model:
    """The :class:`Model` of ``--resume`` (a checkpoint), ``--init`` (a model directory,
    .gguf, org/name or 'default', opened as generate and serve open one) or ``--config``
    (a preset or a config.json). Collective where ``--init`` needs resolving."""
    if resume:
        reader = checkpoint.Reader(Path(resume))
        return Model(reader.config, _tokenizer(reader.path), checkpoint=reader)
    if init:
        path = model_dir(None if init == "default" else init, comm, flag="--init")
        return Model(LlamaConfig.from_path(path), _tokenizer(path), directory=path)
    if not config:
        raise SourceError("say what to train: --config tiny|small|config.json, --init DIR|default, or --resume DIR")
    if config not in ("tiny", "small") and not Path(config).exists():
        raise SourceError(f"--config {config}: not a preset (tiny, small) and no such file")
    return Model(preset_config(config), None)
