"""AdamW as ``torch.optim.AdamW`` defines it (decoupled weight decay), over the slice of
each unit this rank optimizes; global-norm clipping as ``torch.nn.utils.clip_grad_norm_``;
linear warmup then constant or cosine decay (nanoGPT's schedule)."""

from __future__ import annotations

import math

import numpy as np


class AdamW:
    """Moments in float32 at least (float64 parameters keep float64 moments)."""

    def __init__(
        self,
        shapes: list[int],
        decay_masks: list[np.ndarray],
        dtype,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        mdtype = np.promote_types(dtype, np.float32)
        self.m = [np.zeros(n, mdtype) for n in shapes]
        self.v = [np.zeros(n, mdtype) for n in shapes]
        self.decay = [_ranges(m) for m in decay_masks]  # contiguous runs: one slice each
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.t = 0

    def step(self, params: list, grads: list, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, math.sqrt(1 - b2**self.t)
        for p, g, m, v, runs in zip(params, grads, self.m, self.v, self.decay):
            if self.weight_decay:
                for a, b in runs:
                    p[a:b] *= 1 - lr * self.weight_decay
            m += (g - m) * (1 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
            v *= b2
            v += (1 - b2) * g * g
            denom = np.sqrt(v) / c2
            denom += self.eps
            p -= ((lr / c1) * m / denom).astype(p.dtype, copy=False)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.m + self.v)

    def state(self) -> dict:
        return {"t": self.t}


def _ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch's clip_grad_norm_: scale = max_norm / (norm + 1e-6), at most 1."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def learning_rate(
    step: int, lr: float, steps: int, warmup: int = 0, schedule: str = "constant", min_lr: float | None = None
) -> float:
    """Learning rate at 0-based ``step``: linear warmup over ``warmup`` steps, then constant
    or a cosine down to ``min_lr`` (lr/10 by default) at the last step."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    floor = lr / 10 if min_lr is None else min_lr
    progress = (step - warmup) / max(1, steps - warmup - 1)
    return floor + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (lr - floor)
