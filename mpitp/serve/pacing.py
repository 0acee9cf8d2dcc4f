"""How many waiting prompts one prefill forward takes: rank 0 decides from costs it
measured, every rank follows (the number travels in the iteration's control message).

A prefill forward of n prompt tokens costs about ``a + b·n``: a is the forward's fixed
cost (its ~200 kernel calls and collectives), b a token's multiply-adds; while requests
run, each iteration also makes their decode step, s. Packing every waiting prompt into
one forward makes each wait for all of them. Forwards of a few prompts each give the
first their tokens sooner, at a + s per extra forward. For W waiting tokens in k equal
forwards the mean time to the first token is ``(a + s + b·W/k)·(k + 1)/2``, least at::

    k = sqrt(W / P),   P = (a + s) / b    (the fixed cost per forward, in tokens)

so each forward takes whole prompts, in arrival order, up to about W/k tokens (at least
one; the token budget still cuts a long prompt into chunks). On a GPU P is thousands of
tokens and k is 1: vLLM's packing. On a CPU prefill is bound by its multiply-adds and P
is small: the default model, TP=2 on 2 cores, a ≈ 17 ms and b ≈ 1 ms, so 8 prompts of
~22 tokens that arrive together go in 2-3 forwards (docs/measurements.md: 8 clients'
median time to first token 250 -> ~200 ms); on the 1B shape b is ~6x larger and each
prompt goes alone.

a and b are measured once at start (two forward sizes, the best of two each); s is a
running average of rank 0's decode steps.
"""

from __future__ import annotations

import math
import time

import numpy as np

SIZES = (16, 128)  # prompt tokens of the two timed forwards
REPS = 2


class Pacing:
    """Rank 0's cost model (``None`` costs: pacing off, a forward takes all that fits)."""

    def __init__(self, a: float | None = None, b: float | None = None):
        self.a, self.b = a, b
        self.step = 0.0  # seconds of a decode step, running average

    @property
    def on(self) -> bool:
        return self.a is not None and self.b is not None and self.b > 0

    def stepped(self, seconds: float) -> None:
        self.step = seconds if not self.step else 0.8 * self.step + 0.2 * seconds

    def pace(self, running: bool) -> float | None:
        """P: a forward's fixed cost (and the decode step it delays, while rows run) in
        tokens; None while off."""
        if not self.on:
            return None
        assert self.a is not None and self.b is not None
        return (self.a + (self.step if running else 0.0)) / self.b

    def describe(self) -> str:
        if not self.on:
            return "off"
        assert self.a is not None and self.b is not None
        return (
            f"a forward costs {self.a * 1e3:.1f} ms + {self.b * 1e3:.2f} ms a token "
            f"(its fixed cost ~{self.a / self.b:.0f} tokens' worth)"
        )


def take(left: list[int], pace: float | None) -> int | None:
    """How many of the waiting prompts (``left``: each one's tokens still to prefill, in
    arrival order) the next forward starts, for a fixed cost of ``pace`` tokens a forward;
    None: all that fit the budget. The same on every rank for the same arguments."""
    if pace is None or len(left) < 2:
        return None
    W = sum(left)
    k = max(1, round(math.sqrt(W / max(pace, 1e-9))))
    if k == 1:
        return None
    target, taken, n = W / k, 0, 0
    for t in left:  # whole prompts while the next brings the forward closer to W/k
        if n and abs(taken + t - target) >= abs(taken - target):
            break
        taken, n = taken + t, n + 1
    return n


def calibrate(model, rank0: bool, comm=None, max_len: int = SIZES[1]) -> Pacing:
    """Every rank: the timed forwards (in lockstep, at most ``max_len`` tokens); rank 0's
    :class:`Pacing` from them (the others get one too, unused). Off where the fit makes no
    sense (b ≤ 0, a < 0) or the context is too short to time two sizes."""
    sizes = (min(SIZES[0], max_len // 8), min(SIZES[1], max_len))
    if sizes[0] < 1:
        return Pacing()
    times = {n: math.inf for n in sizes}
    vocab = model.config.vocab_size
    for _ in range(REPS):
        for n in sizes:
            cache = model.new_cache(1, n)
            cache.valid[:] = True
            ids = (np.arange(n, dtype=np.int64) * 7919 % vocab)[None]
            if comm is not None:
                comm.barrier()
            t = time.perf_counter()
            model.forward(model.xp.asarray(ids), model.xp.asarray(np.arange(n)[None]), cache, last_only=True)
            times[n] = min(times[n], time.perf_counter() - t)
    (n0, n1), (t0, t1) = sizes, (times[sizes[0]], times[sizes[1]])
    b = (t1 - t0) / (n1 - n0)
    a = t0 - b * n0
    if not rank0 or b <= 0 or a < 0:
        return Pacing()
    return Pacing(a, b)
