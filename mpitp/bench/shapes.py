"""A real model's shapes with random weights, as a GGUF file llama.cpp loads too, for
decode measured where the weights, not Python, decide a step.

    mpitp bench decode --shape llama-3.2-1b --weights q4_k_m

The file has the shape's layers (hidden size, heads, KV heads, MLP width, layers) and the
default model's tokenizer (its vocabulary sets the embedding's rows), the weights random
blocks written directly in the ggml type (no quantizer runs: any bytes are a valid block;
the scales are chosen so that weights have a spread of ~0.02 and mean ~0)::

    q4_0    every matmul weight and the (tied) embedding Q4_0
    q8_0    all Q8_0
    q4_k_m  Q4_K, with Q6_K for the embedding and for attn_v and ffn_down of every other
            layer (llama.cpp's Q4_K_M gives its "more bits" to those tensors)

Written once into ``$MPITP_CACHE/bench`` (default ``~/.cache/mpitp/bench``), atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SHAPES = {
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, rope_theta=500000.0),
}
FILE_TYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15}  # general.file_type (llama_ftype)
SPREAD = 0.02


def _f16(x: float, n: int) -> np.ndarray:
    return np.full((n, 1), x, np.float16).view(np.uint8)


def random_blocks(rng, type_name: str, rows: int, cols: int) -> np.ndarray:
    """[rows, row bytes] uint8 of random ``type_name`` blocks."""
    import gguf

    qt = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if type_name == "Q4_0":  # d, then nibbles: w = d(q - 8), q uniform 0..15 (std 4.6)
        raw[:, :2] = _f16(SPREAD / 4.6, n)
    elif type_name == "Q8_0":  # d, then int8: keep q in [-127, 127]
        raw[:, :2] = _f16(SPREAD / 73, n)
        q = raw[:, 2:].view(np.int8)
        q[q == -128] = -127
    elif type_name == "Q5_0":  # d, 32 fifth bits, nibbles: w = d(q - 16), q uniform 0..31 (std 9.2)
        raw[:, :2] = _f16(SPREAD / 9.2, n)
    elif type_name == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, nibbles: w = d·sc·q - dmin·m
        d = SPREAD / (32 * 4.6)
        raw[:, :2], raw[:, 2:4] = _f16(d, n), _f16(7.5 * d, n)
    elif type_name == "Q6_K":  # ql[128], qh[64], int8 scales[16], d: w = d·sc·(q - 32)
        sc = raw[:, 192:208].view(np.int8)
        sc[:] = np.abs(sc) % 32 + 1
        raw[:, 208:210] = _f16(SPREAD / (16 * 18.5), n)
    else:
        raise ValueError(f"no random blocks for {type_name}")
    return raw.reshape(rows, -1)


def _types(ftype: str, name: str, layer: int) -> str:
    if ftype == "q4_0":
        return "Q4_0"
    if ftype == "q8_0":
        return "Q8_0"
    more = name == "token_embd" or (name in ("attn_v", "ffn_down") and layer % 2 == 0)
    return "Q6_K" if more else "Q4_K"


def path_of(shape: str, ftype: str) -> Path:
    from .. import settings

    base = settings.current().cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpitp"
    )
    return Path(base) / "bench" / f"{shape}-{ftype}.gguf"


def ensure(shape: str, ftype: str, say=print) -> Path:
    """The GGUF file of ``shape`` in ``ftype``, written on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    if ftype not in FILE_TYPES:
        raise ValueError(f"--weights {ftype!r} with --shape: one of {', '.join(FILE_TYPES)}")
    out = path_of(shape, ftype)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    say(f"# writing {out} ({shape}, {ftype}, random weights; once)")
    try:
        write(shape, ftype, tmp, say)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write(shape: str, ftype: str, out: Path, say=print) -> None:
    import gguf

    from ..models import default
    from ..progress import Progress

    src = default.gguf_file()
    if src is None:
        raise RuntimeError(f"the default model's tokenizer is needed: {default.INSTALL}")
    s = SHAPES[shape]
    reader = gguf.GGUFReader(str(src))
    vocab = int(reader.fields["llama.vocab_size"].contents())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"mpitp bench {shape} (random weights)")
    w.add_context_length(8192)
    w.add_embedding_length(int(s["hidden"]))
    w.add_block_count(int(s["layers"]))
    w.add_feed_forward_length(int(s["ffn"]))
    w.add_head_count(int(s["heads"]))
    w.add_head_count_kv(int(s["kv_heads"]))
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(int(s["hidden"] // s["heads"]))
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[ftype])
    for key, f in reader.fields.items():  # the default model's tokenizer, as it stores it
        if key.startswith("tokenizer."):
            sub = f.types[1] if len(f.types) > 1 else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
    rng = np.random.default_rng(0)
    H, F, hd = int(s["hidden"]), int(s["ffn"]), int(s["hidden"] // s["heads"])
    kv = int(s["kv_heads"]) * hd
    ones = np.ones(H, np.float32)
    mats = [("token_embd", -1, vocab, H)]
    for i in range(int(s["layers"])):
        mats += [("attn_q", i, H, H), ("attn_k", i, kv, H), ("attn_v", i, kv, H), ("attn_output", i, H, H)]
        mats += [("ffn_gate", i, F, H), ("ffn_up", i, F, H), ("ffn_down", i, H, F)]
    bar = Progress(len(mats), "random blocks", "tensor")
    for name, i, rows, cols in mats:
        t = _types(ftype, name, i)
        full = f"{name}.weight" if i < 0 else f"blk.{i}.{name}.weight"
        w.add_tensor(full, random_blocks(rng, t, rows, cols), raw_dtype=gguf.GGMLQuantizationType[t])
        if name == "attn_output":
            w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        bar.update(1)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bar.close()
