"""Tensor-parallel LLaMA (and Qwen2) inference in NumPy / CuPy.

The Megatron cut, per decoder layer on ``p`` ranks::

    x ─ RMSNorm ─ qkv_proj (column: heads/p) ─ RoPE ─ attention over own heads ─ o_proj (row) ─ all-reduce ─ + x
      ─ RMSNorm ─ gate_up_proj (column: inter/p) ─ SiLU(gate)*up ─ down_proj (row) ─ all-reduce ─ + h

Exactly two all-reduces per layer, plus one for the vocab-parallel embedding and an
all-gather of the logits in the head. Every rank ends with the full logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ..tp import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    partition,
)
from ..tp.arena import pack, pack_blocks
from .config import LlamaConfig
from .kv_cache import KVCache, kv_cache_dtype
from .ops import attention, rms_norm, swiglu
from .rope import Rotary

if TYPE_CHECKING:
    from .decode_step import DecodeLayers


class RMSNorm:
    def __init__(self, hidden: int, eps: float, dtype=np.float32, xp=np):
        self.eps, self.xp = eps, xp
        self.weight = xp.ones(hidden, dtype)

    def weight_loader(self, param, src, shard_id=None) -> None:
        if tuple(src.shape) != tuple(self.weight.shape):
            from ..tp import ShardingError

            raise ShardingError(f"{src.name}: checkpoint shape {tuple(src.shape)}, model expects {self.weight.shape}")
        self.weight[...] = self.xp.asarray(src.read(), self.weight.dtype)

    def __call__(self, x):
        if _fast(x, self.weight):
            out = np.empty_like(x)
            _decode_kernels().rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, out.reshape(-1, x.shape[-1]))
            return out
        return rms_norm(x, self.weight, self.eps)


def _fast(*arrays) -> bool:
    """NumPy float32, contiguous: the compiled small ops of :mod:`mpitp.kernels.decode`."""
    return all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


_DECODE = None
# a prompt's attention goes this many query rows at a time, each block over the columns up
# to its last row (the causal square's upper part is never formed): on the 1B shape at 476
# tokens, 61 -> 47 ms a layer (docs/measurements.md, "Prefill on AMX tiles")
QUERY_BLOCK = 64
SHORT_ROWS = 64  # mean columns a query row sees, up to which prefill attention is one compiled call


def _decode_kernels():
    global _DECODE
    if _DECODE is None:
        from ..kernels import decode

        _DECODE = decode
    return _DECODE


class Step:
    """What every layer of one forward shares: RoPE tables for the new positions and the
    attention mask (causal, and pads of left-padded prompts masked out), built once."""

    def __init__(self, rotary: Rotary, positions, cache: KVCache, T: int, xp):
        self.cos, self.sin = rotary.tables(positions)
        s = cache.length
        S = s + T
        causal = xp.arange(S)[None, :] <= (s + xp.arange(T))[:, None]  # [T, S]
        allowed = causal[None] & cache.valid[:, None, :S]  # [B, T, S]
        owner = getattr(cache, "owner", None)  # views of a cache (serve) have none
        if owner is not None:  # several prompts packed into one row: each sees only its own columns
            allowed = allowed & (owner[None, :S] == owner[s:S, None])[None]
        self.allowed = allowed[:, None, None]  # [B, 1, 1, T, S]
        self.masked = not bool(self.allowed.all())  # decoding without pads masks nothing
        self._cut = (allowed, s, owner, xp)
        self.one = T == 1 and _fast(self.cos)  # a decode step: attention in one compiled call
        if self.one:
            self.cos1 = np.ascontiguousarray(self.cos[:, 0, 0])  # [B, head_dim]
            self.sin1 = np.ascontiguousarray(self.sin[:, 0, 0])

    @cached_property
    def columns(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(indptr, cols): the columns each query row (b, t) may see, row b·T + t's at
        cols[indptr[r] : indptr[r + 1]], for the compiled prefill attention (NumPy only) —
        None where rows see more than SHORT_ROWS columns on average: there BLAS's products
        of whole query blocks win (a 476-token prompt: 585-610 ms to its first token with
        them, 685-690 compiled), where for short packed prompts the per-part calls cost more
        than the arithmetic."""
        allowed = np.asarray(self._cut[0])  # [B, T, S]
        B, T, S = allowed.shape
        rows, cols = np.nonzero(allowed.reshape(B * T, S))
        if len(cols) > SHORT_ROWS * B * T:
            return None
        indptr = np.zeros(B * T + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=B * T), out=indptr[1:])
        return indptr, cols.astype(np.int64)

    @cached_property
    def parts(self) -> list:
        """Masked attention's parts (:func:`_parts`), cut at the first layer that asks."""
        return _parts(*self._cut)


def _parts(allowed, s: int, owner, xp) -> list:
    """A masked forward's attention in parts: (rows, columns, their mask [B, 1, 1, rows,
    columns]) each. QUERY_BLOCK rows at a time over the columns they may see (causal: about
    half of them); a packed prefill's prompts each apart, over their own columns only (the
    whole packed row would score every prompt's queries against every prompt's keys, the
    square of the sum of the lengths, nearly all of it masked: 8 prompts of ~20 new tokens
    after a cached system prompt, 47 -> 15 ms of attention on the default model's rank 0)::

        packed row   [a a b b b | A A A B B]      rows A: columns a a A A A
                      cached      new             rows B: columns b b b B B
    """
    T, S = allowed.shape[1], allowed.shape[2]
    if owner is None:
        spans = [
            (t0, min(T, t0 + QUERY_BLOCK), slice(0, min(S, s + t0 + QUERY_BLOCK))) for t0 in range(0, T, QUERY_BLOCK)
        ]
    else:
        own = np.asarray(owner[:S].tolist())
        spans = []
        ends = np.flatnonzero(np.diff(own[s:])) + 1  # the new rows of each prompt: runs of one owner
        for t0, t1 in zip([0, *ends.tolist()], [*ends.tolist(), T]):
            mine = np.flatnonzero(own == own[s + t0])
            for b0 in range(t0, t1, QUERY_BLOCK):
                b1 = min(t1, b0 + QUERY_BLOCK)
                cols = mine[mine < s + b1]  # what these rows may see (causal)
                if cols[-1] - cols[0] + 1 == cols.size:  # one run (a prompt alone): a view, not a copy
                    spans.append((b0, b1, slice(int(cols[0]), int(cols[-1]) + 1)))
                else:
                    spans.append((b0, b1, xp.asarray(cols)))
    return [(slice(t0, t1), c, allowed[:, t0:t1][:, :, c][:, None, None]) for t0, t1, c in spans]


class Attention:
    def __init__(self, cfg: LlamaConfig, comm, rotary: Rotary, dtype, xp, split: partition.AttentionSplit):
        self.xp, self.rotary, self.head_dim = xp, rotary, cfg.head_dim
        # a Python float, as transformers' ``scaling``: a NumPy float64 here would promote
        # the scores and the softmax to float64 (NEP 50)
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.qkv_bias,
            comm=comm,
            split=split,
            dtype=dtype,
            xp=xp,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=cfg.o_bias,
            comm=comm,
            sizes=[q * cfg.head_dim for q in split.q],
            dtype=dtype,
            xp=xp,
        )
        self.nh, self.nkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads

    def __call__(self, x, step: Step, cache: KVCache, layer: int):
        d = self.head_dim
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        if step.one and _fast(qkv) and _decode_kernels().usable(cache.k[layer], cache.v[layer], self.nh // self.nkv):
            out = np.empty((B, self.nh * d), np.float32)
            _decode_kernels().attend(
                qkv.reshape(B, -1), step.cos1, step.sin1, cache.k[layer], cache.v[layer], cache.valid,
                cache.length, self.nh, self.nkv, np.float32(self.scale), step.masked, out,
            )  # fmt: skip
            return self.o_proj(out.reshape(B, 1, -1))
        nq = self.nh + self.nkv  # q and k sit side by side: one rotation for both
        if _fast(qkv, step.cos, step.sin):
            qk = np.empty((B, T, nq, d), np.float32)
            flat = (B * T, -1)
            _decode_kernels().rotate(
                qkv.reshape(flat), nq, step.cos.reshape(B * T, d), step.sin.reshape(B * T, d), qk.reshape(flat)
            )
        else:
            qk = self.rotary.apply(qkv[..., : nq * d].reshape(B, T, nq, d), step.cos, step.sin)
        q, k, v = qk[:, :, : self.nh], qk[:, :, self.nh :], qkv[..., nq * d :]
        s = cache.length
        cache.k[layer][:, s : s + T] = k
        cache.v[layer][:, s : s + T] = v.reshape(B, T, self.nkv, d)
        S = s + T
        if _fast(qk) and step.columns is not None:  # short rows: every row's own columns in one call
            kk, vv = (np.ascontiguousarray(c[layer][:, :S], np.float32) for c in (cache.k, cache.v))
            indptr, cols = step.columns
            out = np.empty((B, T, self.nh * d), np.float32)
            _decode_kernels().attend_rows(
                qk, self.nh, self.nh // self.nkv, kk, vv, indptr, cols, np.float32(self.scale), out
            )
            return self.o_proj(out)
        keys = cache.k[layer][:, :S].transpose(0, 2, 1, 3)  # [B, kv, S, d]
        vals = cache.v[layer][:, :S].transpose(0, 2, 1, 3)  # [B, kv, S, d]
        if keys.dtype != qkv.dtype:  # a float16 cache: widened once, exactly
            keys, vals = keys.astype(qkv.dtype), vals.astype(qkv.dtype)
        g = self.nh // self.nkv
        qh = q.reshape(B, T, self.nkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, kv, g, T, d]
        if not step.masked:  # every column seen by every row
            out, _ = attention(qh, keys, vals, self.scale)
        else:  # in parts (_parts): rows over the columns they may see
            out = self.xp.empty((B, self.nkv, g, T, d), qh.dtype)
            for rows, cols, allowed in step.parts:
                out[:, :, :, rows] = attention(
                    qh[:, :, :, rows], keys[:, :, cols], vals[:, :, cols], self.scale, allowed
                )[0]
        out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, self.nh * d)
        return self.o_proj(out)


class MLP:
    def __init__(self, cfg: LlamaConfig, comm, dtype, xp, sizes: list[int]):
        self.xp = xp
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias, comm=comm, sizes=sizes, dtype=dtype, xp=xp
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, comm=comm, sizes=sizes, dtype=dtype, xp=xp
        )

    def __call__(self, x):
        gu = self.gate_up_proj(x)
        half = gu.shape[-1] // 2
        if _fast(gu):
            act = np.empty((*gu.shape[:-1], half), np.float32)
            _decode_kernels().swiglu(gu.reshape(-1, 2 * half), act.reshape(-1, half))
            return self.down_proj(act)
        return self.down_proj(swiglu(gu[..., :half], gu[..., half:]))


class DecoderLayer:
    def __init__(self, cfg: LlamaConfig, comm, rotary: Rotary, dtype, xp, plan: TPPlan):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, xp)
        self.self_attn = Attention(cfg, comm, rotary, dtype, xp, plan.attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, xp)
        self.mlp = MLP(cfg, comm, dtype, xp, plan.mlp)

    def __call__(self, x, step, cache, layer):
        h = x + self.self_attn(self.input_layernorm(x), step, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class TPPlan:
    """How every decoder layer is cut over p ranks: attention by KV-head groups, the MLP's
    intermediate columns evenly (:mod:`mpitp.tp.partition`)."""

    attention: partition.AttentionSplit
    mlp: list[int]

    @classmethod
    def of(cls, c: LlamaConfig, p: int, block: int = 1) -> TPPlan:
        """``block``: the MLP's cut in multiples of it where the size allows (:func:`partition.mlp`)."""
        att = partition.attention(c.num_attention_heads, c.num_key_value_heads, p)
        return cls(att, partition.mlp(c.intermediate_size, p, block))


class LlamaForCausalLM:
    """``model(ids)`` gives full-vocabulary logits on every rank; ``generate`` decodes.

    :meth:`named_modules` is the one list of the model's weights: the loader, the arena
    and the byte counts all read it."""

    # checkpoint tensors that land in one merged module: name part -> (module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: LlamaConfig,
        comm=None,
        dtype="float32",
        xp=np,
        weights: str = "float32",
        mlp_block: int = 32,
        stage=None,
    ):
        """``stage``: a pipeline stage (:class:`mpitp.models.pipeline.Stage`) — this model
        holds only its layers (and the embedding on the first, the norm and head on the
        last) and passes hidden states to the next stage; ``comm`` is then the stage's
        tensor-parallel group."""
        self.config, self.comm, self.xp, self.dtype = config, comm, xp, np.dtype(dtype)
        self.stage = stage
        self.first_layer: int
        self.first_layer, end = (0, config.num_hidden_layers) if stage is None else stage.layers
        self.is_first, self.is_last = self.first_layer == 0, end == config.num_hidden_layers
        self.weights = weights if xp is np else "float32"  # how matmul weights are kept (loader.WEIGHTS)
        self.activations = "float32"  # of block weights' matmuls: int8 or float32 (set by the loader)
        self.kv_dtype = np.dtype(dtype)  # of the KV cache: kv_cache_dtype(kv_choice) once loaded
        self.kv_choice: str | None = None  # the loader's kv_cache_dtype
        c = config
        self.rotary = Rotary(
            c.head_dim, c.rope_theta, c.rope_scaling, min(c.max_position_embeddings, 4096), xp=xp, dtype=np.float32
        )
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, comm=comm, dtype=self.dtype, xp=xp)
        # the MLP cut in whole blocks of block weights (32; 256 for K-quants' super-blocks)
        self.plan = TPPlan.of(c, comm.size if comm is not None else 1, 1 if self.weights == "float32" else mlp_block)
        self.layers = [
            DecoderLayer(c, comm, self.rotary, self.dtype, xp, self.plan) for _ in range(self.first_layer, end)
        ]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, xp)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, comm=comm, dtype=self.dtype, xp=xp)
        if c.tie_word_embeddings:
            self.lm_head.tie(self.embed_tokens)
        for _, m in self.named_modules():
            if hasattr(m, "weights"):
                m.weights = self.weights
        if xp is np and self.weights == "float32":  # one stream of the matrices decoding reads, in reading order: the
            # layers', then the head's; the embedding last (one row of it is read per token;
            # packed once when the head shares it)
            mats = [m for _, m in self.named_modules() if hasattr(m, "_wt")]
            self._arena = pack(mats[1:] + mats[:1] if mats and mats[0] is self.embed_tokens else mats)
        self.last_stats: dict = {}
        self._decode: DecodeLayers | None = None
        self._decode_built = False

    @classmethod
    def from_pretrained(
        cls,
        path,
        comm=None,
        dtype: str = "float32",
        device: str = "cpu",
        weights: str = "auto",
        activations: str | None = None,
        pp: int = 1,
        stage_inside_node: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> LlamaForCausalLM:
        from .loader import load_pretrained

        return load_pretrained(
            cls,
            path,
            comm=comm,
            dtype=dtype,
            device=device,
            weights=weights,
            activations=activations,
            pp=pp,
            stage_inside_node=stage_inside_node,
            kv_cache_dtype=kv_cache_dtype,
        )

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        a = self.layers[0].self_attn
        return KVCache(len(self.layers), batch, max_len, a.nkv, self.config.head_dim, self.kv_dtype, self.xp)

    def check_ids(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            from .generate import GenerationError

            bad = int(ids.max() if ids.max() >= self.config.vocab_size else ids.min())
            raise GenerationError(
                f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size}) of "
                "this model (does the tokenizer belong to it?)"
            )

    def forward(self, ids, positions, cache: KVCache, last_only: bool = False, keep=None):
        """Logits [B, T, vocab] for ``ids`` [B, T] appended to ``cache`` at ``cache.length``
        (``last_only``: just the last position's, [B, 1, vocab], as decoding needs; ``keep``:
        the positions listed, [B, len(keep), vocab])."""
        if self.is_first:
            h = self.embed_tokens(ids)
        else:  # the previous stage's hidden states
            h = self.stage.receive((ids.shape[0], ids.shape[1], self.config.hidden_size))
        step = Step(self.rotary, positions, cache, ids.shape[1], self.xp)
        fast = self._decode_layers() if ids.shape[1] == 1 else None
        if fast is not None and fast.fits(ids.shape[0], step, cache):
            h = fast.loop(h, step, cache)
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, step, cache, i)
        cache.length += ids.shape[1]
        if not self.is_last:  # on to the next stage; the logits come from the last
            self.stage.send(h)
            return None
        if last_only:
            h = h[:, -1:]
        elif keep is not None:
            h = h[:, keep]
        return self.lm_head(self.norm(h))

    def _decode_layers(self) -> DecodeLayers | None:
        """The bound loop of a decode step (:mod:`.decode_step`), built at the first forward
        after loading (its kernels hold the weights' arrays; :meth:`finish_load` resets it)."""
        if not self._decode_built:
            from .decode_step import DecodeLayers

            self._decode, self._decode_built = DecodeLayers.of(self), True
        return self._decode

    def __call__(self, input_ids):
        ids = self.xp.asarray(np.asarray(input_ids, dtype=np.int64))
        if ids.ndim == 1:
            ids = ids[None]
        self.check_ids(np.asarray(input_ids))
        B, T = ids.shape
        cache = self.new_cache(B, T)
        cache.valid[:, :T] = True
        positions = self.xp.broadcast_to(self.xp.arange(T), (B, T))
        return self.forward(ids, positions, cache)

    def generate(self, input_ids, max_new_tokens: int = 32, **sampling):
        from .generate import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **sampling)

    def named_modules(self):
        """(Hugging Face prefix, module) of every module that holds weights, in the order
        a forward reads them."""
        if self.is_first or (self.is_last and self.lm_head.tied):  # a tied head's table on the last stage
            yield "model.embed_tokens", self.embed_tokens
        for i, L in enumerate(self.layers, start=self.first_layer):
            p = f"model.layers.{i}."
            yield p + "input_layernorm", L.input_layernorm
            yield p + "self_attn.qkv_proj", L.self_attn.qkv_proj
            yield p + "self_attn.o_proj", L.self_attn.o_proj
            yield p + "post_attention_layernorm", L.post_attention_layernorm
            yield p + "mlp.gate_up_proj", L.mlp.gate_up_proj
            yield p + "mlp.down_proj", L.mlp.down_proj
        if self.is_last:
            yield "model.norm", self.norm
            yield "lm_head", self.lm_head

    def named_weights(self):
        """(checkpoint name, module, param, shard id) of every tensor a Hugging Face
        checkpoint of this model carries: merged modules unpacked through
        :attr:`packed_modules_mapping` (q/k/v, gate/up); a tied head carries none."""
        unpack: dict[str, list] = {}
        for part, (module, shard) in self.packed_modules_mapping.items():
            unpack.setdefault(module, []).append((part, shard))
        for prefix, mod in self.named_modules():
            if mod is self.lm_head and self.lm_head.tied:
                continue
            parent, _, leaf = prefix.rpartition(".")
            for param in ("weight", "bias"):
                if getattr(mod, param, None) is None:
                    continue
                for part, shard in unpack.get(leaf, [(leaf, None)]):
                    yield f"{parent}.{part}.{param}".lstrip("."), mod, param, shard

    def finish_load(self) -> None:
        """After the loader: block weights joined per module (:meth:`LinearBase.finish`)."""
        for _, m in self.named_modules():
            if hasattr(m, "finish"):
                m.finish()
        self._decode_built = False
        why = {m.fallback for _, m in self.named_modules() if getattr(m, "fallback", "")}
        if why:
            from ..log import get_logger

            get_logger("models").warning(f"some weights kept as float32 on this rank: {'; '.join(sorted(why))}")
        if self.weights != "float32":  # block weights in reading order: the layers', then the head's
            mods = [m for _, m in self.named_modules() if getattr(m, "qweight", None) is not None]
            from ..kernels.cpu import SCHEMES

            digits, outliers = SCHEMES.get(self.activations, (1, False))
            if self.activations.startswith("int8"):
                self._tile(mods, digits, outliers)
            from ..kernels.formats import leaves

            held = [w for m in mods for w in leaves(m.qweight)]
            for w in held:  # the K-quants' integer scales serve the int8 tiles only
                if getattr(w, "ks", None) is not None:
                    w.ks = None
            self._arena = pack_blocks(mods[1:] + mods[:1] if mods and mods[0] is self.embed_tokens else mods)
            if mods:
                from ..kernels.matmul import warm

                for kind in sorted({w.kind for w in held if w.layout == "planar"}):
                    warm(kind)
                if self.activations.startswith("int8"):
                    from ..kernels import int8

                    tiled = {(w.fmt, w.group) for w in held if w.layout == "tiles"}
                    for kind, group in sorted(tiled):
                        int8.warm(kind, digits, group, outliers)
        self.kv_dtype = kv_cache_dtype(self.kv_choice, self)
        if self.xp is np and self.dtype == np.float32:
            a = self.layers[0].self_attn
            _decode_kernels().warm(a.head_dim, a.nh // a.nkv, self.kv_dtype)
            loop = self._decode_layers()
            if loop is not None:
                loop.warm()

    def int8_tiles(self) -> bool:
        """Whether some matmul of this rank runs on int8 tiles (int8 activations)."""
        from ..kernels.formats import leaves

        mods = [m for _, m in self.named_modules() if getattr(m, "qweight", None) is not None]
        return any(getattr(w, "layout", "") == "tiles" for m in mods for w in leaves(m.qweight))

    def arithmetic(self) -> str:
        """What the matmuls multiply, for the ``[mpitp]`` line: "int8 activations (avx2)"."""
        if self.weights == "float32" or self.activations == "float32":
            return "float32 activations"
        from ..kernels.cpu import isa
        from ..kernels.parallel import threads

        n = threads()
        return f"{self.activations} activations ({isa()}{f', {n} threads per rank' if n > 1 else ''})"

    @staticmethod
    def _tile(mods, digits: int, outliers: bool = False) -> None:
        """q4/q8 weights into the int8 kernels' tiles (a tied head's once, shared)."""
        from ..kernels.formats import Pieces
        from ..kernels.tiles import repack

        def tiled(w):
            return repack(w, digits, outliers) if w.kind in ("q4", "q8") else w

        done: dict[int, object] = {}
        for m in mods:
            w = m.qweight
            if id(w) not in done:
                done[id(w)] = Pieces([tiled(p) for p in w.parts]) if w.layout == "pieces" else tiled(w)
            m.qweight = done[id(w)]

    @staticmethod
    def _held(m) -> list:
        w = getattr(m, "qweight", None)
        return [w if w is not None else m.weight, getattr(m, "bias", None)]

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds, in the form it holds them (a tied head counted once)."""
        arrays = {id(a): a for _, m in self.named_modules() for a in self._held(m) if a is not None}
        return sum(a.nbytes for a in arrays.values())

    def streamed_bytes(self) -> int:
        """Bytes of weights one decode step reads on this rank: all but the embedding table
        (one row of it is looked up), unless the head shares it."""
        table = self.is_first and not (self.is_last and self.lm_head.tied)  # held, and only looked up
        return self.weight_bytes() - (self._held(self.embed_tokens)[0].nbytes if table else 0)

    def multiply_adds(self) -> int:
        """Multiply-adds of one decode step's matmuls on this rank, per token: one per
        weight of every linear layer and of the LM head (whatever format holds it)."""
        mods = [m for _, m in self.named_modules() if m is not self.embed_tokens and hasattr(m, "weights")]
        return sum(math.prod(self._held(m)[0].shape) for m in mods)

    def weight_formats(self) -> dict[str, int]:
        """How this rank holds its matmul weights: format -> bytes (float32, Q4_1, Q8_0, ...)."""
        out: dict[str, int] = {}
        seen = set()
        for _, m in self.named_modules():
            w = self._held(m)[0]
            if id(w) in seen or not hasattr(m, "weights"):
                continue
            seen.add(id(w))
            if getattr(m, "qweight", None) is None:
                out[str(w.dtype)] = out.get(str(w.dtype), 0) + w.nbytes
                continue
            from ..kernels.formats import leaves

            for p in leaves(w):  # a merged weight's pieces by their own formats
                out[p.source] = out.get(p.source, 0) + p.nbytes
        return out
