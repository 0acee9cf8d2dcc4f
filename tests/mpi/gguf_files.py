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
