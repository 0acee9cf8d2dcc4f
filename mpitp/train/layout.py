"""Units: the model's parameters as flat buffers, one per decoder layer plus the embedding
and the head (final norm, and lm_head unless tied), as FSDP and ZeRO cut them.

A unit's tensors lie back to back in Hugging Face names and layouts (``W[out, in]``); q, k
and v are adjacent, so one view serves the fused qkv matmul, and so are gate and up. The
buffer is padded to a multiple of N ranks, and rank r owns ``[r·P/N, (r+1)·P/N)``::

    layer unit   | ln1 | q | k | v | (bq bk bv) | o | ln2 | gate | up | down |pad|
    N = 3        |<----- rank 0 ----->|<----- rank 1 ----->|<----- rank 2 ----->|

Tensors of two or more dimensions get weight decay; norms and biases do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.config import LlamaConfig


@dataclass(frozen=True)
class Tensor:
    key: str  # short name inside the unit ("q", "ln1", ...)
    name: str  # Hugging Face name
    shape: tuple
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def decay(self) -> bool:
        return len(self.shape) >= 2


class UnitLayout:
    """Where each tensor of one unit lies in its flat buffer."""

    def __init__(self, name: str, specs: list[tuple[str, str, tuple]], fused: dict[str, tuple[str, ...]] | None = None):
        self.name, self.tensors, off = name, [], 0
        fused = fused or {}
        for key, hf, shape in specs:
            self.tensors.append(Tensor(key, hf, tuple(shape), off))
            off += int(np.prod(shape))
        self.numel = off
        self.by_key = {t.key: t for t in self.tensors}
        self.fused = {k: v for k, v in fused.items() if all(p in self.by_key for p in v)}

    def padded(self, n: int) -> int:
        return -(-max(self.numel, 1) // n) * n

    def owned(self, n: int, rank: int) -> tuple[int, int]:
        """Rank's range in the padded buffer."""
        s = self.padded(n) // n
        return rank * s, (rank + 1) * s

    def views(self, flat) -> dict:
        """Each tensor (and fused group, stacked along rows) as a view of ``flat``."""
        out = {t.key: flat[t.offset : t.offset + t.size].reshape(t.shape) for t in self.tensors}
        for key, parts in self.fused.items():
            first, last = self.by_key[parts[0]], self.by_key[parts[-1]]
            rows = sum(self.by_key[p].shape[0] for p in parts)
            out[key] = flat[first.offset : last.offset + last.size].reshape((rows,) + first.shape[1:])
        return out

    def decay_mask(self, lo: int, hi: int) -> np.ndarray:
        """Which elements of ``[lo, hi)`` get weight decay (padding does not)."""
        mask = np.zeros(hi - lo, bool)
        for t in self.tensors:
            if t.decay:
                a, b = max(t.offset, lo), min(t.offset + t.size, hi)
                if a < b:
                    mask[a - lo : b - lo] = True
        return mask


def llama_units(cfg: LlamaConfig) -> list[UnitLayout]:
    """[embedding, layer 0 … layer L-1, head] for a LLaMA / Qwen2 config."""
    H, d, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    units = [UnitLayout("embed", [("embed", "model.embed_tokens.weight", (V, H))])]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        specs = [
            ("ln1", p + "input_layernorm.weight", (H,)),
            ("q", p + "self_attn.q_proj.weight", (q, H)),
            ("k", p + "self_attn.k_proj.weight", (kv, H)),
            ("v", p + "self_attn.v_proj.weight", (kv, H)),
        ]
        if cfg.qkv_bias:
            specs += [
                ("bq", p + "self_attn.q_proj.bias", (q,)),
                ("bk", p + "self_attn.k_proj.bias", (kv,)),
                ("bv", p + "self_attn.v_proj.bias", (kv,)),
            ]
        specs.append(("o", p + "self_attn.o_proj.weight", (H, q)))
        if cfg.o_bias:
            specs.append(("bo", p + "self_attn.o_proj.bias", (H,)))
        specs += [
            ("ln2", p + "post_attention_layernorm.weight", (H,)),
            ("gate", p + "mlp.gate_proj.weight", (I, H)),
            ("up", p + "mlp.up_proj.weight", (I, H)),
        ]
        if cfg.mlp_bias:
            specs += [("bgate", p + "mlp.gate_proj.bias", (I,)), ("bup", p + "mlp.up_proj.bias", (I,))]
        specs.append(("down", p + "mlp.down_proj.weight", (H, I)))
        if cfg.mlp_bias:
            specs.append(("bdown", p + "mlp.down_proj.bias", (H,)))
        units.append(
            UnitLayout(
                f"layer{i}",
                specs,
                {
                    "qkv": ("q", "k", "v"),
                    "bqkv": ("bq", "bk", "bv"),
                    "gate_up": ("gate", "up"),
                    "bgate_up": ("bgate", "bup"),
                },
            )
        )
    head: list[tuple[str, str, tuple]] = [("norm", "model.norm.weight", (H,))]
    if not cfg.tie_word_embeddings:
        head.append(("head", "lm_head.weight", (V, H)))
    units.append(UnitLayout("head", head))
    return units


def init_unit(layout: UnitLayout, seed: int, std: float = 0.02, dtype=np.float64) -> np.ndarray:
    """A fresh unit as transformers initialises LLaMA: weights ~ N(0, std), norms 1,
    biases 0. Drawn per unit from ``seed``, so every layout of ranks starts the same."""
    flat = np.zeros(layout.numel, dtype)
    rng = np.random.default_rng(seed)
    for t in layout.tensors:
        view = flat[t.offset : t.offset + t.size]
        if t.key.startswith(("ln", "norm")):
            view[...] = 1.0
        elif t.decay:
            view[...] = rng.standard_normal(t.size) * std
    return flat
