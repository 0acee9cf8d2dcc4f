"""The decoder layers of one decode step (one new token per row), NumPy float32, in a
tight loop.

The generic forward (:class:`~mpitp.models.llama.DecoderLayer`) dispatches every op
through its module: ~40 Python calls, checks and reshapes per layer, 2-3 ms of a 15-20 ms
step of the default model. A decode step makes the same ten calls per layer every time,
so they are bound once (each linear layer's kernel to its weight,
:meth:`~mpitp.tp.linear.LinearBase.kernel`) and run as::

    h ─ rms_norm ─ qkv (+b) ─ attend: RoPE, K/V into the cache, softmax(q·kᵀ)·v ─ o ─ all-reduce (+b) ─ h +=
      ─ rms_norm ─ gate_up (+b) ─ swiglu ─ down ─ all-reduce (+b) ─ h +=

The same kernels on the same arrays in the same order as the generic path, so the
result is the same: bit for bit with block weights.
"""

from __future__ import annotations

import numpy as np

from ..kernels import decode as kernels
from ..kernels import parallel


class DecodeLayers:
    """Built from a loaded model (:meth:`of`); ``loop(h, step, cache)`` runs every layer."""

    def __init__(self, model, layers: list[tuple], rows: int):
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

    @classmethod
    def of(cls, model) -> DecodeLayers | None:
        """None where the loop does not apply: CuPy, or activations other than float32."""
        if model.xp is not np or model.dtype != np.float32:
            return None
        layers, rows = [], []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            bound = [m.kernel() for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            rows += [r for _, r in bound]
            (qkv, _), (o, _), (gate_up, _), (down, _) = bound
            layers.append(
                (
                    layer.input_layernorm.weight,
                    (qkv, a.qkv_proj.out_features, a.qkv_proj.bias),
                    (o, a.o_proj.bias),
                    layer.post_attention_layernorm.weight,
                    (gate_up, mlp.gate_up_proj.out_features, mlp.gate_up_proj.bias),
                    (down, mlp.down_proj.bias),
                )
            )
        return cls(model, layers, min(rows))

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
        for i, (w1, (qkv, nqkv, bqkv), (o, bo), w2, (gate_up, ngu, bgu), (down, bd)) in enumerate(self.layers):
            kernels.rms_norm(h, w1, eps, xn)
            y = np.empty((B, nqkv), np.float32)
            qkv(xn, y)
            if bqkv is not None:
                y += bqkv
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
            g = np.empty((B, ngu), np.float32)
            gate_up(xn, g)
            if bgu is not None:
                g += bgu
            act = np.empty((B, ngu // 2), np.float32)
            kernels.swiglu(g, act)
            down(act, r)
            self._finish_row_parallel(r, bd, ar)
            h += r
        return h[:, None]

    @staticmethod
    def _finish_row_parallel(r, bias, allreduce) -> None:
        """A row-parallel layer's partial sums: all-reduced, then its bias added once."""
        if allreduce is not None:
            allreduce(r, out=r)
        if bias is not None:
            r += bias
