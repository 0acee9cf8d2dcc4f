"""GGUF (llama.cpp) LLaMA, Qwen2, Qwen3, Qwen2/3-MoE and OLMoE checkpoint -> a model directory
that mpitp loads.

Reads the file's header with the ``gguf`` package (llama.cpp's own reader) and writes
config.json, a tokenizer.json rebuilt from the GGUF vocabulary and merges (byte-level
BPE, "gpt2" tokenizer model), tokenizer_config.json, and ``model.gguf``: a link to the
file itself. The weights stay in the file, in its formats, and are read from it in place
(:mod:`mpitp.models.gguf_weights`; llama.cpp's reordering of the q/k rows, ``permute``
in convert_hf_to_gguf.py, is undone there by row index).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..errors import MpitpError

NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # mixture of experts: the router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# llama.cpp's stacked experts [n_expert, rows, cols]: one tensor per expert in Hugging Face's names
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# general.architecture -> (transformers' architecture, norm_topk_prob as llama.cpp's graph has it)
ARCHS = {
    "llama": ("LlamaForCausalLM", False),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", True),  # llama.cpp's qwen3moe.cpp: build_moe_ffn(..., norm_w = true)
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "olmoe": ("OlmoeForCausalLM", False),  # llama.cpp's olmoe.cpp: norm_w = false; q/k rows as Hugging Face's
}
PERMUTED = ("llama",)  # architectures whose converter reorders q/k rows per head (LlamaModel.permute)


class GGUFError(MpitpError, ValueError):
    """The GGUF file is not a LLaMA model mpitp can import."""


def hf_name(name: str, expert: int | None = None) -> str:
    """The Hugging Face name of a GGUF tensor (of ``expert`` in a stacked experts tensor)."""
    if name in NAMES:
        return NAMES[name]
    parts = name.split(".")  # blk.{i}.{what}.{weight|bias}
    if parts[0] == "blk" and parts[2] in LAYER:
        return f"model.layers.{parts[1]}.{LAYER[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and parts[2] in EXPERTS and expert is not None:
        return f"model.layers.{parts[1]}.mlp.experts.{expert}.{EXPERTS[parts[2]]}.{parts[3]}"
    raise GGUFError(f"unexpected tensor {name!r} in a GGUF file")


def stacked(name: str) -> bool:
    """Whether ``name`` is llama.cpp's stacked experts tensor (ffn_{gate,up,down}_exps)."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERTS


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: per head, [d/2, 2] interleaved -> [2, d/2]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_REQUIRED = object()


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise GGUFError(f"the GGUF file has no {key!r} field")
        return default
    return f.contents()


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an mpitp-loadable checkpoint directory; atomic (a temp dir renamed at the end)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        arch = _field(reader, "general.architecture")
    except Exception as e:  # truncated, corrupt, or not a GGUF file at all
        raise GGUFError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if arch not in ARCHS:
        raise GGUFError(f"{gguf_path}: architecture {arch!r}; mpitp imports {', '.join(ARCHS)} GGUF files")
    g = lambda k, d=_REQUIRED: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads, kv = int(g("attention.head_count")), int(g("attention.head_count_kv", g("attention.head_count")))
    names = set()
    for t in reader.tensors:
        expected = (
            int(np.prod(t.shape)) * gguf.GGML_QUANT_SIZES[t.tensor_type][1] // gguf.GGML_QUANT_SIZES[t.tensor_type][0]
        )
        if t.data.nbytes != expected:  # the header promised more bytes than the file has
            raise GGUFError(
                f"{gguf_path}: tensor {t.name} cannot be read ({t.data.nbytes} of {expected} bytes; truncated file?)"
            )
        names.add(hf_name(t.name, 0))
    tokens = _field(reader, "tokenizer.ggml.tokens", _REQUIRED)
    hidden = int(g("embedding_length"))
    hf_arch, norm_topk = ARCHS[arch]
    config = {
        "architectures": [hf_arch],
        "model_type": {"llama": "llama", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length", g("expert_feed_forward_length", 0))),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",  # what the float path computes in; the weights keep the file's formats
        "source": f"converted by mpitp from {Path(gguf_path).name}",
        "head_dim": int(g("attention.key_length", hidden // heads)),
    }
    if arch.endswith("moe"):
        config |= {
            "num_experts": int(g("expert_count")),
            "num_experts_per_tok": int(g("expert_used_count")),
            # OLMoE's converter writes the experts' width as feed_forward_length only
            "moe_intermediate_size": int(g("expert_feed_forward_length", g("feed_forward_length", 0))),
            "norm_topk_prob": norm_topk,
            "shared_expert_intermediate_size": int(g("expert_shared_feed_forward_length", 0)),
            # llama.cpp's graph: every layer with ffn_gate_inp is sparse, the others dense
            "mlp_only_layers": [
                i for i in range(int(g("block_count"))) if f"model.layers.{i}.mlp.gate.weight" not in names
            ],
        }
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent if out.parent.exists() else None))
    try:
        (tmp / "model.gguf").symlink_to(Path(gguf_path).resolve())
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _tokenizer(reader, tokens).save(str(tmp / "tokenizer.json"))
        write_tokenizer_config(reader, tokens, tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_tokenizer_config(reader, tokens: list[str], out: Path) -> None:
    """tokenizer_config.json as transformers writes it: the GGUF's chat template and the
    special tokens it names (what :mod:`mpitp.models.chat` and AutoTokenizer read)."""
    cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key, field in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                       ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):  # fmt: skip
        i = _field(reader, f"tokenizer.ggml.{field}")
        if i is not None and 0 <= int(i) < len(tokens):
            cfg[key] = tokens[int(i)]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    tmp = out / "tokenizer_config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    os.replace(tmp, out / "tokenizer_config.json")


def add_tokenizer_config(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write only tokenizer_config.json into an imported directory (older imports lack it)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    write_tokenizer_config(reader, _field(reader, "tokenizer.ggml.tokens", _REQUIRED), Path(out_dir))


def _tokenizer(reader, tokens: list[str]):
    """Byte-level BPE from the GGUF vocabulary and merges; control tokens stay whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r}; only byte-level BPE ('gpt2') is imported")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", _REQUIRED)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    types = _field(reader, "tokenizer.ggml.token_type") or []
    control = [tokens[i] for i, t in enumerate(types) if int(t) == 3]  # GGUF: 3 = control
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok
