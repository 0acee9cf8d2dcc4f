"""LLaMA-family configuration from a Hugging Face ``config.json``.

Reads both config styles: transformers 4 (``rope_theta`` and ``rope_scaling`` at the top
level) and transformers 5 (``rope_parameters = {"rope_type": ..., "rope_theta": ...}``).
Qwen2 differs from LLaMA only by biases on q/k/v, so it loads as the same model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MpitpError

ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "MistralForCausalLM": False,
    "Qwen3ForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
    "Qwen2MoeForCausalLM": True,
    "OlmoeForCausalLM": False,
}
# (architecture -> whether q, k, v carry a bias whatever attention_bias says)
MODEL_TYPES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe",
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM")


class ConfigError(MpitpError, ValueError):
    """The checkpoint's config cannot be served by mpitp's LLaMA model."""


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", "factor": ...} or {}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim of each q and k head, before RoPE
    qk_norm_whole: bool = False  # OLMoE: q and k each RMS-normed over the whole projection (every head)
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    torch_dtype: str = "float32"
    # mixture of experts (Qwen3-MoE, Qwen2-MoE): 0 experts = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    decoder_sparse_step: int = 1  # every this-many-th layer has experts (its index + 1 a multiple)
    mlp_only_layers: list[int] = field(default_factory=list)  # layers kept dense whatever the step
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, sigmoid-gated
    # (OLMoE names no moe_intermediate_size: its experts are intermediate_size wide, every layer sparse)

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts instead of a dense MLP (transformers' rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, cfg: dict) -> LlamaConfig:
        """Parse and check a config; anything malformed is a :class:`ConfigError`."""
        try:
            return cls._from_dict(cfg)
        except ConfigError:
            raise
        except (TypeError, ValueError, ZeroDivisionError, AttributeError, OverflowError) as e:
            raise ConfigError(f"config.json: a field has an unusable value ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_dict(cls, cfg: dict) -> LlamaConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"unknown architecture {archs}; mpitp serves {', '.join(ARCHITECTURES)}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            out = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
            )
        except KeyError as e:
            raise ConfigError(f"config.json has no {e.args[0]!r}") from None
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict):  # transformers 5
            out.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        else:  # transformers 4
            out.rope_theta = float(cfg.get("rope_theta", 10000.0))
            scaling = dict(cfg.get("rope_scaling") or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3", "linear"):
            raise ConfigError(f"rope scaling type {kind!r} is not supported (default, linear, llama3 are)")
        out.rope_scaling = {} if kind == "default" else {**scaling, "rope_type": kind}
        out.rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
        out.max_position_embeddings = int(cfg.get("max_position_embeddings", 2048))
        out.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        out.qkv_bias = ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False))
        out.o_bias = bool(cfg.get("attention_bias", False))
        out.mlp_bias = bool(cfg.get("mlp_bias", False))
        out.bos_token_id = cfg.get("bos_token_id")
        eos = cfg.get("eos_token_id")
        out.eos_token_id = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        out.architecture = arch
        out.qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
        out.qk_norm_whole = arch == "OlmoeForCausalLM"
        if arch == "OlmoeForCausalLM" and cfg.get("clip_qkv") is not None:
            raise ConfigError(f"config.json: clip_qkv = {cfg['clip_qkv']} (q, k, v clamped) is not supported")
        if arch in MOE_ARCHITECTURES:
            out.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            out.num_experts_per_tok = int(cfg.get("num_experts_per_tok") or 0)
            wide = cfg.get("intermediate_size") if arch == "OlmoeForCausalLM" else cfg.get("moe_intermediate_size")
            out.moe_intermediate_size = int(wide or 0)
            out.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
            out.decoder_sparse_step = int(cfg.get("decoder_sparse_step") or 1)
            out.mlp_only_layers = [int(i) for i in cfg.get("mlp_only_layers") or []]
            out.shared_expert_intermediate_size = int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch == "Qwen2MoeForCausalLM":
                out.qkv_bias = bool(cfg.get("qkv_bias", True))
                out.o_bias = False
        out.torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        if out.head_dim * heads != hidden and "head_dim" not in cfg:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        out.check()
        return out

    def check(self) -> None:
        """Refuse shapes no model can have, naming the fields and numbers."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.json: {name} = {getattr(self, name)}; it must be at least 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config.json: head_dim = {self.head_dim} is odd; rotary embeddings need pairs")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ConfigError(
                f"config.json: num_experts_per_tok = {self.num_experts_per_tok} of num_experts = "
                f"{self.num_experts} with moe_intermediate_size = {self.moe_intermediate_size}: each token "
                "needs 1 to num_experts experts of at least one column"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError(
                f"config.json: rms_norm_eps = {self.rms_norm_eps} and rope_theta = {self.rope_theta} must be positive"
            )

    def to_dict(self) -> dict:
        """A transformers-style ``config.json`` that :meth:`from_dict` (and transformers'
        LlamaConfig / Qwen2Config) read back as this config."""
        qwen = self.architecture.startswith("Qwen")
        out = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES.get(self.architecture, "llama"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling or None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None)),
            "torch_dtype": self.torch_dtype,
        }
        if not qwen:
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        if self.num_experts:
            out |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": self.mlp_only_layers,
            }
            if self.shared_expert_intermediate_size:
                out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return out

    @classmethod
    def from_path(cls, path: str | Path) -> LlamaConfig:
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.exists():
            raise ConfigError(f"no config.json in {p}")
        try:
            cfg = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{f}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
        return cls.from_dict(cfg)
