"""Sampling and the decode loop: prefill once, then one token at a time.

Prompts of different lengths are left-padded onto one timeline; pads are masked out of
attention and positions count only real tokens. Greedy decoding takes each rank's argmax
of its shard of the vocabulary and all-gathers those (value, token) pairs, so every rank
picks the same token with no logits gathered; otherwise every rank holds the same logits
(bytes all-gathered from the same shards), and a sampled token is drawn on rank 0 and
broadcast, so every rank continues with the same ids whatever its random generator does.
"""

from __future__ import annotations

import time

import numpy as np

from ..backend import to_host
from ..errors import MpitpError


class GenerationError(MpitpError, ValueError):
    """A prompt or sampling option the model cannot serve."""


def check_sampling(
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise GenerationError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise GenerationError(f"top_k must be a whole number >= 0 (0 = all tokens), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise GenerationError(f"top_p must lie in (0, 1] (1 = off), got {top_p!r}")
    if not (repetition_penalty > 0 and np.isfinite(repetition_penalty)):
        raise GenerationError(f"repetition_penalty must be > 0 (1 = off), got {repetition_penalty!r}")
    if not 0 <= min_p <= 1:
        raise GenerationError(f"min_p must lie in [0, 1] (0 = off), got {min_p!r}")


def check_prompts(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Every prompt non-empty, inside the vocabulary, and short enough for the context."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token")
    context = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise GenerationError(
            f"a prompt of {longest} tokens plus max_new_tokens {max_new_tokens} exceeds the "
            f"model's context of {context} tokens (max_position_embeddings); shorten the prompt "
            "or ask for fewer new tokens"
        )
    for p in prompts:
        model.check_ids(p)


def penalize_repeats(logits: np.ndarray, seqs: list[list[int]], penalty: float) -> np.ndarray:
    """transformers' repetition penalty: the logit of every token already in a row's
    sequence (prompt included) is divided by ``penalty`` when positive, multiplied when not."""
    if penalty == 1.0:
        return logits
    logits = np.array(logits, np.float64)
    for b, seq in enumerate(seqs):
        seen = np.unique(np.asarray(seq, np.int64))
        row = logits[b, seen]
        logits[b, seen] = np.where(row > 0, row / penalty, row * penalty)
    return logits


def sample(
    logits: np.ndarray,
    rng: np.random.Generator,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """Next token per row of ``logits`` [B, V]: greedy when temperature is 0; else from the
    softmax at ``temperature``, restricted to the top k, the top-p nucleus and the tokens
    with at least ``min_p`` times the most likely one's probability."""
    if temperature <= 0:
        return np.asarray(logits).argmax(axis=-1)
    logits = np.asarray(logits, np.float64)
    z = logits / temperature
    if top_k and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < top_p  # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(axis=-1, keepdims=True), p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def generate(
    model,
    input_ids,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens=None,
    on_token=None,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    stop_check=None,
) -> list[list[int]]:
    """Prompt + new tokens for every sequence (a list of lists). A sequence ends at a stop
    token, or when ``stop_check(b, token)`` says so (stop strings: every rank decides
    alike, from the same tokens)."""
    xp, comm = model.xp, model.comm
    prompts = [list(map(int, p)) for p in (input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty, min_p)
    check_prompts(model, prompts, max_new_tokens)
    stops = set(model.config.eos_token_id if stop_tokens is None else stop_tokens)
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = np.zeros((B, T), np.int64)
    valid = np.zeros((B, T), bool)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = p
        valid[b, T - len(p) :] = True
    cache = model.new_cache(B, T + max_new_tokens)
    cache.valid[:, :T] = xp.asarray(valid)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    rng = np.random.default_rng(seed)
    out = [list(p) for p in prompts]
    done = np.zeros(B, bool)
    # greedy, nothing done to the logits: each rank's argmax of its shard of the vocabulary,
    # the logits never gathered (the same token as the gathered logits' argmax)
    argmax = temperature <= 0 and repetition_penalty == 1.0

    def forward(ids, positions):
        out = model.forward(xp.asarray(ids), xp.asarray(positions), cache, last_only=True, greedy=argmax)
        return out if out is None or argmax else out[:, -1]

    t0 = time.perf_counter()
    logits = forward(ids, positions)
    prefill = time.perf_counter() - t0
    next_pos = positions[:, -1] + 1
    new = 0
    t1 = time.perf_counter()
    stage = getattr(model, "stage", None)  # pipeline stages: the logits are the last stage's
    for step in range(max_new_tokens):
        tok = None
        if logits is not None and argmax:
            tok = np.asarray(logits, np.int64)
        elif logits is not None:
            host = to_host(logits)
            host = penalize_repeats(host, out, repetition_penalty)
            tok = sample(host, rng, temperature, top_k, top_p, min_p).astype(np.int64)
            if comm is not None and comm.size > 1 and temperature > 0:
                tok = comm.broadcast(tok, root=0)
        if stage is not None:
            tok = stage.tokens(tok, B)
        assert tok is not None
        for b in range(B):
            if not done[b]:
                out[b].append(int(tok[b]))
                done[b] = int(tok[b]) in stops or (stop_check is not None and bool(stop_check(b, int(tok[b]))))
        new += 1
        if on_token is not None:
            on_token(step, tok, done.copy())
        if done.all() or step == max_new_tokens - 1:
            break
        cache.valid[:, cache.length] = True
        logits = forward(tok[:, None], next_pos[:, None])
        next_pos = next_pos + 1
    decode = time.perf_counter() - t1
    model.last_stats = {
        "prefill_s": prefill,
        "prompt_tokens": int(valid.sum()),
        "new_tokens": new,
        "decode_s": decode,
        "decode_tokens_per_s": (new - 1) / decode if new > 1 and decode > 0 else 0.0,
    }
    return out
