"""Tensor-parallel LLaMA (and Qwen2, Qwen3 dense) inference in NumPy / CuPy.

The Megatron cut, per decoder layer on ``p`` ranks::

    x ─ RMSNorm ─ qkv_proj (column: heads/p) ─ RoPE ─ attention over own heads ─ o_proj (row) ─ all-reduce ─ + x
      ─ RMSNorm ─ gate_up_proj (column: inter/p) ─ SiLU(gate)*up ─ down_proj (row) ─ all-reduce ─ + h

Exactly two all-reduces per layer, plus one for the vocab-parallel embedding and an
all-gather of the logits in the head. Every rank ends with the full logits.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..kernels.cpu import Activations
from ..tp import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from ..tp.arena import pack, pack_blocks
from ..tp.dp_head import DataParallelHead
from .config import LlamaConfig
from .kv_cache import KVCache, kv_cache_dtype
from .layers import DecoderLayer, RMSNorm, Step, TPPlan, decode_kernels
from .moe import MoEPlan, SparseMoE, choose
from .rope import Rotary

if TYPE_CHECKING:
    from .decode_step import DecodeLayers
    from .loader import LoadOptions


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
        moe: str = "auto",
        dp_attention: bool = False,
    ):
        """``stage``: a pipeline stage (:class:`mpitp.models.pipeline.Stage`) — this model
        holds only its layers (and the embedding on the first, the norm and head on the
        last) and passes hidden states to the next stage; ``comm`` is then the stage's
        tensor-parallel group. ``moe``: how a mixture of experts' experts are cut, ep or tp
        (:mod:`.moe`); auto = what :func:`.moe.choose` predicts faster. ``dp_attention``: every
        rank holds all but the experts whole and runs its own sequences; the experts are cut
        ep over ``comm`` and reached by all-to-all (:meth:`.moe.SparseMoE._dispatched`); every
        rank must then run each forward with the others (an idle rank an empty batch)."""
        if dp_attention:
            if not config.num_experts or stage is not None or moe == "tp":
                from ..tp import ShardingError

                raise ShardingError(
                    "--dp-attention needs a mixture-of-experts model, its experts cut --moe ep, and no --pp"
                )
            self.expert_comm, comm, moe = comm, None, "ep"  # attention, dense layers, the head: whole here
        else:
            self.expert_comm = comm
        self.dp_attention = dp_attention
        self.config, self.comm, self.xp, self.dtype = config, comm, xp, np.dtype(dtype)
        self.stage = stage
        self.first_layer: int
        self.first_layer, end = (0, config.num_hidden_layers) if stage is None else stage.layers
        self.is_first, self.is_last = self.first_layer == 0, end == config.num_hidden_layers
        self.weights = weights if xp is np else "float32"  # how matmul weights are kept (loader.WEIGHTS)
        self.activations = Activations("float32")  # of block weights' matmuls (the loader sets it)
        self.kv_dtype = np.dtype(dtype)  # of the KV cache: kv_cache_dtype(kv_choice) once loaded
        self.kv_choice: str | None = None  # the loader's kv_cache_dtype
        c = config
        self.rotary = Rotary(
            c.head_dim, c.rope_theta, c.rope_scaling, min(c.max_position_embeddings, 4096), xp=xp, dtype=np.float32
        )
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, comm=comm, dtype=self.dtype, xp=xp)
        # the MLP cut in whole blocks of block weights (32; 256 for K-quants' super-blocks)
        self.plan = TPPlan.of(c, comm.size if comm is not None else 1, 1 if self.weights == "float32" else mlp_block)
        ecomm = self.expert_comm
        p = ecomm.size if ecomm is not None else 1
        self.moe_plan: MoEPlan | None = None
        if c.num_experts:
            block = 1 if self.weights == "float32" else mlp_block
            self.moe_plan = MoEPlan.of(c, p, choose(c, p, block) if moe == "auto" else moe, block)

        def moe_block(i: int):
            if self.moe_plan is None or not c.sparse(i):
                return None
            return SparseMoE(c, ecomm, self.dtype, xp, self.moe_plan, dispatch=dp_attention)

        self.layers = [
            DecoderLayer(c, comm, self.rotary, self.dtype, xp, self.plan, mlp=moe_block(i))
            for i in range(self.first_layer, end)
        ]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, xp)
        self.lm_head: ParallelLMHead
        if dp_attention:  # the vocabulary cut over the ranks, their rows all-gathered (a tied table: whole)
            cut = None if c.tie_word_embeddings else self.expert_comm
            self.lm_head = DataParallelHead(c.vocab_size, c.hidden_size, comm=cut, dtype=self.dtype, xp=xp)
        else:
            self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size, comm=comm, dtype=self.dtype, xp=xp)
        if c.tie_word_embeddings:
            self.lm_head.tie(self.embed_tokens)
        for _, m in self.named_modules():
            if hasattr(m, "weights") and not getattr(m, "keep_float", False):  # routers stay float32
                m.weights = self.weights
        if xp is np and self.weights == "float32":  # one stream of the matrices decoding reads, in reading order: the
            # layers', then the head's; the embedding last (one row of it is read per token;
            # packed once when the head shares it)
            mats = [m for _, m in self.named_modules() if hasattr(m, "_wt")]
            self._arena = pack(mats[1:] + mats[:1] if mats and mats[0] is self.embed_tokens else mats)
        self.last_stats: dict = {}
        self._decode: DecodeLayers | None = None
        self._decode_built = False
        self._ready: set[int] = set()  # modules the loader made ready as their last tensor came

    @classmethod
    def from_pretrained(cls, path, comm=None, options: LoadOptions | None = None, **overrides) -> LlamaForCausalLM:
        """Load ``path`` cut over ``comm``'s ranks as ``options`` says (:class:`.loader.LoadOptions`),
        with any of its fields given here by name instead (``weights="float32"``)."""
        from .loader import LoadOptions, load_pretrained

        return load_pretrained(cls, path, comm, replace(options or LoadOptions(), **overrides))

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

    def forward(
        self, ids, positions, cache: KVCache, last_only: bool = False, keep=None, greedy: bool = False, hidden=False
    ):
        """Logits [B, T, vocab] for ``ids`` [B, T] appended to ``cache`` at ``cache.length``
        (``last_only``: just the last position's, [B, 1, vocab], as decoding needs; ``keep``:
        the positions listed, [B, len(keep), vocab]; ``greedy``: instead of logits, the last
        position's most likely token [B] on the host, the head's shards never gathered:
        :meth:`~mpitp.tp.embedding.ParallelLMHead.greedy`; ``hidden``: the normed hidden states
        the head would take, [B, T', hidden], as ``--dp-attention``'s serving hands them to
        :meth:`~mpitp.tp.dp_head.DataParallelHead.pick`). None on a stage before the last."""
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
        if greedy:
            return self.lm_head.greedy(self.norm(h[:, -1:]))[:, 0]  # as last_only computes them
        if last_only:
            h = h[:, -1:]
        elif keep is not None:
            h = h[:, keep]
        return self.norm(h) if hidden else self.lm_head(self.norm(h))

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
            if L.self_attn.q_norm is not None:  # Qwen3
                yield p + "self_attn.q_norm", L.self_attn.q_norm
                yield p + "self_attn.k_norm", L.self_attn.k_norm
            yield p + "self_attn.o_proj", L.self_attn.o_proj
            yield p + "post_attention_layernorm", L.post_attention_layernorm
            if isinstance(L.mlp, SparseMoE):
                yield from L.mlp.named_modules(p + "mlp.")
                continue
            yield p + "mlp.gate_up_proj", L.mlp.gate_up_proj
            yield p + "mlp.down_proj", L.mlp.down_proj
        if self.is_last:
            yield "model.norm", self.norm
            yield "lm_head", self.lm_head

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every expert tensor of this model's layers (held on this rank or another) -> its
        shape, for the loader's check on every rank (:meth:`.moe.SparseMoE.all_expert_shapes`)."""
        out: dict[str, tuple[int, ...]] = {}
        for i, L in enumerate(self.layers, start=self.first_layer):
            if isinstance(L.mlp, SparseMoE):
                out |= L.mlp.all_expert_shapes(f"model.layers.{i}.mlp.")
        return out

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

    def idle_step(self) -> None:
        """Data-parallel attention: this rank's part in a forward the other ranks run while it
        has no rows (every MoE layer's all-to-all, in order, with none of its own)."""
        empty = self.xp.zeros((0, self.config.hidden_size), self.dtype)
        for L in self.layers:
            if isinstance(L.mlp, SparseMoE):
                L.mlp(empty)

    def module_loaded(self, m) -> None:
        """The loader's call once module ``m`` has all its tensors: its block pieces joined
        and, for int8 activations, tiled now (:meth:`finish_load` does the rest, and skips
        what is done here)."""
        if hasattr(m, "finish"):
            m.finish()
        self._ready.add(id(m))
        if self.weights != "float32" and getattr(m, "qweight", None) is not None:
            from ..kernels import prepare

            prepare.tile([m], self.activations)

    def finish_load(self) -> None:
        """After the loader: block weights joined per module (:meth:`LinearBase.finish`), but
        for the modules :meth:`module_loaded` made ready already."""
        for _, m in self.named_modules():
            if hasattr(m, "finish") and id(m) not in self._ready:
                m.finish()
        self._ready = set()
        self._decode_built = False
        why = {m.fallback for _, m in self.named_modules() if getattr(m, "fallback", "")}
        if why:
            from ..log import get_logger

            get_logger("models").warning(f"some weights kept as float32 on this rank: {'; '.join(sorted(why))}")
        if self.weights != "float32":  # block weights in reading order: the layers', then the head's
            from ..kernels import prepare

            mods = [m for _, m in self.named_modules() if getattr(m, "qweight", None) is not None]
            prepare.tile(mods, self.activations)
            self._arena = pack_blocks(mods[1:] + mods[:1] if mods and mods[0] is self.embed_tokens else mods)
            prepare.warm(mods, self.activations)
        self.kv_dtype = kv_cache_dtype(self.kv_choice, self)
        if self.xp is np and self.dtype == np.float32:
            a = self.layers[0].self_attn
            decode_kernels().warm(a.head_dim, a.nh // a.nkv, self.kv_dtype)
            loop = self._decode_layers()
            if loop is not None:
                loop.warm()

    def int8_tiles(self) -> bool:
        """Whether some matmul of this rank runs on int8 tiles (int8 activations)."""
        from ..kernels.weights.formats import leaves

        mods = [m for _, m in self.named_modules() if getattr(m, "qweight", None) is not None]
        return any(getattr(w, "layout", "") == "tiles" for m in mods for w in leaves(m.qweight))

    def arithmetic(self) -> str:
        """What the matmuls multiply, for the ``[mpitp]`` line: "int8 activations (avx2)"."""
        if self.weights == "float32" or not self.activations.int8:
            return "float32 activations"
        from ..kernels.cpu import isa
        from ..kernels.parallel import threads

        n = threads()
        return f"{self.activations} activations ({isa()}{f', {n} threads per rank' if n > 1 else ''})"

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
        unread = self._unread(lambda w: w.nbytes)
        return self.weight_bytes() - (self._held(self.embed_tokens)[0].nbytes if table else 0) - unread

    def multiply_adds(self) -> int:
        """Multiply-adds of one decode step's matmuls on this rank, per token: one per
        weight of every linear layer and of the LM head (whatever format holds it)."""
        mods = [m for _, m in self.named_modules() if m is not self.embed_tokens and hasattr(m, "weights")]
        return sum(math.prod(self._held(m)[0].shape) for m in mods) - self._unread(lambda w: math.prod(w.shape))

    def _unread(self, size) -> int:
        """Of the experts this rank holds, what a token does not reach on average: all but k
        of every E (uniform routing), measured by ``size`` of each expert weight."""
        c = self.config
        if not c.num_experts:
            return 0
        held = sum(size(self._held(m)[0]) for name, m in self.named_modules() if ".experts." in name)
        return round(held * (1 - c.num_experts_per_tok / c.num_experts))

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
            from ..kernels.weights.formats import leaves

            for p in leaves(w):  # a merged weight's pieces by their own formats
                out[p.source] = out.get(p.source, 0) + p.nbytes
        return out
