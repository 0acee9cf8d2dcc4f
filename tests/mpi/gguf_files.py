"""GGUF files made from the committed Hugging Face fixtures, as llama.cpp's converter
writes them (q/k rows permuted per head, tensors in a ggml type), for the quantized
suites. Only what the loader reads: config.json beside model.gguf."""

import json
import shutil
from pathlib import Path

import numpy as np

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    parts = hf.split(".")  # model.layers.{i}.{a}.{b}.weight or model.layers.{i}.{norm}.weight
    i, rest = parts[2], ".".join(parts[3:-1])
    return f"blk.{i}.{LAYER[rest]}.{parts[-1]}"


def permute(w, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half -> llama.cpp)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(src: Path, out: Path, qtype: str, embed_type: str | None = None) -> Path:
    """``out``: config.json + model.gguf holding ``src``'s weights, every 2-D tensor in
    ``qtype`` (the embedding in ``embed_type`` if given), norms in F32."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    w = gguf.GGUFWriter(str(out / "model.gguf"), "llama")
    for name, t in tensors.items():
        t = np.asarray(t, np.float32)
        if name.endswith("q_proj.weight"):
            t = permute(t, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            t = permute(t, cfg["num_key_value_heads"])
        kind = (embed_type or qtype) if "embed_tokens" in name else qtype
        if t.ndim == 2 and kind not in ("F32",):
            ty = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, ty), raw_dtype=ty)
        else:
            w.add_tensor(gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


K_CONFIG = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=320, head_dim=32)  # fmt: skip


def write_q4_k_m(out: Path, seed: int = 0) -> Path:
    """``out``: config.json + model.gguf of a small model in llama.cpp's Q4_K_M mix (Q4_K;
    Q6_K for the tied embedding and for attn_v and ffn_down of layer 0), random blocks
    written directly (no K-quant quantizer is needed: any bytes with sane scales are a
    block). Every width a multiple of 256, as K-quants need; the MLP has 4 super-blocks of
    columns, so TP 1-4 cut it on super-block boundaries."""
    import gguf

    from mpitp.bench.shapes import _types, random_blocks

    c = K_CONFIG
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None, **c}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    H, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out / "model.gguf"), "llama")
    mats = [("token_embd", -1, V, H)]
    for i in range(c["num_hidden_layers"]):
        mats += [("attn_q", i, H, H), ("attn_k", i, kv, H), ("attn_v", i, kv, H), ("attn_output", i, H, H)]
        mats += [("ffn_gate", i, F, H), ("ffn_up", i, F, H), ("ffn_down", i, H, F)]
    ones = np.ones(H, np.float32)
    for name, i, rows, cols in mats:
        t = _types("q4_k_m", name, i)
        full = f"{name}.weight" if i < 0 else f"blk.{i}.{name}.weight"
        w.add_tensor(full, random_blocks(rng, t, rows, cols), raw_dtype=gguf.GGMLQuantizationType[t])
        if name == "attn_output":
            w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
            w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
