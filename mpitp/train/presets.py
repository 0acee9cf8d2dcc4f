"""The model sizes ``mpitp train --config`` knows by name (tiny, small), or a config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.config import LlamaConfig

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
