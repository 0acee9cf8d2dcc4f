"""``--model``: what a user may name, turned into a checkpoint directory on every rank.

    DIR            a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)
    FILE.gguf      a llama.cpp GGUF file: imported once into the cache, as the default model is
    org/name       a model in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME); mpitp
                   never downloads: fetch it elsewhere with `hf download org/name`

Rank 0 resolves (and imports); every rank gets the same path, or the same error.
"""

from __future__ import annotations

from pathlib import Path

from .loader import CheckpointError


def model_dir(name: str | None, comm=None, flag: str = "--model") -> Path:
    """The one way generate, serve and train open a model: the directory ``name`` names
    (:func:`resolve`), or the embedded default model's when ``name`` is None."""
    if name is None:
        from . import default

        found = default.ensure(comm)
        if found is None:
            raise CheckpointError(f"no {flag} given and no default model: {default.INSTALL}")
        return found
    return resolve(name, comm, flag)


def tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` of model directory ``path``, or a CheckpointError."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.exists():
        raise CheckpointError(f"no tokenizer.json in {path}")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:
        raise CheckpointError(f"{f}: not a readable tokenizer ({e})") from None


def resolve(name: str, comm=None, flag: str = "--model") -> Path:
    """The model directory ``name`` names (rank 0 looks; every rank gets its answer or its
    error); a .gguf file is imported first."""
    find = lambda: _resolve(name, flag)  # noqa: E731
    found, gguf = find() if comm is None else comm.on_root(find, errors=(CheckpointError,))
    if gguf is not None:  # an import is collective: every rank waits for rank 0's
        from .default import import_gguf

        return import_gguf(gguf, Path(str(found)), comm)
    return Path(str(found))


def _resolve(name: str, flag: str) -> tuple[str, Path | None]:
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{flag} {name}: no such GGUF file")
        from .default import cache_dir

        st = path.stat()
        return str(cache_dir() / f"{path.stem}-{st.st_size}"), path
    if path.exists():
        raise CheckpointError(f"{flag} {name}: not a checkpoint directory or a .gguf file")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return _from_hub_cache(name, flag), None
    raise CheckpointError(f"{flag} {name}: no such directory")


def _from_hub_cache(repo: str, flag: str) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(
            f"{flag} {repo}: a Hugging Face name needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        return snapshot_download(repo, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise CheckpointError(
            f"{flag} {repo}: not in the local Hugging Face cache, and mpitp never downloads. On a machine "
            f"with network: `hf download {repo}` (or huggingface-cli download), then copy the cache "
            "(HF_HOME) here, or pass the checkpoint directory"
        ) from None
