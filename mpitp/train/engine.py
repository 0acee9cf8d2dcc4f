"""One micro-batch through the units: forward, loss, backward, gradient reductions.

Units in order ``[embed, layer 0 … layer L-1, head]``. The schedule, with fsdp's gathers::

    forward   embed  layer0 … layerL-1  head ┐  (head's forward and backward are adjacent:
    backward         layerL-1 … layer0  head ┘   it stays gathered, as torch FSDP's root)
              embed  (its backward needs no weights: no gather)

Each step prefetches the next unit that needs gathering; a unit's gradients are reduced
(nonblocking) as soon as backward leaves it.
"""

from __future__ import annotations

from ..models.config import LlamaConfig
from ..models.ops import rms_norm
from ..models.rope import Rotary
from . import block
from .grads import cross_entropy, embedding_backward, linear_backward, rms_norm_backward
from .sharding import Sharding


class Engine:
    def __init__(self, cfg: LlamaConfig, sharding: Sharding, recompute: bool = False):
        self.cfg, self.S, self.recompute = cfg, sharding, recompute
        self.L = cfg.num_hidden_layers
        self.head = self.L + 1
        self.tied = cfg.tie_word_embeddings
        self.rotary = Rotary(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, dtype=sharding.dtype
        )
        self.layouts = [u.layout for u in sharding.units]

    def _views(self, i: int, flat) -> dict:
        return self.layouts[i].views(flat)

    def _forward(self, ids, keep: bool):
        """Hidden states before the head, and what backward needs per layer."""
        S, L = self.S, self.L
        ctx = block.Ctx.build(self.cfg, self.rotary, *ids.shape)
        x = self._views(0, S.params(0, prefetch=1))["embed"][ids]
        S.release(0)
        saved = []
        for i in range(1, L + 1):
            x_in = x
            x, s = block.forward(self._views(i, S.params(i, prefetch=i + 1)), x, ctx, keep=keep and not self.recompute)
            saved.append(x_in if self.recompute else s)
            S.release(i)
        return x, saved, ctx

    def _head(self, backward: bool):
        ph = self._views(self.head, self.S.params(self.head, prefetch=self.L if backward and self.L else None))
        w = self._views(0, self.S.params(0))["embed"] if self.tied else ph["head"]
        return ph, w

    def micro_step(self, ids, targets, scale: float, last_micro: bool = True) -> float:
        """Forward and backward of one micro-batch; gradients of ``scale`` · Σ token losses
        added to the units' buffers and their reductions started. Returns Σ token losses."""
        S, L, cfg = self.S, self.L, self.cfg
        x, saved, ctx = self._forward(ids, keep=True)
        ph, w = self._head(backward=True)
        hn = rms_norm(x, ph["norm"], cfg.rms_norm_eps)
        loss, dlogits = cross_entropy(hn @ w.T, targets)
        dlogits *= scale
        gh = self._views(self.head, S.grad(self.head))
        gw = self._views(0, S.grad(0))["embed"] if self.tied else gh["head"]
        dx = rms_norm_backward(linear_backward(dlogits, hn, w, gw), x, ph["norm"], cfg.rms_norm_eps, gh["norm"])
        S.release(self.head, force=True)
        S.reduce(self.head, last_micro)
        for i in range(L, 0, -1):
            p = self._views(i, S.params(i, prefetch=i - 1 if i > 1 else None))
            s = block.forward(p, saved[i - 1], ctx)[1] if self.recompute else saved[i - 1]
            saved[i - 1] = None
            dx = block.backward(p, self._views(i, S.grad(i)), s, dx, ctx)
            S.release(i)
            S.reduce(i, last_micro)
        embedding_backward(dx, ids, self._views(0, S.grad(0))["embed"])
        S.release(0, force=True)
        S.reduce(0, last_micro)
        S.finish()
        return loss

    def loss(self, ids, targets) -> float:
        """Σ token losses, forward only (evaluation)."""
        x, _, _ = self._forward(ids, keep=False)
        ph, w = self._head(backward=False)
        loss = cross_entropy(rms_norm(x, ph["norm"], self.cfg.rms_norm_eps) @ w.T, targets)[0]
        self.S.release(self.head, force=True)
        self.S.release(0, force=True)
        return loss
