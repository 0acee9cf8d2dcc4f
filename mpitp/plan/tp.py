"""Tensor-parallel plan for a LLaMA-shaped model (the worked example of seed 004, the
study note "LLM parallelism basics", made executable: README, "The seeds' numbers").

Per rank ``r`` of ``p`` (Megatron cut; shapes in that note's ``[in, out]`` orientation,
Hugging Face stores ``[out, in]``)::

    W_Q  [h, q_heads*d/p]   W_K, W_V [h, kv_heads*d/p] (kv replicated if p > kv_heads)
    W_O  [q_heads*d/p, h]   -> all-reduce #1 of [batch, seq, h]
    gate, up [h, i/p]       down [i/p, h]  -> all-reduce #2 of [batch, seq, h]
    embed / lm_head [vocab_padded/p, h]

Two all-reduces per decoder layer per forward, each of batch*seq*h*bytes.
"""

from __future__ import annotations

from pathlib import Path

from ..models.config import ConfigError, LlamaConfig
from .profiles import Profile

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
# bytes per weight as mpitp holds a block format (mpitp.kernels.tiles: quants, the file's
# float16 scale per 32 weights, and a float16 minimum for Q4_1; Q4_0's -8d is not stored);
# K-quants per 256 with their integer scales (mpitp.kernels.tiles: Q4_K 128 bytes of
# quants, 8 + 8 six-bit scales and mins as bytes, the file's float16 d and dmin; Q6_K
# 192 + 16 + 2)
WEIGHT_BYTES = {
    "q8_0": (32 + 2) / 32,
    "q4_0": (16 + 2) / 32,
    "q4_1": (16 + 4) / 32,
    "q4_k": (128 + 16 + 4) / 256,
    "q6_k": (192 + 16 + 2) / 256,
    "f16": 2,
    "bf16": 2,
}
SUPER_BLOCKS = ("q4_k", "q6_k")  # cut in whole super-blocks of 256 (the MLP's columns)


def shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied=False):
    """A :class:`~mpitp.models.config.LlamaConfig` of just a model's shape (the presets)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        tie_word_embeddings=tied,
    )


def params(m: LlamaConfig) -> int:
    """Weights of the model (norms included; biases, where a model has them, left out)."""
    from ..models.pipeline import layer_params

    h = m.hidden_size
    emb = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return sum(layer_params(m, i) for i in range(m.num_hidden_layers)) + emb + h


def qwen3(hidden, layers, heads, kv_heads, inter, vocab=151936, tied=False, experts=0, used=0, expert_inter=0):
    """A Qwen3 (dense, or mixture of experts) shape: head_dim 128, q/k norms."""
    from dataclasses import replace

    base = replace(shape(hidden, layers, heads, kv_heads, inter, vocab, tied), head_dim=128, qk_norm=True)
    base.architecture = "Qwen3MoeForCausalLM" if experts else "Qwen3ForCausalLM"
    return replace(base, num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=expert_inter,
                   norm_topk_prob=bool(experts))  # fmt: skip


PRESETS = {
    "llama2-7b": shape(4096, 32, 32, 32, 11008, 32000),
    "llama2-13b": shape(5120, 40, 40, 40, 13824, 32000),
    "llama2-70b": shape(8192, 80, 64, 8, 28672, 32000),
    "llama3-8b": shape(4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": shape(8192, 80, 64, 8, 28672, 128256),
    "tinyllama-1.1b": shape(2048, 22, 32, 4, 5632, 32000),
    "smollm2-135m": shape(576, 30, 9, 3, 1536, 49152, tied=True),
    "qwen2-7b": shape(3584, 28, 28, 4, 18944, 152064),
    "qwen3-0.6b": qwen3(1024, 28, 16, 8, 3072, tied=True),
    "qwen3-8b": qwen3(4096, 36, 32, 8, 12288),
    "qwen3-30b-a3b": qwen3(2048, 48, 32, 4, 6144, experts=128, used=8, expert_inter=768),
}


def config_path(name_or_path: str, presets=PRESETS) -> Path:
    """A Hugging Face ``config.json``, or the directory holding one; else a ShardingError
    that lists the ``presets``."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        from ..tp.partition import ShardingError

        raise ShardingError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(presets)}) and no config.json there"
        )
    return p


def load_model(name_or_path: str) -> LlamaConfig:
    """A preset name, or a Hugging Face ``config.json`` (or the directory holding it), read
    by the same :class:`~mpitp.models.config.LlamaConfig` the model loads with."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = config_path(name_or_path)
    try:
        return LlamaConfig.from_path(p)
    except ConfigError as e:
        from ..tp.partition import ShardingError

        raise ShardingError(f"{p}: {e}; is it a LLaMA-family config?") from None


def model_name(name_or_path: str) -> str:
    """What the plan calls the model: the preset's name, or the checkpoint directory's."""
    if name_or_path in PRESETS:
        return name_or_path
    p = Path(name_or_path)
    return (p if p.is_dir() else p.parent).name or "model"


def shard_shapes(m: LlamaConfig, p: int, block: int = 1) -> dict:
    """Per-rank weight shapes ([in, out] like the seed), cut by the TP layers' own rules
    (:mod:`mpitp.tp.partition`: uneven, GQA-aware, the MLP cut evenly). Top-level keys
    are rank 0's; ``per_rank`` has every rank's."""
    from ..tp import partition

    att = partition.attention(m.num_attention_heads, m.num_key_value_heads, p)
    inter = partition.mlp(m.intermediate_size, p, block)
    vocab_padded, vocab_rows = partition.vocab(m.vocab_size, p)
    d, h = m.head_dim, m.hidden_size
    moe = None
    if m.num_experts:  # a mixture of experts: its layers' experts cut as --moe auto cuts them
        from ..models.moe import MoEPlan, choose

        moe = MoEPlan.of(m, p, choose(m, p, block), block)
    sparse = sum(m.sparse(i) for i in range(m.num_hidden_layers))
    ranks = []
    for r in range(p):
        q, q0, kv, kv0 = att.rank(r)
        attention = (2 * q + 2 * kv) * d * h + 2 * h
        dense = (m.num_hidden_layers - sparse) * 3 * h * inter[r]
        held, active = 0, 0.0  # experts' weights held on the rank, and read a token (uniform routing)
        if moe is not None:
            cols = moe.columns[r] * moe.experts[r] if moe.mode == "ep" else sum(moe.cut(e)[r] for e in moe.held(r))
            held = sparse * (3 * h * cols + m.num_experts * h)
            active = sparse * (3 * h * cols * m.num_experts_per_tok / m.num_experts + m.num_experts * h)
        layers = m.num_hidden_layers * attention + dense
        row = {"rank": r, "q_heads": [q0, q0 + q], "kv_heads": [kv0, kv0 + kv], "intermediate": inter[r],
               "vocab_rows": vocab_rows[r],
               "weights": layers + held + vocab_rows[r] * h * (1 if m.tie_word_embeddings else 2) + h,
               "streamed": round(layers + active + vocab_rows[r] * h + h)}  # fmt: skip
        if moe is not None:
            mean = cols / moe.experts[r]  # tp: each expert's (turned from expert to expert: MoEPlan.cut)
            mean = int(mean) if mean.is_integer() else mean
            row |= {"moe": moe.mode, "experts": moe.experts[r], "expert_columns": mean}
        ranks.append(row)
    q, kv, i0 = att.q[0] * d, att.kv[0] * d, inter[0]
    return {
        "q_proj": [h, q],
        "k_proj": [h, kv],
        "v_proj": [h, kv],
        "o_proj": [q, h],
        "gate_proj": [h, i0],
        "up_proj": [h, i0],
        "down_proj": [i0, h],
        "embed_tokens": [vocab_rows[0], h],
        "lm_head": [h, vocab_rows[0]],
        "vocab_padded": vocab_padded,
        "kv_heads_per_rank": att.kv[0],
        "kv_replication": max(1, -(-p // m.num_key_value_heads)) if p > m.num_key_value_heads else 1,
        # merged qkv_proj: [Q_r | K_r | V_r]; merged gate_up_proj: [gate_r ; up_r]
        "qkv_local_offsets": {"q": 0, "k": q, "v": q + kv},
        "gate_up_local_offsets": {"gate": 0, "up": i0},
        "per_rank": ranks,
    }


def weight_bytes_per_rank(m: LlamaConfig, p: int, nbytes: float, block: int = 1) -> int:
    """The most any rank holds (element counts from :func:`shard_shapes`)."""
    return round(max(r["weights"] for r in shard_shapes(m, p, block)["per_rank"]) * nbytes)


def balance(m: LlamaConfig, p: int) -> float:
    """What a decode step streams on its critical path over a perfectly even cut: each of
    a layer's two all-reduces waits for the slowest rank of its segment (attention: q, k,
    v and o; the MLP), and the head's all-gather for the rank with the most vocabulary rows."""
    ranks = shard_shapes(m, p)["per_rank"]
    h, d = m.hidden_size, m.head_dim
    width = [(r["q_heads"][1] - r["q_heads"][0], r["kv_heads"][1] - r["kv_heads"][0]) for r in ranks]
    attn = [(2 * q + 2 * k) * d * h for q, k in width]
    mlp = [3 * h * r["intermediate"] for r in ranks]
    vocab = [r["vocab_rows"] * h for r in ranks]
    L = m.num_hidden_layers
    paced = L * (max(attn) + max(mlp)) + max(vocab)
    even = (L * (sum(attn) + sum(mlp)) + sum(vocab)) / p
    return paced / even


def comm_plan(m: LlamaConfig, p: int, batch: int, seq: int, nbytes: int, prof: Profile) -> dict:
    """All-reduces of one forward over ``seq`` tokens (prefill) on TP ranks inside a node."""
    count = 2 * m.num_hidden_layers
    each = batch * seq * m.hidden_size * nbytes
    link = prof.intra
    ring = 2 * (p - 1) * link.time(each / p) if p > 1 else 0.0
    return {
        "allreduces": count,
        "bytes_each": each,
        "bytes_total": count * each,
        "time_volume_s": count * each / link.beta,  # the note's estimate: volume / bandwidth
        "time_ring_s": count * ring,  # alpha-beta ring at p ranks
        "sent_per_rank_bytes": count * (2 * (p - 1) * each // p if p > 1 else 0),
    }


def plan(m: LlamaConfig, p: int, batch: int, seq: int, dtype: str, prof: Profile, weights: str | None = None) -> dict:
    """``dtype``: activations (and weights, unless ``weights`` names a block format of
    :data:`WEIGHT_BYTES`, as ``mpitp generate --weights`` / a GGUF file keeps them)."""
    nbytes = DTYPE_BYTES[dtype.lower()]
    wbytes = WEIGHT_BYTES[weights.lower()] if weights else nbytes
    block = 32 if weights else 1  # block weights: the MLP cut on whole blocks, as the model cuts it
    if weights and weights.lower() in SUPER_BLOCKS:
        block = 256
    return {
        "model": m.to_dict(),
        "tp": p,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "weights": weights or dtype,
        "weight_bytes_per_weight": wbytes,
        "profile": prof.to_dict(),
        "params": params(m),
        "shards": shard_shapes(m, p, block),
        "weights_total_bytes": round(params(m) * wbytes),
        "weights_per_rank_bytes": weight_bytes_per_rank(m, p, wbytes, block),
        "prefill": comm_plan(m, p, batch, seq, nbytes, prof),
        "decode_step": comm_plan(m, p, batch, 1, nbytes, prof),
        "extra_allreduces": "+1 for the vocab-parallel embedding; the LM head gathers logits",
    }
