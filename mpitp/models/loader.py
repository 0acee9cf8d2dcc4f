"""Hugging Face checkpoint → tensor-parallel model. Each rank reads only its slices.

Accepts a directory with ``config.json`` and ``model.safetensors``, or sharded
``*.safetensors`` with ``model.safetensors.index.json``. Every tensor name maps to a
layer's ``weight_loader`` through the model's ``named_weights`` (q/k/v into the merged
qkv_proj, gate/up into gate_up_proj, by its ``packed_modules_mapping``);
bf16 and fp16 tensors are upcast. Problems are reported at load time, naming the tensor
or config field and the numbers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MpitpError
from ..progress import Progress
from ..tp import SafetensorsSource
from .config import ConfigError, LlamaConfig
from .kv_cache import kv_cache_choice

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
IGNORED = ("rotary_emb.inv_freq",)


class CheckpointError(MpitpError, ValueError):
    """A checkpoint (Hugging Face, GGUF or mpitp training) is missing, incomplete or corrupt,
    or does not match the model it claims to be."""


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names files that are not there: {', '.join(missing)}")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no *.safetensors in {path} (mpitp loads safetensors checkpoints)")
    return found


def open_safetensors(f: Path):
    """``safe_open`` with a message naming the file when it is not a safetensors file
    (truncated, corrupt header, something else renamed)."""
    from safetensors import safe_open

    if f.stat().st_size < 8:
        raise CheckpointError(f"{f}: {f.stat().st_size} bytes, too short for a safetensors file (truncated?)")
    try:
        return safe_open(str(f), framework="numpy")
    except Exception as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None


def weight_map(model) -> dict[str, tuple]:
    """Checkpoint name -> (module, param, shard id), from the model's own
    :meth:`~mpitp.models.llama.LlamaForCausalLM.named_weights`."""
    return {name: (mod, param, shard) for name, mod, param, shard in model.named_weights()}


def locate(wmap: dict, model, name: str):
    """(module, param, shard_id) for a checkpoint tensor name, or None to skip it (a tied
    ``lm_head.weight``, rotary tables, names of other architectures)."""
    target = wmap.get(name)
    if target is not None or name.endswith(IGNORED):
        return target
    m = _LAYER.match(name)
    layers = model.config.num_hidden_layers
    if m and int(m.group(1)) >= layers:
        raise CheckpointError(f"{name}: layer {m.group(1)}, but config has num_hidden_layers = {layers}")
    if getattr(model, "stage", None) is not None:  # a pipeline stage: other stages' tensors are theirs
        held = m is not None and model.first_layer <= int(m.group(1)) < model.first_layer + len(model.layers)
        if not held:
            return None
    if name.endswith(".bias") and name[: -len("bias")] + "weight" in wmap:
        raise CheckpointError(f"{name}: the checkpoint has a bias the config does not declare")
    return None


def _sources(model, path: Path):
    """(file, tensor name, source) of every tensor of the checkpoint: safetensors files,
    or the GGUF file of an imported llama.cpp model."""
    from .gguf_weights import is_gguf_dir, sources

    if is_gguf_dir(path):
        c = model.config
        permuted = c.architecture == "LlamaForCausalLM"  # Qwen's converters keep Hugging Face's q/k rows
        for name, src in sources(path, c.num_attention_heads, c.num_key_value_heads, permuted=permuted):
            yield path / "model.gguf", name, src
        return
    for f in checkpoint_files(path):
        with open_safetensors(f) as h:
            for name in h.keys():
                yield f, name, SafetensorsSource(h, name, dtype=np.float32)


def _give_back_memory(start: bool) -> None:
    """glibc only: before the model is built, keep its large arrays out of the heap (a fixed
    mmap threshold: glibc's grows with every big free). The model is built with zero-filled
    arrays that its block weights replace unwritten: in their own mappings they are untouched
    pages; in the heap, freed, the next load's calloc cleared the reused chunks page by page (a
    --dp-attention load after a --moe tp one in one process peaked at 11.6 GB of anonymous
    memory a rank, 4.0 alone), and the load's transient planar blocks (~1.6x the weights of a
    K-quant file) stayed in the process. After the load, trim the heap and raise the
    threshold to glibc's dynamic maximum: a forward's temporaries (a 512-token prefill's, MBs
    each) then come from the heap and are reused, not mapped, faulted in and unmapped at every
    call (Qwen3-0.6B's prefill of 512 on AVX2: 3.1 s that way, 2.5 s reused; the heap keeps
    ~0.2 GB a rank after a 512-token prefill of the MoE file). A 12-layer Qwen3-30B-A3B Q4_K_M
    at 2 ranks: 2.6 GB of anonymous memory a rank after loading (its weights), 3.7 at the peak."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        if start:
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        else:
            libc.malloc_trim(0)
            libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (glibc's dynamic maximum)
            libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def load_weights(model, path: Path) -> dict:
    wmap = weight_map(model)
    experts = model.expert_shapes() if hasattr(model, "expert_shapes") else {}  # every rank checks all
    seen: set[str] = set()
    bytes_read = 0
    c = getattr(model, "expert_comm", model.comm)
    loud = c is None or c.rank == 0  # rank 0's progress: a bar on a terminal, else lines
    bar = Progress(len(wmap), f"loading {path.name}", "tensor", enabled=loud, leave=False, seconds=10.0, after=10.0)
    # tensors each module still awaits: a module whose last one arrives is made ready at once
    # (its block pieces joined and tiled), so the load holds one layer's planar blocks, not
    # the model's (K-quant blocks arrive ~1.6x the size of their tiles)
    awaits: dict[int, int] = {}
    for obj, _, _ in wmap.values():
        awaits[id(obj)] = awaits.get(id(obj), 0) + 1
    ready = getattr(model, "module_loaded", None)
    for f, name, src in _sources(model, path):
        if name in experts:
            if tuple(src.shape) != experts[name]:
                raise CheckpointError(f"{f}: {name} has shape {tuple(src.shape)}, the config asks {experts[name]}")
            seen.add(name)
        target = locate(wmap, model, name)
        if target is None:
            continue
        obj, param, shard = target
        try:
            obj.weight_loader(param, src, shard)
        except MpitpError:
            raise
        except Exception as e:  # a header that lies about the data, a short file
            raise CheckpointError(f"{f}: tensor {name} cannot be read ({e})") from None
        bytes_read += src.bytes_read
        bar.update(name in wmap)
        if name in wmap and name not in seen:
            awaits[id(obj)] -= 1
            if awaits[id(obj)] == 0 and ready is not None:
                ready(obj)
        seen.add(name)
    bar.close()
    missing = sorted((set(wmap) | set(experts)) - seen)
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = " (the config does not tie word embeddings, so the checkpoint must carry lm_head.weight)"
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensors {shown}{hint}")
    model.finish_load()
    _give_back_memory(False)
    return {"tensors": len(seen), "bytes_read": bytes_read}


WEIGHTS = ("auto", "float32", "q8_0")


def _holds_16_bit(path: Path) -> bool:
    """Whether a safetensors checkpoint stores any tensor as F16 or BF16 (headers only)."""
    for f in checkpoint_files(path):
        h = open_safetensors(f)
        if any(str(h.get_slice(name).get_dtype()) in ("F16", "BF16") for name in h.keys()):
            return True
    return False


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _mlp_block(path: Path, weights: str) -> int:
    """Columns the MLP (and each expert) is cut in multiples of: 256 where the file's down_proj is a K-quant
    (whole super-blocks on every rank, held with their integer scales: kernels.tiles),
    else 32."""
    from .gguf_weights import FILE, is_gguf_dir

    if weights != "auto" or not is_gguf_dir(path):
        return 32
    from .gguf_tensors import read_tensors

    try:
        downs = ("ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")  # dense, experts, shared
        types = {t.type_name for t in read_tensors(path / FILE) if t.name.endswith(downs)}
    except Exception:
        return 32  # the loader reports an unreadable file
    return 256 if types & set(K_QUANTS) else 32


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded, as every command passes it (``mpitp generate``, ``serve`` and
    ``bench decode`` build one from their shared flags: :mod:`mpitp.cli.options`).

    ``pp``: pipeline stages (:mod:`.pipeline`), each a tensor-parallel group of
    ``comm.size / pp`` ranks holding its run of layers (``stage_inside_node``: each inside
    one node, or an error). ``weights``: ``auto`` keeps the tensors as the files store them
    (GGUF block formats, F16 and BF16 of GGUF or safetensors; float32 stays float32),
    ``float32`` widens everything, ``q8_0`` quantizes the matmul weights at load. On a GPU,
    weights are always ``dtype`` (quantized files dequantize). ``activations`` (int8, int8o,
    int8x2, float32, auto: :func:`mpitp.kernels.cpu.activations`) says how block weights
    multiply: int8 activations with the weights repacked in tiles (:mod:`mpitp.kernels.int8`),
    or float32 activations, the exact reference. ``kv_cache_dtype``:
    :func:`mpitp.models.kv_cache.kv_cache_dtype`. ``moe``: a mixture of experts' cut, ep, tp
    or auto (:mod:`.moe`); ``dp_attention``: each rank its own sequences, the experts reached
    by all-to-all (:class:`.llama.LlamaForCausalLM`)."""

    dtype: str = "float32"
    device: str = "cpu"
    weights: str = "auto"
    activations: str | None = None
    pp: int = 1
    stage_inside_node: bool = False
    kv_cache_dtype: str | None = None
    moe: str = "auto"
    dp_attention: bool = False


def load_pretrained(cls, path, comm=None, options: LoadOptions | None = None):
    """A ``cls`` model from the checkpoint at ``path``, loaded as ``options`` says."""
    o = options or LoadOptions()
    dtype, device, weights, activations = o.dtype, o.device, o.weights, o.activations
    pp, stage_inside_node, kv_cache_dtype = o.pp, o.stage_inside_node, o.kv_cache_dtype
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (config.json + *.safetensors)")
    if weights not in WEIGHTS:
        raise ConfigError(f"weights {weights!r}: one of {', '.join(WEIGHTS)}")
    cfg = LlamaConfig.from_path(path)
    xp: Any = np
    if device == "cuda":
        try:
            import cupy

            xp = cupy
        except ImportError:
            raise ConfigError("device='cuda' needs CuPy: pip install 'mpitp[cuda12]'") from None
    elif device != "cpu":
        raise ConfigError(f"unknown device {device!r} (cpu or cuda)")

    from .gguf_weights import is_gguf_dir

    if device == "cuda" or np.dtype(dtype) != np.float32:
        weights = "float32"  # the array path: on a GPU, or float16 weights asked for
    elif weights == "auto" and not is_gguf_dir(path) and not _holds_16_bit(path):
        weights = "float32"  # a float32 checkpoint: nothing to keep, and the MLP's cut needs no blocks
    stage = None
    if pp != 1:
        from .pipeline import PipelineError, build

        if comm is None:
            raise PipelineError("pipeline stages need a communicator (run under mpiexec)")
        stage = build(comm, pp, cfg, stage_inside_node)
        comm = stage.tp
    block = _mlp_block(path, weights)
    _give_back_memory(True)  # before the model's arrays exist
    model = cls(
        cfg,
        comm=comm,
        dtype=dtype,
        xp=xp,
        weights=weights,
        mlp_block=block,
        stage=stage,
        moe=o.moe,
        dp_attention=o.dp_attention,
    )
    if weights != "float32":
        from ..kernels.cpu import activations as resolve

        try:
            model.activations = resolve(activations)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    # checked before the weights load; the model's finish_load settles auto, knowing its weights
    model.kv_choice = kv_cache_choice(kv_cache_dtype)
    model.load_info = load_weights(model, path)
    return model
