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

SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, rope_theta=500000.0),
    # Qwen3: q/k norms, head_dim 128 apart from hidden / heads, a 151936-token vocabulary
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                       rope_theta=1000000.0, vocab=151936, tied=True),
    # Qwen3-30B-A3B: 48 layers of 128 experts of 768 columns, 8 chosen per token (--layers N keeps N)
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ffn=6144,
                          experts=128, used=8, expert_ffn=768, rope_theta=1000000.0, vocab=151936),
}  # fmt: skip
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
    more = name in ("token_embd", "output") or (name in ("attn_v", "ffn_down", "ffn_down_exps") and layer % 2 == 0)
    return "Q6_K" if more else "Q4_K"


def path_of(shape: str, ftype: str, layers: int | None = None) -> Path:
    from .. import settings

    base = settings.current().cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpitp"
    )
    cut = f"-{layers}l" if layers else ""
    return Path(base) / "bench" / f"{shape}{cut}-{ftype}.gguf"


def ensure(shape: str, ftype: str, say=print, layers: int | None = None) -> Path:
    """The GGUF file of ``shape`` in ``ftype`` (its first ``layers`` layers), written on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    if ftype not in FILE_TYPES:
        raise ValueError(f"--weights {ftype!r} with --shape: one of {', '.join(FILE_TYPES)}")
    if layers is not None and not 1 <= layers <= SHAPES[shape]["layers"]:
        raise ValueError(f"--layers {layers}: {shape} has 1 to {SHAPES[shape]['layers']}")
    out = path_of(shape, ftype, layers)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    say(f"# writing {out} ({shape}, {ftype}, random weights; once)")
    try:
        write(shape, ftype, tmp, say, layers)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write(shape: str, ftype: str, out: Path, say=print, layers: int | None = None) -> None:
    import gguf

    from ..models import default
    from ..progress import Progress

    src = default.gguf_file()
    if src is None:
        raise RuntimeError(f"the default model's tokenizer is needed: {default.INSTALL}")
    s = SHAPES[shape]
    arch = str(s.get("arch", "llama"))
    reader = gguf.GGUFReader(str(src))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    vocab = int(s.get("vocab", len(tokens)))
    H, F, L = int(s["hidden"]), int(s["ffn"]), int(layers or s["layers"])
    hd = int(s.get("head_dim", H // s["heads"]))
    q, kv = int(s["heads"]) * hd, int(s["kv_heads"]) * hd
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"mpitp bench {shape} (random weights{f', {L} layers' if layers else ''})")
    w.add_context_length(8192)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(int(s["heads"]))
    w.add_head_count_kv(int(s["kv_heads"]))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    w.add_file_type(FILE_TYPES[ftype])
    E = int(s.get("experts", 0))
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(int(s["used"]))
        w.add_expert_feed_forward_length(int(s["expert_ffn"]))
    for key, f in reader.fields.items():  # the default model's tokenizer, as it stores it
        if key.startswith("tokenizer.") and key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            sub = f.types[1] if len(f.types) > 1 else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
    # the shape's vocabulary: the default model's tokens, then unused ones up to its size (rows of the
    # embedding and the head a real model of the shape has; no text ever maps to them)
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    w.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(vocab - len(tokens))])
    w.add_token_types(types + [5] * (vocab - len(tokens)))  # 5: unused
    rng = np.random.default_rng(0)
    ones = np.ones(H, np.float32)
    mats = [("token_embd", -1, 1, vocab, H)]
    if not s.get("tied"):
        mats.append(("output", -1, 1, vocab, H))
    for i in range(L):
        mats += [("attn_q", i, 1, q, H), ("attn_k", i, 1, kv, H), ("attn_v", i, 1, kv, H)]
        mats += [("attn_output", i, 1, H, q)]
        if E:
            I = int(s["expert_ffn"])  # noqa: E741
            mats += [("ffn_gate_exps", i, E, I, H), ("ffn_up_exps", i, E, I, H), ("ffn_down_exps", i, E, H, I)]
        else:
            mats += [("ffn_gate", i, 1, F, H), ("ffn_up", i, 1, F, H), ("ffn_down", i, 1, H, F)]
    bar = Progress(len(mats), "random blocks", "tensor")
    for name, i, n, rows, cols in mats:
        t = _types(ftype, name, i)
        full = f"{name}.weight" if i < 0 else f"blk.{i}.{name}.weight"
        raw = random_blocks(rng, t, n * rows, cols)
        w.add_tensor(full, raw.reshape(n, rows, -1) if n > 1 else raw, raw_dtype=gguf.GGMLQuantizationType[t])
        if name == "attn_output":
            w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
            if arch.startswith("qwen3"):
                w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(hd, np.float32))
                w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(hd, np.float32))
            if E:  # the router, float32 as llama.cpp's quantizer leaves it
                w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.normal(0, SPREAD, (E, H)).astype(np.float32))
        bar.update(1)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bar.close()
