"""What comes back from a forward for rank 0 to sample: per row, the logits or the token the
last pipeline stage already sampled, read when first asked (:class:`Next`, :class:`Out`)."""

from __future__ import annotations

from collections import deque
from functools import partial

import numpy as np


class Out:
    """Rank 0's view of one row's next-token result: ``logits`` ([V]; [P, V] for a prompt
    that keeps every position's) for rank 0 to sample, or ``token``, the one the last
    pipeline stage already sampled with the row's own generator (-1: none). Read when
    first asked: in the pipelined loop the message arrives while the first stage computes
    the next micro-batch."""

    def __init__(self, get):
        self._get = get

    @property
    def logits(self):
        return self._get()[0]

    @property
    def token(self) -> int:
        return self._get()[1]


class Next:
    """One forward's next-token results for rank 0, by output position. ``fetch()`` gives
    (tokens [n] int64, -1 where rank 0 samples; logits [m, V] of the positions in ``wants``,
    in order); it is called at the first read."""

    def __init__(self, fetch, wants: np.ndarray):
        self._fetch, self._got = fetch, None
        self._row = np.cumsum(wants) - 1  # position -> its row of the logits

    def _data(self):
        if self._got is None:
            self._got = self._fetch()
        return self._got

    def _at(self, i: int):
        tokens, logits = self._data()
        t = int(tokens[i])
        return (None, t) if t >= 0 else (logits[self._row[i]], -1)

    def __getitem__(self, i: int) -> Out:
        return Out(partial(self._at, i))

    def span(self, lo: int, hi: int):
        """The logits of positions [lo, hi), every one wanted (a prompt's own)."""
        logits = self._data()[1]
        return logits[self._row[lo] : self._row[hi - 1] + 1]


def nowhere():
    raise RuntimeError("only rank 0 reads a forward's results")


class HandBack:
    """Pipelined serving's results on their way from the last stage to rank 0 (vLLM's
    virtual engines: every engine of a stage shares one, so rank 0 receives in the order the
    last stage sent): the last stage's tp rank 0 sends each forward's tokens (and the logits
    that are wanted) without waiting; rank 0 receives them when first read."""

    def __init__(self, stage):
        self.stage = stage
        self._sent: list = []  # the sends in flight
        self._due: deque = deque()  # rank 0: their receives, in the order sent

    def send(self, tokens, logits, n: int, m: int, vocab: int):
        """``serve``'s next-token results of one forward, from the last stage's tp rank 0 to
        rank 0 (the first stage's), sent without waiting: ``tokens`` [n] int64, those the last
        stage sampled itself (-1 elsewhere), and the ``logits`` [m, V] of the positions whose
        requests want them (log-probabilities, a grammar; m may be 0), so V floats per row
        cross the link only where needed. Returns on rank 0 a function that receives them
        (tokens, logits) when first called — in the pipelined serve loop, after its own
        stage's next micro-batch (earlier forwards' results are received first); None on
        every other rank."""
        if self.stage.index == self.stage.count - 1 and self.stage.tp.rank == 0:
            self._sent = [h for h in self._sent if not h.test()]
            self._sent.append(self.stage.pp.isend(np.ascontiguousarray(tokens, np.int64), dest=0, tag=10))
            if m:
                self._sent.append(self.stage.pp.isend(np.array(logits, np.float32), dest=0, tag=9))
        if self.stage.index != 0 or self.stage.tp.rank != 0:
            return None
        got: list = []
        last = self.stage.count - 1

        def receive() -> None:
            t = self.stage.pp.recv(last, out=np.empty(n, np.int64), tag=10)
            lg = self.stage.pp.recv(last, out=np.empty((m, vocab), np.float32), tag=9) if m else None
            got.append((t, lg))

        self._due.append(receive)

        def get():
            while not got:
                self._due.popleft()()
            return got[0]

        return get

    def drain(self) -> None:
        """Rank 0 receives every result still due (also those nobody read: a prompt's own
        logits when its request was cancelled); the last stage's sends complete."""
        while self._due:
            self._due.popleft()()
        for h in self._sent:
            h.wait()
        self._sent = []
