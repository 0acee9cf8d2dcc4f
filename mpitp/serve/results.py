"""What comes back from a forward for rank 0 to sample: per row, the logits or the token the
last pipeline stage already sampled, read when first asked (:class:`Next`, :class:`Out`)."""

from __future__ import annotations

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
