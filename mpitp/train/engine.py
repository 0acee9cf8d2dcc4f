"""One micro-batch through the units: forward, loss, backward, gradient reductions.

Units in order ``[embed, layer 0 … layer L-1, head]``. The schedule, with fsdp's gathers::

    forward   embed  layer0 … layerL-1  head ┐  (head's forward and backward are adjacent:
    backward         layerL-1 … layer0  head ┘   it stays gathered, as torch FSDP's root)
              embed  (its backward needs no weights: no gather)

Each step prefetches the next unit that needs gathering; a unit's gradients are reduced
(nonblocking) as soon as backward leaves it.

With tensor parallelism (a :class:`~.tp_layout.TPCut` and its ``tp`` group) the units
are this rank's slices, ``Sharding`` works over the dp group, the embedding and the head
are vocabulary-parallel (the loss never gathers the logits) and each layer all-reduces
over ``tp`` as :mod:`.block` says.
"""

from __future__ import annotations

from ..models.config import LlamaConfig
from ..models.ops import rms_norm
from ..models.rope import Rotary
from . import block
from .backward import cross_entropy, embedding_backward, rms_norm_backward
from .sharding import Sharding
from .tensor_parallel import column_backward, vocab_cross_entropy, vocab_embedding_backward, vocab_embedding_forward
from .tp_layout import TPCut


class TrainEngine:
    def __init__(
        self, cfg: LlamaConfig, sharding: Sharding, recompute: bool = False, cut: TPCut | None = None, tp=None
    ):
        self.cfg, self.S, self.recompute = cfg, sharding, recompute
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.v0 = cut.v0 if cut is not None else 0
        self.layer_cfg = cut.local_config if cut is not None and self.tp is not None else cfg
        self.L = cfg.num_hidden_layers
        self.head = self.L + 1
        self.tied = cfg.tie_word_embeddings
        self.rotary = Rotary(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, dtype=sharding.dtype
        )
        self.layouts = [u.layout for u in sharding.units]
        # the tp all-reduces of activations carry --param-dtype (tensor_parallel.sum_over)
        self.wire = sharding.param_dtype if sharding.mixed else None

    def _views(self, i: int, flat) -> dict:
        return self.layouts[i].views(flat)

    def _forward(self, ids, keep: bool):
        """Hidden states before the head, and what backward needs per layer."""
        S, L = self.S, self.L
        B, T = ids.shape
        ctx = block.Ctx.build(self.layer_cfg, self.rotary, B, T, tp=self.tp, algorithm=S.algorithm, wire=self.wire)
        w = self._views(0, S.params(0, prefetch=1))["embed"]
        x = w[ids] if self.tp is None else vocab_embedding_forward(ids, w, self.v0, self.tp, S.algorithm, self.wire)
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

    def _cross_entropy(self, logits, targets):
        if self.tp is None:
            return cross_entropy(logits, targets)
        return vocab_cross_entropy(logits, targets, self.v0, self.tp, self.S.algorithm)

    def micro_step(self, ids, targets, scale: float, last_micro: bool = True) -> float:
        """Forward and backward of one micro-batch; gradients of ``scale`` · Σ token losses
        added to the units' buffers and their reductions started. Returns Σ token losses."""
        S, L, cfg = self.S, self.L, self.cfg
        x, saved, ctx = self._forward(ids, keep=True)
        ph, w = self._head(backward=True)
        hn = rms_norm(x, ph["norm"], cfg.rms_norm_eps)
        loss, dlogits = self._cross_entropy(hn @ w.T, targets)
        dlogits *= scale
        gh = self._views(self.head, S.grad(self.head))
        gw = self._views(0, S.grad(0))["embed"] if self.tied else gh["head"]
        dhn = column_backward(dlogits, hn, w, gw, None, self.tp, S.algorithm, self.wire)
        dx = rms_norm_backward(dhn, x, ph["norm"], cfg.rms_norm_eps, gh["norm"])
        S.release(self.head, force=True)
        S.reduce(self.head, last_micro)
        for i in range(L, 0, -1):
            p = self._views(i, S.params(i, prefetch=i - 1 if i > 1 else None))
            s = block.forward(p, saved[i - 1], ctx)[1] if self.recompute else saved[i - 1]
            saved[i - 1] = None
            dx = block.backward(p, self._views(i, S.grad(i)), s, dx, ctx)
            S.release(i)
            S.reduce(i, last_micro)
        gemb = self._views(0, S.grad(0))["embed"]
        if self.tp is None:
            embedding_backward(dx, ids, gemb)
        else:
            vocab_embedding_backward(dx, ids, gemb, self.v0)
        S.release(0, force=True)
        S.reduce(0, last_micro)
        S.finish()
        return loss

    def loss(self, ids, targets) -> float:
        """Σ token losses, forward only (evaluation)."""
        x, _, _ = self._forward(ids, keep=False)
        ph, w = self._head(backward=False)
        loss = self._cross_entropy(rms_norm(x, ph["norm"], self.cfg.rms_norm_eps) @ w.T, targets)[0]
        self.S.release(self.head, force=True)
        self.S.release(0, force=True)
        return loss
