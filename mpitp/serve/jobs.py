"""One request's life on every rank: the :class:`Job` rank 0 hands every rank (the HTTP
side stays in :class:`.requests.Request`), its :class:`Prefill` while its prompt goes in
chunk by chunk, and its :class:`Slot`, the KV-cache row it decodes in."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Job:
    """What every rank needs of a request (rank 0 keeps the HTTP side in ``Request``)."""

    id: int
    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # alternatives per token (0: the chosen token's only); None: none
    echo: bool = False  # with logprobs: the prompt's own too (its prefill keeps every position's logits)
    constrained: bool = False  # a grammar (response_format): rank 0 masks the logits before sampling

    @property
    def prompt_logits(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def wants_logits(self) -> bool:
        """Rank 0 needs this request's logits (log-probabilities, a grammar); otherwise the
        last pipeline stage may sample it and send only the token."""
        return self.logprobs is not None or self.constrained


@dataclass
class Slot:
    job: Job
    pos: int  # the position of the next token
    last: int  # the token to feed next
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    tokens: list[int] = field(default_factory=list)  # what was picked (every rank)


@dataclass
class Prefill:
    """A prompt on its way in: the keys and values of its first ``done`` tokens, per layer
    [P, kv heads, head_dim] (prefix-cache hits, then each chunk's)."""

    job: Job
    done: int
    k: list
    v: list
    logits: list = field(default_factory=list)  # echo with logprobs: every position's, chunk by chunk
