"""A LLaMA/Qwen2 decoder layer cut over tensor-parallel ranks, and what every layer of one
forward shares (:class:`Step`: RoPE tables and the attention mask)::

    x ─ RMSNorm ─ qkv_proj (column: heads/p) ─ RoPE ─ attention over own heads ─ o_proj (row) ─ all-reduce ─ + x
      ─ RMSNorm ─ gate_up_proj (column: inter/p) ─ SiLU(gate)*up ─ down_proj (row) ─ all-reduce ─ + h

On NumPy with float32 arrays the ops run as compiled kernels (:mod:`mpitp.kernels.decode`:
norms, RoPE, decode and prefill attention, SwiGLU); elsewhere as the array code of
:mod:`.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..tp import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    partition,
)
from .config import LlamaConfig
from .kv_cache import KVCache
from .ops import attention, rms_norm, swiglu
from .rope import Rotary


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
        if fast(x, self.weight):
            out = np.empty_like(x)
            decode_kernels().rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, out.reshape(-1, x.shape[-1]))
            return out
        return rms_norm(x, self.weight, self.eps)


def fast(*arrays) -> bool:
    """NumPy float32, contiguous: the compiled small ops of :mod:`mpitp.kernels.decode`."""
    return all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


_DECODE = None
# a prompt's attention goes this many query rows at a time, each block over the columns up
# to its last row (the causal square's upper part is never formed): on the 1B shape at 476
# tokens, 61 -> 47 ms a layer (docs/measurements.md, "Prefill on AMX tiles")
QUERY_BLOCK = 64
SHORT_ROWS = 64  # mean columns a query row sees, up to which prefill attention is one compiled call


def decode_kernels():
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
        self.one = T == 1 and fast(self.cos)  # a decode step: attention in one compiled call
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


class ProjectionNorm:
    """OLMoE's q or k norm: one RMSNorm over the whole projection, every head of it, of which
    this rank holds the heads' columns [start, start + size) and so that slice of the weight
    (the mean square over all of them: :meth:`Attention.norm_qk`)::

        q_norm.weight  [ h0 h1 │ h2 h3 ]   heads 0-1 on rank 0, 2-3 on rank 1: its slice each
    """

    def __init__(self, full: int, start: int, size: int, eps: float, dtype=np.float32, xp=np):
        self.full, self.start, self.eps, self.xp = full, start, eps, xp
        self.weight = xp.ones(size, dtype)

    def weight_loader(self, param, src, shard_id=None) -> None:
        if tuple(src.shape) != (self.full,):
            from ..tp import ShardingError

            raise ShardingError(f"{src.name}: checkpoint shape {tuple(src.shape)}, model expects ({self.full},)")
        part = np.asarray(src.read())[self.start : self.start + self.weight.size]
        self.weight[...] = self.xp.asarray(part, self.weight.dtype)


def norm_heads(qkv, nh: int, nkv: int, d: int, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
    """Qwen3's q and k norms, in place on ``qkv`` [rows, (nh + 2 nkv) d] NumPy float32: each
    of the nh query heads and nkv key heads of every row RMS-normed over its d values."""
    for norm, a, n in ((q_norm, 0, nh), (k_norm, nh * d, nkv)):
        heads = np.ascontiguousarray(qkv[:, a : a + n * d]).reshape(-1, d)
        qkv[:, a : a + n * d] = norm(heads).reshape(qkv.shape[0], n * d)


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
        # Qwen3: each head of q and of k RMS-normed over head_dim (weights whole on every rank)
        self.q_norm: RMSNorm | ProjectionNorm | None = None
        self.k_norm: RMSNorm | ProjectionNorm | None = None
        self.whole = cfg.qk_norm_whole
        if cfg.qk_norm and not self.whole:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, xp)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, xp)
        elif self.whole:  # OLMoE: over all heads, this rank's slice of each weight
            r = comm.rank if comm is not None else 0
            d, eps, (nq, q0, nk, k0) = cfg.head_dim, cfg.rms_norm_eps, split.rank(r)
            self.q_norm = ProjectionNorm(cfg.num_attention_heads * d, q0 * d, nq * d, eps, dtype, xp)
            self.k_norm = ProjectionNorm(cfg.num_key_value_heads * d, k0 * d, nk * d, eps, dtype, xp)
            # the mean squares' sums over the ranks; a KV head that several ranks hold (more
            # ranks than KV heads) counts once, on the first of them
            self.comm = comm if comm is not None and comm.size > 1 else None
            self.k_counts = r == 0 or split.kv_start[r - 1] != k0
            self.widths = xp.asarray(np.array([cfg.num_attention_heads, cfg.num_key_value_heads]) * d, dtype)

    def norm_qk(self, flat) -> None:
        """q's and k's norms, in place on ``flat`` [rows, (nh + 2 nkv) d] (the generic layers
        and the decode loop both call this: the same bits): Qwen3's per head
        (:func:`norm_heads`), or OLMoE's over the whole projection, each row's sums of
        squares (q's, k's) all-reduced over the ranks, [rows, 2] float32."""
        qn, kn = self.q_norm, self.k_norm
        if not self.whole:
            assert isinstance(qn, RMSNorm) and isinstance(kn, RMSNorm)
            norm_heads(flat, self.nh, self.nkv, self.head_dim, qn, kn)
            return
        assert isinstance(qn, ProjectionNorm) and isinstance(kn, ProjectionNorm)
        xp, nq = self.xp, self.nh * self.head_dim
        q, k = flat[:, :nq], flat[:, nq : nq + self.nkv * self.head_dim]
        ss = xp.zeros((flat.shape[0], 2), flat.dtype)
        ss[:, 0] = (q * q).sum(-1)
        if self.k_counts:
            ss[:, 1] = (k * k).sum(-1)
        if self.comm is not None:
            ss = self.comm.allreduce(ss)
        inv = 1 / xp.sqrt(ss / self.widths + qn.eps)
        q *= inv[:, :1]
        q *= qn.weight
        k *= inv[:, 1:]
        k *= kn.weight

    def _normed(self, qkv):
        """qkv [..., (nh + 2 nkv) d] with its q heads and k heads RMS-normed (Qwen3, OLMoE), a copy."""
        d, nh, nkv = self.head_dim, self.nh, self.nkv
        if fast(qkv) or self.whole:  # as the decode loop norms them (mpitp.models.decode_step): the same bits
            flat = self.xp.array(qkv).reshape(-1, qkv.shape[-1])
            self.norm_qk(flat)
            return flat.reshape(qkv.shape)
        assert isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm)
        h = self.xp.array(qkv).reshape(*qkv.shape[:-1], nh + 2 * nkv, d)
        h[..., :nh, :] = self.q_norm(h[..., :nh, :])
        h[..., nh : nh + nkv, :] = self.k_norm(h[..., nh : nh + nkv, :])
        return h.reshape(qkv.shape)

    def __call__(self, x, step: Step, cache: KVCache, layer: int):
        d = self.head_dim
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._normed(qkv)
        if step.one and fast(qkv) and decode_kernels().usable(cache.k[layer], cache.v[layer], self.nh // self.nkv):
            out = np.empty((B, self.nh * d), np.float32)
            decode_kernels().attend(
                qkv.reshape(B, -1), step.cos1, step.sin1, cache.k[layer], cache.v[layer], cache.valid,
                cache.length, self.nh, self.nkv, np.float32(self.scale), step.masked, out,
            )  # fmt: skip
            return self.o_proj(out.reshape(B, 1, -1))
        nq = self.nh + self.nkv  # q and k sit side by side: one rotation for both
        if fast(qkv, step.cos, step.sin):
            qk = np.empty((B, T, nq, d), np.float32)
            flat = (B * T, -1)
            decode_kernels().rotate(
                qkv.reshape(flat), nq, step.cos.reshape(B * T, d), step.sin.reshape(B * T, d), qk.reshape(flat)
            )
        else:
            qk = self.rotary.apply(qkv[..., : nq * d].reshape(B, T, nq, d), step.cos, step.sin)
        q, k, v = qk[:, :, : self.nh], qk[:, :, self.nh :], qkv[..., nq * d :]
        s = cache.length
        cache.k[layer][:, s : s + T] = k
        cache.v[layer][:, s : s + T] = v.reshape(B, T, self.nkv, d)
        S = s + T
        if fast(qk) and step.columns is not None:  # short rows: every row's own columns in one call
            kk, vv = (np.ascontiguousarray(c[layer][:, :S], np.float32) for c in (cache.k, cache.v))
            indptr, cols = step.columns
            out = np.empty((B, T, self.nh * d), np.float32)
            decode_kernels().attend_rows(
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
    """SwiGLU: gate_up_proj (column: ``sizes`` of ``inter`` per rank) then down_proj (row);
    ``reduce``: all-reduce down_proj's partial sums (a mixture-of-experts block sums its
    experts' first, :mod:`.moe`). ``comm`` None: whole on this rank."""

    def __init__(self, hidden: int, inter: int, comm, dtype, xp, sizes, *, bias: bool = False, reduce: bool = True):
        self.xp = xp
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter] * 2, bias=bias, comm=comm, sizes=sizes, dtype=dtype, xp=xp
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=bias, comm=comm, sizes=sizes, reduce_results=reduce, dtype=dtype, xp=xp
        )

    def __call__(self, x):
        gu = self.gate_up_proj(x)
        half = gu.shape[-1] // 2
        if fast(gu):
            act = np.empty((*gu.shape[:-1], half), np.float32)
            decode_kernels().swiglu(gu.reshape(-1, 2 * half), act.reshape(-1, half))
            return self.down_proj(act)
        return self.down_proj(swiglu(gu[..., :half], gu[..., half:]))


class DecoderLayer:
    """``mlp``: the layer's feed-forward block when it is not the dense MLP (a mixture of
    experts, :class:`mpitp.models.moe.SparseMoE`)."""

    def __init__(self, cfg: LlamaConfig, comm, rotary: Rotary, dtype, xp, plan: TPPlan, mlp=None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, xp)
        self.self_attn = Attention(cfg, comm, rotary, dtype, xp, plan.attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, xp)
        self.mlp = mlp or MLP(cfg.hidden_size, cfg.intermediate_size, comm, dtype, xp, plan.mlp, bias=cfg.mlp_bias)

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
