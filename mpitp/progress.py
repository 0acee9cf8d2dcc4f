"""Progress of long work, readable wherever it lands.

On a terminal: tqdm's bar. Anywhere else (a SLURM ``.out`` file, CI's log, a pipe) a bar
is one line of carriage returns, so instead a plain line is written at the first step,
then whenever a tenth of the work or ``seconds`` have passed since the last line, and at
the end (as torchtitan and SLURM-minded tools log); work that may be quick (loading a
model) passes ``after`` and says nothing unless it takes that long::

    train: step 30/300 (10%), loss 2.4512, tok_s 1520, 12.3 s elapsed, ~110.7 s left
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "step",
        *,
        initial: int = 0,
        file: TextIO | None = None,
        seconds: float = 30.0,
        enabled: bool = True,
        leave: bool = True,
        after: float = 0.0,
    ):
        self.file = file or sys.stderr
        self.total, self.desc, self.unit, self.n, self.seconds = total, desc, unit, initial, seconds
        self.initial, self.after = initial, after  # off a terminal: no line before `after` seconds
        self.enabled = enabled
        self.bar = None
        self.start = self.last = time.perf_counter()
        self.step_every = max(1, total // 10)
        self.next_step = initial + 1  # the first step gets a line
        self.postfix: dict[str, str] = {}
        if enabled and self.file.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, file=self.file, dynamic_ncols=True, leave=leave
            )

    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        self.postfix.update({k: str(v) for k, v in postfix.items()})
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(n)
        elif self.enabled:
            now = time.perf_counter()
            if now - self.start < self.after:
                return
            if self.n >= self.next_step or now - self.last >= self.seconds or self.n >= self.total:
                self.line(now)

    def line(self, now: float) -> None:
        self.last = now
        self.next_step = (self.n // self.step_every + 1) * self.step_every
        elapsed = now - self.start
        done = f"{self.unit} {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%)"
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        left = ""
        if self.initial < self.n < self.total:
            left = f", ~{elapsed / (self.n - self.initial) * (self.total - self.n):.1f} s left"
        print(f"{self.desc}: {done}{extra}, {elapsed:.1f} s elapsed{left}", file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
