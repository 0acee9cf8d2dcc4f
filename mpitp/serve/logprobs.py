"""Log-probabilities in OpenAI's two shapes, computed on rank 0 from the full logits.

Values are the model's log-softmax over the whole vocabulary (in float64), before
temperature, top-k and top-p — vLLM's default — so they describe the model, not the
sampler. One token's record is ``(token, logprob, [(alternative, logprob), ...])``, the
alternatives the ``k`` most likely, most likely first.

    chat:        choices[i].logprobs.content[j] = {token, logprob, bytes, top_logprobs}
    completions: choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}
                 (with echo, the prompt's tokens first; the first one has no logprob: null)
"""

from __future__ import annotations

import numpy as np

Record = tuple[int, float, list[tuple[int, float]]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def _top(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    idx = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    idx = idx[np.lexsort((idx, -lp[idx]))]  # most likely first; ties by id
    return [(int(i), float(lp[i])) for i in idx]


def record(logits: np.ndarray, token: int, k: int) -> Record:
    """The record of ``token`` drawn from one position's ``logits`` [V]."""
    lp = log_softmax(logits)
    return int(token), float(lp[token]), _top(lp, k)


def prompt_records(logits: np.ndarray, ids: list[int], k: int) -> list[Record | None]:
    """Records of a prompt's tokens from its prefill logits [P, V] (position t predicts
    token t + 1); the first token has none."""
    lp = log_softmax(logits[: len(ids) - 1])
    out: list[Record | None] = [None]
    for t, tok in enumerate(ids[1:]):
        out.append((int(tok), float(lp[t, tok]), _top(lp[t], k)))
    return out


class Formatter:
    """Token text and bytes as OpenAI returns them: each token decoded alone."""

    def __init__(self, tok):
        self.tok = tok
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        s = self._text.get(token)
        if s is None:
            s = self._text[token] = self.tok.decode([token], skip_special_tokens=False)
        return s

    def chat(self, records: list[Record]) -> list[dict]:
        """``logprobs.content`` of a chat choice."""

        def one(token, lp):
            s = self.text(token)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in top]} for t, lp, top in records]

    def completion(self, records: list[Record | None], ids: list[int], offset: int) -> dict:
        """``logprobs`` of a text-completion choice for the tokens ``ids`` (their
        ``records``, None for a token without one), text offsets counted from ``offset``."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for token, rec in zip(ids, records):
            s = self.text(token)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            token_lps.append(None if rec is None else rec[1])
            tops.append(None if rec is None else self._by_text(rec[2]))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """OpenAI's ``{text: logprob}``: two tokens that decode alike (say, two halves of
        UTF-8 characters, both "\ufffd") keep the more likely one's entry."""
        out: dict[str, float] = {}
        for a, alp in top:
            out.setdefault(self.text(a), alp)
        return out
