"""The decoder layers of one decode step (one new token per row), NumPy float32, in a
tight loop.

The generic forward (:class:`~mpitp.models.layers.DecoderLayer`) dispatches every op
through its module: ~40 Python calls, checks and reshapes per layer, 2-3 ms of a 15-20 ms
step of the default model. A decode step makes the same ten calls per layer every time,
so they are bound once (each linear layer's kernel to its weight,
:meth:`~mpitp.tp.linear.LinearBase.kernel`) and run as::

    h ─ rms_norm ─ qkv (+b) ─ attend: RoPE, K/V into the cache, softmax(q·kᵀ)·v ─ o ─ all-reduce (+b) ─ h +=
      ─ rms_norm ─ gate_up (+b) ─ swiglu ─ down ─ all-reduce (+b) ─ h +=

Qwen3's and OLMoE's q/k norms run after qkv (:meth:`~mpitp.models.layers.Attention.norm_qk`), and a
mixture-of-experts block is its own call (:class:`~mpitp.models.moe.SparseMoE`) in place
of the MLP's four steps. The same kernels on the same arrays in the same order as the generic path, so the
result is the same: bit for bit with block weights. Where a layer's four matmuls are int8
kernels that :mod:`mpitp.kernels.fused` can drive (IR quantizers, attention's IR core; with
threads, their tiles and attention's heads over numba's pool), each half of it between two
all-reduces is one compiled call instead.
"""

from __future__ import annotations

import numba
import numpy as np

from ..kernels import calls, fused, parallel
from ..kernels import decode as kernels


class DecodeLayers:
    """Built from a loaded model (:meth:`of`); ``loop(h, step, cache)`` runs every layer."""

    def __init__(self, model, layers: list[tuple], rows: int, plans: list | None = None, extra: list | None = None):
        c = model.config
        attn = model.layers[0].self_attn
        self.hidden, self.eps = c.hidden_size, float(c.rms_norm_eps)  # the type warm() compiles for
        self.nh, self.nkv, self.scale = attn.nh, attn.nkv, np.float32(attn.scale)
        self.q_width = attn.nh * attn.head_dim  # this rank's query heads side by side
        comm = model.comm
        self.allreduce = comm.allreduce if comm is not None and comm.size > 1 else None
        self.layers, self.rows = layers, rows
        # with threads per rank, attention's (row, KV head) pairs go over them as well
        self.threads = parallel.threads()
        self.group, self.kv_dtype = attn.nh // attn.nkv, model.kv_dtype  # the cache attend is bound to
        self.attend = kernels.bound_attend(attn.head_dim, self.group, self.threads > 1, self.kv_dtype)
        self.head_dim = attn.head_dim
        core = kernels.core(attn.head_dim, self.group, self.kv_dtype)
        # per layer: (qkv, o, gate_up, down) plans for mpitp.kernels.fused, or None
        self.plans: list = [None] * len(layers)
        if core is not None and plans is not None:
            self.core = calls.address(core)
            self.plans = plans
            # the fused attention half's heads record (mpitp.kernels.fused.attention_half)
            self.heads = (self.core, self.nh, self.nkv, self.head_dim, self.scale, self.threads > 1)
        self.none = np.zeros(1, np.float32)  # a bias that is not there
        self.extra: list = extra or [(None, None)] * len(layers)  # per layer: (q/k norms or None, a MoE block or None)

    @classmethod
    def of(cls, model) -> DecodeLayers | None:
        """None where the loop does not apply: CuPy, or activations other than float32. Layers
        with q/k norms or experts take the loop's own steps, never the fused halves."""
        if model.xp is not np or model.dtype != np.float32:
            return None
        layers, rows, plans, extra = [], [], [], []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            moe = mlp if hasattr(mlp, "experts") else None  # a mixture of experts: its own call
            # Qwen3's q/k norms, a MoE block: the loop's own steps, never the fused halves
            extra.append((a.norm_qk if a.q_norm is not None else None, moe))
            mods = (
                (a.qkv_proj, a.o_proj) if moe is not None else (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            )
            bound = [m.kernel() for m in mods]
            rows += [r for _, r in bound]
            p = [fused.plan(f) for f, _ in bound]
            plans.append(None if any(x is None for x in p) or extra[-1] != (None, None) else p)
            if moe is not None:  # no dense MLP: placeholders
                bound += [(None, 0), (None, 0)]
            (qkv, _), (o, _), (gate_up, _), (down, _) = bound
            layers.append(
                (
                    layer.input_layernorm.weight,
                    (qkv, a.qkv_proj.out_features, a.qkv_proj.bias),
                    (o, a.o_proj.bias),
                    layer.post_attention_layernorm.weight,
                    (gate_up, 0, None)
                    if moe is not None
                    else (gate_up, mlp.gate_up_proj.out_features, mlp.gate_up_proj.bias),
                    (down, None) if moe is not None else (down, mlp.down_proj.bias),
                )
            )
        return cls(model, layers, min(rows), plans, extra)

    def fits(self, batch: int, step, cache) -> bool:
        k = cache.k[0]
        return (
            step.one
            and batch <= self.rows
            and k.dtype == self.kv_dtype
            and kernels.usable(k, cache.v[0], self.group)
            and cache.valid.flags.c_contiguous
        )

    def loop(self, h, step, cache):
        """``h`` [B, 1, hidden] -> the last layer's output [B, 1, hidden]."""
        B = h.shape[0]
        h = np.array(h.reshape(B, self.hidden), np.float32)  # a copy: updated in place below
        xn = np.empty_like(h)
        s, eps, ar = cache.length, self.eps, self.allreduce
        if self.threads > 1:
            parallel.use(self.threads)
        r, pending = np.empty_like(h), None  # r: the last half's all-reduced output, its bias not yet added
        for i, (w1, (qkv, nqkv, bqkv), (o, bo), w2, (gate_up, ngu, bgu), (down, bd)) in enumerate(self.layers):
            plan = self.plans[i]
            if plan is not None:
                pending = self._fused(i, plan, h, r, pending, xn, step, cache)
                continue
            if pending is not None:
                self._add(h, r, *pending)
                pending = None
            kernels.rms_norm(h, w1, eps, xn)
            y = np.empty((B, nqkv), np.float32)
            qkv(xn, y)
            if bqkv is not None:
                y += bqkv
            norm_qk, moe = self.extra[i]
            if norm_qk is not None:
                norm_qk(y)
            att = np.empty((B, self.q_width), np.float32)
            self.attend(
                y, step.cos1, step.sin1, cache.k[i], cache.v[i], cache.valid, s, self.nh, self.nkv, self.scale,
                step.masked, att,
            )  # fmt: skip
            r = np.empty_like(h)
            o(att, r)
            self._finish_row_parallel(r, bo, ar)
            h += r
            kernels.rms_norm(h, w2, eps, xn)
            if moe is not None:  # routed, its experts run, their sum all-reduced (mpitp.models.moe)
                h += moe(xn)
                continue
            g = np.empty((B, ngu), np.float32)
            gate_up(xn, g)
            if bgu is not None:
                g += bgu
            act = np.empty((B, ngu // 2), np.float32)
            kernels.swiglu(g, act)
            down(act, r)
            self._finish_row_parallel(r, bd, ar)
            h += r
        if pending is not None:
            self._add(h, r, *pending)
        return h[:, None]

    def _fused(self, i: int, plan: list, h, r, pending, xn, step, cache):
        """Layer i as two compiled halves (:mod:`mpitp.kernels.fused`); ``pending``: the
        residual the previous layer left in ``r`` (its bias or None), added first. Returns
        this layer's pending residual."""
        w1, (_, nqkv, bqkv), (_, bo), w2, (_, ngu, bgu), (_, bd) = self.layers[i]
        pq, po, pgu, pd = plan
        B, none, ar = h.shape[0], self.none, self.allreduce
        add, rb = (0, none) if pending is None else ((1, none) if pending[0] is None else (2, pending[0]))
        y = np.empty((B, nqkv), np.float32)
        att = np.empty((B, self.q_width), np.float32)
        layer = (w1, self.eps, pq, none if bqkv is None else bqkv, bqkv is not None, po)
        now = (step.cos1, step.sin1, kernels.cache_pointers(cache.k[i], cache.v[i]), cache.valid, cache.length,
               step.masked)  # fmt: skip
        fused.attention_half(h, r, rb, add, layer, self.heads, now, xn, y, att, r)
        if ar is not None:
            ar(r, out=r)
        g = np.empty((B, ngu), np.float32)
        act = np.empty((B, ngu // 2), np.float32)
        fused.mlp_half(
            h, r, none if bo is None else bo, 1 if bo is None else 2, w2, self.eps, xn, pgu, g,
            none if bgu is None else bgu, bgu is not None, act, pd, r,
        )  # fmt: skip
        if ar is not None:
            ar(r, out=r)
        return (bd,)

    def warm(self) -> None:
        """Compile (or load from numba's cache) the fused halves for the types a decode
        step passes them, now (at load) rather than in the first step: ~1.7 s on a fresh
        install. Only types: nothing runs."""
        i = next((i for i, p in enumerate(self.plans) if p is not None), None)
        if i is None:
            return
        w1, (_, _, bqkv), (_, bo), w2, (_, _, bgu), _ = self.layers[i]
        pq, po, pgu, pd = self.plans[i]
        x, d = np.zeros((1, 1), np.float32), np.zeros((1, self.head_dim), np.float32)
        rb = self.none if bo is None else bo
        layer = (w1, self.eps, pq, self.none if bqkv is None else bqkv, False, po)
        now = (d, d, (0, 0, 0, 0, 0), np.zeros((1, 1), bool), 0, False)
        attn = (x, x, rb, 0, layer, self.heads, now, x, x, x, x)
        mlp = (x, x, rb, 0, w2, self.eps, x, pgu, x, self.none if bgu is None else bgu, False, x, pd, x)
        for f, args in ((fused.attention_half, attn), (fused.mlp_half, mlp)):
            f.compile(tuple(numba.typeof(a) for a in args))

    @staticmethod
    def _add(h, r, bias) -> None:
        """A row-parallel layer's all-reduced ``r`` into the residual, its bias added once."""
        if bias is not None:
            r += bias
        h += r

    @staticmethod
    def _finish_row_parallel(r, bias, allreduce) -> None:
        """A row-parallel layer's partial sums: all-reduced, then its bias added once."""
        if allreduce is not None:
            allreduce(r, out=r)
        if bias is not None:
            r += bias
