"""How many waiting prompts one prefill forward takes: rank 0 decides from costs it
measured, every rank follows (the number travels in the iteration's control message).

A prefill forward of n prompt tokens costs about ``a + b·n``: a is the forward's fixed
cost (its ~200 kernel calls and collectives), b a token's multiply-adds; while requests
run, each iteration also makes their decode step, s. Packing every waiting prompt into
one forward makes each wait for all of them. Forwards of a few prompts each give the
first their tokens sooner, at a + s per extra forward. In tokens, with P = (a + s)/b, a
grouping of the waiting prompts (whole ones, in arrival order) into forwards of W₁, W₂, …
tokens gives the prompts of forward j their first token after Σ_{i≤j} (P + W_i): rank 0
picks the grouping with the least mean (:func:`take`, a small dynamic program), and the
next forward takes its first group. The best groups shrink from first to last, by about P
tokens each (a forward delays every prompt after it, so the early ones should amortize P
over more): 7 prompts of 22 tokens with P = 40 go as 4, 2, 1.

On a GPU P is thousands of tokens and one forward takes all (vLLM's packing). On a CPU
prefill is bound by its multiply-adds and P is small: the default model, TP=2 on 2 cores,
a ≈ 20 ms and b ≈ 0.8 ms, P ≈ 40 with a decode step (docs/measurements.md: 8 clients'
median time to first token 245 -> ~180 ms); on the 1B shape b is ~6x larger and each
prompt goes nearly alone. One prompt is never split for it (the token budget still cuts a
long prompt into chunks).

a and b are measured at start through a small engine (one short prompt, and four longer
ones packed, the best of two each): a forward of the bare model costs less than the
engine's (its packing, the prompts' keys and values moved in and out), and the intercept
of a bare fit was half the served one. While serving, a follows the served forwards
(their time less b per token: HTTP threads and all), and s is a running average of rank
0's decode steps.
"""

from __future__ import annotations

SHORT, LONG, PROMPTS = 16, 128, 4  # the timed prefills: one prompt of 16 tokens; 4 of 32
REPS = 2
PLANNED = 32  # waiting prompts the grouping looks at (its cost grows with their square)


class Pacing:
    """Rank 0's cost model (``None`` costs: pacing off, a forward takes all that fit)."""

    def __init__(self, a: float | None = None, b: float | None = None):
        self.a, self.b = a, b
        self.step = 0.0  # seconds of a decode step, running average

    @property
    def on(self) -> bool:
        return self.a is not None and self.b is not None and self.b > 0

    def stepped(self, seconds: float) -> None:
        self.step = seconds if not self.step else 0.8 * self.step + 0.2 * seconds

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A served forward's cost: a follows what the fixed part costs while serving (HTTP
        threads and all), b stays the calibrated one."""
        if self.on and tokens > 0:
            assert self.a is not None and self.b is not None
            self.a = 0.8 * self.a + 0.2 * max(0.0, seconds - self.b * tokens)

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
    None: all that fit the budget. The first forward of the grouping (whole prompts, in
    order) with the least mean time to first token, by dynamic programming from the last
    prompt: ``best[i] = min over j of (pace + Σ left[i:j])·(n - i) + best[j]`` (a forward
    delays every prompt from i on). The same on every rank for the same arguments."""
    if pace is None or len(left) < 2:
        return None
    left = left[:PLANNED]  # a long queue: its first prompts decide the next forward
    n = len(left)
    best, first = [0.0] * (n + 1), [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i], tokens = float("inf"), 0
        for j in range(i + 1, n + 1):
            tokens += left[j - 1]
            cost = (pace + tokens) * (n - i) + best[j]
            if cost < best[i]:
                best[i], first[i] = cost, j
    return None if first[0] == n else first[0]  # all in one: all that fit the budget
