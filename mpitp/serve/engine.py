"""Continuous batching, in lockstep on every tensor-parallel rank.

One KV cache of ``max_batch`` rows shares a timeline of columns; each running request
owns a row. Every iteration rank 0 broadcasts what changed (new requests, cancellations,
shutdown), then every rank runs the same model steps::

    iteration:   prefill: up to ``budget`` prompt tokens of the waiting requests, packed
                          into one row of one forward (each sees only its own columns);
                          a prompt past the budget goes on in the next iteration's chunk
                 a prompt that is complete moves into a free row, right-aligned at the
                          current column
                 one decode step for all rows         (rows without a token compute, unused)
                 rank 0 samples, broadcasts the tokens and which requests finished

    packed prefill row:  [a a a b b b b | A A B B B]     a, b: keys/values of earlier chunks
                                          ^ this chunk    or prefix-cache hits; A, B: new

    columns:     row 0  . . . [p p p p g g g]        p = prompt, g = generated, . = masked
                 row 1  . . . . . . [p p g g]         a request that joined later
                                            ^ the next column, written by every row

A request's positions are its own (RoPE), so where its columns sit does not matter; the
mask hides everything else. A prompt longer than the timeline so far shifts the running
rows right; a full timeline is compacted left. Full 16-token blocks of prompts (and of
finished requests' text) go into the prefix cache (prefix.py); a later prompt that starts
with them prefills only the rest.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from mpi4py import MPI

from ..backend import to_host
from ..models.generate import sample
from ..tp import partition
from . import rows as kv_rows
from .jobs import Job, Prefill, Slot
from .pacing import take
from .prefix import BLOCK, PrefixCache
from .results import HandBack, Next, Out, nowhere


class Engine:
    def __init__(
        self,
        model,
        max_batch: int,
        max_len: int | None = None,
        budget: int = 256,
        prefix_bytes: int = 0,
        comm=None,
        prefix: PrefixCache | None = None,
        hand_back: HandBack | None = None,
    ):
        """``comm``: the ranks that run in lockstep (default the model's; with pipeline
        stages the world, the model's being its stage's tensor-parallel group). ``prefix``:
        a prefix cache to share (pipelined serving's engines share one); ``hand_back``: the
        stage's results hand-back (shared the same way; made here if not given)."""
        self.model, self.comm = model, comm if comm is not None else model.comm
        self.stage = getattr(model, "stage", None)
        self.hand_back = hand_back if hand_back is not None or self.stage is None else HandBack(self.stage)
        self.B = max_batch
        self.max_len = max_len or min(model.config.max_position_embeddings, 4096)
        self.budget = max(1, budget)  # prompt tokens prefilled per iteration
        self.cache = model.new_cache(self.B, self.max_len)
        for a in self.cache.k + self.cache.v:  # allocated now, as vLLM does: a first request in a
            a.fill(0)  # row would otherwise fault in its (huge) pages, ~0.2 s per row on a VM
        self.slots: list[Slot | None] = [None] * self.B
        self.waiting: list[Prefill] = []
        self.last_tokens = 0  # prompt tokens of the last prefill forward
        a, cfg = model.layers[0].self_attn, model.config
        size = model.comm.size if model.comm is not None else 1  # the tensor-parallel cut of the KV heads
        most = max(partition.attention(cfg.num_attention_heads, cfg.num_key_value_heads, size).kv)
        if prefix is None:
            prefix = PrefixCache(len(model.layers), a.nkv, cfg.head_dim, model.kv_dtype, prefix_bytes, model.xp, most)
        self.prefix = prefix

    # ------------------------------------------------------------------ lockstep control
    def exchange(self, message, busy: bool | None = None):
        """Rank 0's ``message`` on every rank. While requests run (``busy``, default this
        engine's), the waiting ranks wait in MPI (the message is due within a step; a sleep
        would add up to its length to every step); an idle server's ranks poll with sleeps
        instead of spinning, leaving the cores to rank 0's HTTP threads."""
        busy = self.busy if busy is None else busy
        return message if self.comm is None else self.comm.poll_bcast(message, busy=busy)

    @property
    def cache_bytes(self) -> int:
        return sum(a.nbytes for a in self.cache.k + self.cache.v)

    @property
    def free(self) -> int:
        """Rows not taken by a running request or one being prefilled."""
        return self.B - self.running - len(self.waiting)

    @property
    def busy(self) -> bool:
        return self.running > 0 or bool(self.waiting)

    # ------------------------------------------------------------------ model steps
    def add(self, job: Job) -> None:
        """Queue ``job``'s prompt for prefill, starting after its longest cached prefix (a job
        that wants its prompt's log-probabilities prefills all of it; at least the last
        token is always computed, for its logits)."""
        P = len(job.ids)
        m, xp = self.model, self.model.xp
        hits = [] if job.prompt_logits else self.prefix.match(job.ids, limit=P - 1)
        h = len(hits) * BLOCK
        a = m.layers[0].self_attn
        shape = (P, a.nkv, m.config.head_dim)
        pf = Prefill(
            job, h, [xp.empty(shape, m.kv_dtype) for _ in m.layers], [xp.empty(shape, m.kv_dtype) for _ in m.layers]
        )
        for layer in range(len(m.layers) if h else 0):
            pf.k[layer][:h], pf.v[layer][:h] = self.prefix.read(hits, layer)
        self.waiting.append(pf)

    def prefill(self, pace: float | None = None) -> dict[int, Out]:
        """One packed forward over the next ``budget`` prompt tokens of the waiting jobs (in
        arrival order); with ``pace`` (a forward's fixed cost in tokens), over the prompts
        :func:`.pacing.take` picks for it. Returns, for each job whose prompt is now complete, its row and its
        next-token logits [V] — or, when it asks for its prompt's log-probabilities, every
        position's [P, V] (the last row is the next token's). With ``--dp-attention`` the
        head's input instead, the normed hidden state [H] (:func:`.dp.pick` runs the head)."""
        if not self.waiting:
            return {}
        m, xp = self.model, self.model.xp
        chunks, left = [], self.budget
        most = take([len(pf.job.ids) - pf.done for pf in self.waiting], pace)
        for pf in self.waiting[:most]:
            if left <= 0:
                break
            n = min(len(pf.job.ids) - pf.done, left)
            chunks.append((pf, n))
            left -= n
        D = sum(pf.done for pf, _ in chunks)
        T = self.last_tokens = sum(n for _, n in chunks)
        row = m.new_cache(1, D + T)
        row.valid[:] = True
        owner = np.empty(D + T, np.int64)
        ids, pos, at, new = np.empty(T, np.int64), np.empty(T, np.int64), 0, D
        keep: list[int] = []  # the positions whose logits are wanted
        for i, (pf, n) in enumerate(chunks):
            d = pf.done
            for layer in range(len(m.layers) if d else 0):
                row.k[layer][0, at : at + d] = pf.k[layer][:d]
                row.v[layer][0, at : at + d] = pf.v[layer][:d]
            owner[at : at + d] = i
            owner[new : new + n] = i
            ids[new - D : new - D + n] = pf.job.ids[d : d + n]
            pos[new - D : new - D + n] = np.arange(d, d + n)
            if pf.job.prompt_logits:
                keep.extend(range(new - D, new - D + n))
            elif d + n == len(pf.job.ids):
                keep.append(new - D + n - 1)
            at, new = at + d, new + n
        row.length, row.owner = D, xp.asarray(owner)
        kept = xp.asarray(np.array(keep, np.int64))
        logits = m.forward(xp.asarray(ids[None]), xp.asarray(pos[None]), row, keep=kept, hidden=m.dp_attention)
        wants = np.zeros(len(keep), bool)
        sample: dict[int, int] = {}  # position -> the row the last stage samples it for
        echoes: list[tuple[Prefill, int, int]] = []  # a prompt's own positions [lo, hi)
        complete: list[tuple[Prefill, int, int]] = []  # (prompt, its row, its next-token position)
        j, new = 0, D
        for pf, n in chunks:
            d = pf.done
            for layer in range(len(m.layers)):
                pf.k[layer][d : d + n] = row.k[layer][0, new : new + n]
                pf.v[layer][d : d + n] = row.v[layer][0, new : new + n]
            pf.done, new = d + n, new + n
            if pf.job.prompt_logits:
                wants[j : j + n] = True
                echoes.append((pf, j, j + n))
                j += n
            if pf.done < len(pf.job.ids):
                continue
            if not pf.job.prompt_logits:
                wants[j] = pf.job.wants_logits
                j += 1
            self.waiting.remove(pf)
            self.prefix.store(pf.job.ids, lambda layer, lo, hi, pf=pf: (pf.k[layer][lo:hi], pf.v[layer][lo:hi]))
            r = self._place(pf)
            if not wants[j - 1]:
                sample[j - 1] = r
            complete.append((pf, r, j - 1))
        nxt = self._results(None if logits is None else logits[0], wants, sample)
        for pf, lo, hi in echoes:
            pf.logits.append(partial(nxt.span, lo, hi))
        out: dict[int, Out] = {}
        for pf, r, at in complete:
            if pf.job.prompt_logits:  # every position's, chunk by chunk; the last is the next token's
                parts = pf.logits
                out[r] = Out(lambda parts=parts: (np.concatenate([p() for p in parts]), -1))
            else:
                out[r] = nxt[at]
        return out

    def admit(self, job: Job):
        """Prefill ``job`` whole (one request alone) and return its logits (rank 0)."""
        self.add(job)
        budget, self.budget = self.budget, 1 << 30
        try:
            out = self.prefill()
        finally:
            self.budget = budget
        (result,) = out.values()
        return result.logits

    def _place(self, pf: Prefill) -> int:
        """Move a complete prompt's keys and values into the first free row, right-aligned
        at the current column."""
        c, job, P = self.cache, pf.job, len(pf.job.ids)
        if P > c.length:  # P <= max_len: checked when the request came in
            kv_rows.shift(c, P - c.length)
        r = self.running  # the first free row: running requests hold rows 0 … k-1
        kv_rows.place(c, r, pf.k, pf.v)
        seed = job.seed if job.seed is not None else job.id
        self.slots[r] = Slot(job, pos=P, last=-1, rng=np.random.default_rng(seed))
        return r

    def cancel(self, job_ids) -> None:
        """Drop the jobs ``job_ids``, prefilling or running (finished ones too)."""
        gone = set(job_ids)
        self.waiting = [pf for pf in self.waiting if pf.job.id not in gone]
        rows = [r for r, s in enumerate(self.slots) if s is not None and s.job.id in gone]
        for r in sorted(rows, reverse=True):
            self.release(r)

    def step(self) -> Next:
        """One decode step for the rows that have a token to feed; returns the results
        (:class:`Out`) of rows 0 … k-1, the running ones (rows without a token to feed yet
        hold garbage: masked out, never read). Running requests always hold the lowest rows (``release`` moves
        the last one down), so the step computes k rows, not the whole batch."""
        m, c = self.model, self.cache
        if c.length >= self.max_len or kv_rows.unused(self.cache, self.running) > max(256, c.length // 2):
            kv_rows.compact(self.cache)  # full, or most of the timeline belongs to finished requests
        k = self.running
        rows = self.slots[:k]
        feed = [s is not None and s.last >= 0 for s in rows]
        toks = np.array([[s.last if f and s else 0] for s, f in zip(rows, feed)], np.int64)
        pos = np.array([[s.pos if f and s else 0] for s, f in zip(rows, feed)], np.int64)
        c.valid[:k, c.length] = feed  # a row without a token must not see this column later
        view = kv_rows.Rows(c, k)
        wants = np.array([s is not None and s.job.wants_logits for s in rows], bool)
        # every fed row greedy, none wanting its logits: the argmax of each rank's shard of
        # the vocabulary, the logits never gathered (the token rank 0's pick would give)
        greedy = all(s.job.temperature <= 0 for s, f in zip(rows, feed) if f and s)
        argmax = self.stage is None and greedy and not wants.any() and not m.dp_attention
        with np.errstate(invalid="ignore", divide="ignore"):  # rows with nothing to attend to
            # --dp-attention: the rows' hidden states; the head runs in :func:`.dp.pick`, with every rank
            out = m.forward(
                m.xp.asarray(toks), m.xp.asarray(pos), view, last_only=True, greedy=argmax, hidden=m.dp_attention
            )
            if argmax:
                nxt = Next(lambda: (out, None), np.zeros(k, bool))
            else:
                sample = {r: r for r, f in enumerate(feed) if f and not wants[r]}
                nxt = self._results(None if out is None else out[:, -1], wants, sample)
        c.length = view.length
        for s, f in zip(rows, feed):
            if f and s is not None:
                s.pos += 1
        return nxt

    def _results(self, logits, wants: np.ndarray, sample: dict[int, int]) -> Next:
        """A forward's results for rank 0 from its ``logits`` [n, V] (None on a stage before
        the last). Without pipeline stages this rank holds them and rank 0 samples every
        row. With them, the last stage samples the positions in ``sample`` (position -> row,
        requests that want no logits) with each row's own generator and sends rank 0 the
        tokens and only the ``wants`` positions' logits (:meth:`.results.HandBack.send`)."""
        n, st = len(wants), self.stage
        if st is None:
            host = to_host(logits)
            return Next(lambda: (np.full(n, -1, np.int64), host), np.ones(n, bool))
        tokens, sent = None, None
        if st.index == st.count - 1 and st.tp.rank == 0:
            host = to_host(logits)
            tokens = np.full(n, -1, np.int64)
            for i, r in sample.items():
                tokens[i] = self.pick(r, host[i])
            sent = host[wants]
        assert self.hand_back is not None
        fetch = self.hand_back.send(tokens, sent, n, int(wants.sum()), self.model.config.vocab_size)
        return Next(fetch or nowhere, wants)

    def kv_usage(self) -> float:
        """The share of the cache's rows x columns that running requests attend to."""
        c, k = self.cache, self.running
        return float(c.valid[:k, : c.length].sum()) / (self.B * self.max_len) if k else 0.0

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def pick(self, row: int, logits: np.ndarray) -> int:
        """Rank 0: the next token of the request in ``row``."""
        s = self.slots[row]
        assert s is not None
        j = s.job
        return int(sample(logits[None], s.rng, j.temperature, j.top_k, j.top_p)[0])

    def release(self, row: int) -> int | None:
        """Free ``row``; the last running request moves into it (its keys, values and mask),
        so running requests stay in rows 0 … k-1. Returns the row that moved, or None.
        Release several rows in descending order."""
        c = self.cache
        s = self.slots[row]
        if s is not None and self.prefix.capacity:
            self._keep(row, s)
        last = self.running - 1
        moved = None
        if row != last:
            kv_rows.move(c, last, row)
            self.slots[row] = self.slots[last]
            moved = last
        self.slots[last] = None
        c.valid[last, :] = False
        if last == 0:  # nothing runs: the timeline starts again at column 0
            c.length = 0
        return moved

    def took(self, row: int, token: int) -> None:
        """Every rank: ``token`` was picked for ``row``; it is fed at the next step."""
        s = self.slots[row]
        assert s is not None
        s.last = token
        s.tokens.append(token)

    def _keep(self, row: int, s: Slot) -> None:
        """Put the full blocks of a finished request's text (prompt and the tokens fed) into
        the prefix cache: the next turn of a conversation starts with them."""
        c, xp = self.cache, self.model.xp
        tokens = list(s.job.ids) + s.tokens[: s.pos - len(s.job.ids)]
        cols = xp.flatnonzero(c.valid[row, : c.length])
        if len(cols) != len(tokens):  # every fed token holds one column; anything else: keep nothing
            return
        self.prefix.store(tokens, lambda layer, lo, hi: (c.k[layer][row, cols[lo:hi]], c.v[layer][row, cols[lo:hi]]))


def world_rank() -> int:
    return MPI.COMM_WORLD.rank
