"""Tensor-parallel plan for a LLaMA-shaped model (seed 004 made executable).

Per rank ``r`` of ``p`` (Megatron cut; shapes in the seed's ``[in, out]`` orientation,
Hugging Face stores ``[out, in]``)::

    W_Q  [h, q_heads*d/p]   W_K, W_V [h, kv_heads*d/p] (kv replicated if p > kv_heads)
    W_O  [q_heads*d/p, h]   -> all-reduce #1 of [batch, seq, h]
    gate, up [h, i/p]       down [i/p, h]  -> all-reduce #2 of [batch, seq, h]
    embed / lm_head [vocab_padded/p, h]

Two all-reduces per decoder layer per forward, each of batch*seq*h*bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .profiles import Profile

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d * 2 + h * self.kv_heads * d * 2
        mlp = 3 * h * self.intermediate
        norms = 2 * h
        emb = self.vocab * h * (1 if self.tied else 2)
        return self.layers * (attn + mlp + norms) + emb + h


PRESETS = {
    "llama2-7b": ModelShape("llama2-7b", 4096, 32, 32, 32, 11008, 32000),
    "llama2-13b": ModelShape("llama2-13b", 5120, 40, 40, 40, 13824, 32000),
    "llama2-70b": ModelShape("llama2-70b", 8192, 80, 64, 8, 28672, 32000),
    "llama3-8b": ModelShape("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": ModelShape("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
    "tinyllama-1.1b": ModelShape("tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000),
}


def load_model(name_or_path: str) -> ModelShape:
    """A preset name, or a Hugging Face ``config.json`` (or the directory holding it)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise SystemExit(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                         "and no config.json there")
    cfg = json.loads(p.read_text())
    try:
        return ModelShape(p.parent.name or "model", cfg["hidden_size"], cfg["num_hidden_layers"],
                          cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                          cfg["intermediate_size"], cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise SystemExit(f"{p}: config has no {e.args[0]!r}; is it a LLaMA-family config?") from None


def shard_shapes(m: ModelShape, p: int) -> dict:
    """Per-rank weight shapes ([in, out] like the seed) and the merged-QKV local layout."""
    if m.heads % p:
        raise SystemExit(f"{m.heads} attention heads are not divisible by tp={p}")
    if m.kv_heads % p and p % m.kv_heads:
        raise SystemExit(f"{m.kv_heads} KV heads neither divide nor are divisible by tp={p}")
    if m.intermediate % p:
        raise SystemExit(f"intermediate size {m.intermediate} is not divisible by tp={p}")
    d = m.head_dim
    q = m.heads // p * d
    kv_per_rank = max(m.kv_heads // p, 1)
    kv = kv_per_rank * d
    vocab_padded = -(-m.vocab // (64 * p)) * 64 * p
    return {
        "q_proj": [m.hidden, q], "k_proj": [m.hidden, kv], "v_proj": [m.hidden, kv],
        "o_proj": [q, m.hidden],
        "gate_proj": [m.hidden, m.intermediate // p], "up_proj": [m.hidden, m.intermediate // p],
        "down_proj": [m.intermediate // p, m.hidden],
        "embed_tokens": [vocab_padded // p, m.hidden], "lm_head": [m.hidden, vocab_padded // p],
        "vocab_padded": vocab_padded,
        "kv_heads_per_rank": kv_per_rank, "kv_replication": max(p // m.kv_heads, 1),
        # seed 000: merged qkv_proj, output_sizes [q, kv, kv]; shard k starts at sum(sizes[:k]) / p
        "qkv_local_offsets": {"q": 0, "k": q, "v": q + kv},
        "gate_up_local_offsets": {"gate": 0, "up": m.intermediate // p},
    }


def weight_bytes_per_rank(m: ModelShape, p: int, nbytes: int) -> int:
    s = shard_shapes(m, p)
    h = m.hidden
    per_layer = sum(s[k][0] * s[k][1] for k in
                    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) + 2 * h
    emb = s["embed_tokens"][0] * h * (1 if m.tied else 2)
    return (m.layers * per_layer + emb + h) * nbytes


def comm_plan(m: ModelShape, p: int, batch: int, seq: int, nbytes: int, prof: Profile) -> dict:
    """All-reduces of one forward over ``seq`` tokens (prefill) on TP ranks inside a node."""
    count = 2 * m.layers
    each = batch * seq * m.hidden * nbytes
    link = prof.intra
    ring = 2 * (p - 1) * link.time(each / p) if p > 1 else 0.0
    return {
        "allreduces": count, "bytes_each": each, "bytes_total": count * each,
        "time_volume_s": count * each / link.beta,                 # seed 004: volume / bandwidth
        "time_ring_s": count * ring,                                # alpha-beta ring at p ranks
        "sent_per_rank_bytes": count * (2 * (p - 1) * each // p if p > 1 else 0),
    }


def plan(m: ModelShape, p: int, batch: int, seq: int, dtype: str, prof: Profile) -> dict:
    nbytes = DTYPE_BYTES[dtype.lower()]
    return {
        "model": m.__dict__, "tp": p, "batch": batch, "seq": seq, "dtype": dtype, "profile": prof.to_dict(),
        "params": m.params(),
        "shards": shard_shapes(m, p),
        "weights_total_bytes": m.params() * nbytes,
        "weights_per_rank_bytes": weight_bytes_per_rank(m, p, nbytes),
        "prefill": comm_plan(m, p, batch, seq, nbytes, prof),
        "decode_step": comm_plan(m, p, batch, 1, nbytes, prof),
        "extra_allreduces": "+1 for the vocab-parallel embedding; the LM head gathers logits",
    }
