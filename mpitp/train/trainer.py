"""The training loop behind ``mpitp train``: data, units, AdamW, logging, checkpoints.

Every rank runs the same loop (SPMD). Per step: each rank's piece of the global batch in
``grad_accum`` micro-batches through :class:`~mpitp.train.engine.TrainEngine`; the summed loss
and the gradient norm are all-reduced; clipping; AdamW on the owned slices; zero1/zero2
gather the updated parameters. Rank 0 shows progress and writes the log.

With ``--tp T`` the N ranks form a (dp, tp) mesh of N/T x T (tp innermost, inside a
node): the ranks of a tp group share a piece of the batch and hold slices of every
tensor (:mod:`.tp_layout`); ``--mode`` shards those slices over the dp group.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import MpitpError
from ..log import get_logger
from ..progress import Progress
from . import checkpoint, data
from .engine import TrainEngine
from .layout import llama_units
from .optim import AdamW, clip_coefficient, learning_rate
from .options import Options, TrainError
from .sharding import Sharding
from .sources import open_model
from .tp_layout import TPCut, TPError, gather_whole, runs

__all__ = ["Options", "TrainError", "Trainer"]
log = get_logger("train")


class Trainer:
    def __init__(self, opts: Options, comm=None):
        self.o, self.comm = opts, comm
        o = opts
        self.world: int = comm.size if comm is not None else 1
        o.check(self.world)
        self.dtype = np.dtype(o.dtype)
        self.model = open_model(o.config, o.init, o.resume, comm)
        self.cfg, self.tokenizer = self.model.cfg, self.model.tokenizer
        if o.seq > self.cfg.max_position_embeddings:
            raise TrainError(
                f"--seq {o.seq} exceeds the model's max_position_embeddings {self.cfg.max_position_embeddings}"
            )
        tokens = self._tokens()
        train, held = data.split_eval(tokens, o.eval_fraction, o.seq)
        self.windows = data.Windows(train, o.seq)
        self.eval_windows = data.Windows(held, o.seq, "held-out tail") if held is not None else None
        self.perm = None if o.shuffle is None else np.random.default_rng(o.shuffle).permutation(self.windows.count)
        self.mesh = None
        self.dp, self.tp = comm, None  # the dp group shards; the tp group cuts tensors
        if o.tp > 1:
            self.mesh = comm.mesh((self.world // o.tp, o.tp), ("dp", "tp"))
            self.dp, self.tp = self.mesh["dp"], self.mesh["tp"]
        self.n: int = self.dp.size if self.dp is not None else 1  # data-parallel ranks
        self.rank: int = self.dp.rank if self.dp is not None else 0
        self.tp_rank = self.tp.rank if self.tp is not None else 0
        self.layouts = llama_units(self.cfg)  # the whole model's units (checkpoints)
        try:
            self.cut = TPCut(self.cfg, o.tp, self.tp_rank, self.layouts)
        except TPError as e:
            raise TrainError(str(e)) from None
        self.local = self.cut.units  # this rank's slices (all of it at tp 1)
        keep = (len(self.local) - 1,) + ((0,) if self.cfg.tie_word_embeddings else ())
        self.S = Sharding(
            self.dp, self.local, o.mode, self.dtype, o.algorithm, keep=keep, param_dtype=o.param_dtype,
            reduce_dtype=o.reduce_dtype,
        )  # fmt: skip
        self.engine = TrainEngine(self.cfg, self.S, recompute=o.recompute, cut=self.cut, tp=self.tp)
        # replicated over tp: counted in the gradient norm and saved by tp rank 0 only
        self.skip = [[] if self.tp_rank == 0 else self.cut.replicated(i) for i in range(len(self.local))]
        ranges = [self.S.opt_range(i) for i in range(len(self.local))]
        self.opt = AdamW(
            [b - a for a, b in ranges],
            [u.decay_mask(a, b) for u, (a, b) in zip(self.local, ranges)],
            self.dtype,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.step = 0
        err = None
        try:
            self._load_state()
        except (MpitpError, OSError, ValueError) as e:  # one rank's file: every rank must stop
            err = e
        checkpoint.agree(comm, err, "loading the parameters")
        self.history: list[dict] = []
        self.pending: checkpoint.Background | None = None  # a checkpoint being written

    # ---------------------------------------------------------------- setup
    def _tokens(self) -> np.ndarray:
        o = self.o

        def load():
            text: str | None
            if o.data_default:
                text, ids = data.default_text(), None
            elif o.data:
                path = Path(o.data)
                if not path.exists():
                    raise data.DataError(f"--data {path}: no such file")
                ids = data.read_ids(path)
                text = None if ids is not None else path.read_text(encoding="utf-8", errors="replace")
            else:
                raise TrainError("no data: pass --data FILE (text, .npy or .bin ids) or --data-default")
            if ids is None:
                from tokenizers import Tokenizer

                if self.tokenizer is not None:
                    tok = Tokenizer.from_file(str(self.tokenizer))
                else:
                    assert text is not None  # ids is None: the data was text
                    tok = data.train_tokenizer(text, self.cfg.vocab_size)
                    if o.out:
                        Path(o.out).mkdir(parents=True, exist_ok=True)
                        tok.save(str(Path(o.out) / "tokenizer.json"))
                        self.tokenizer = Path(o.out) / "tokenizer.json"
                ids = np.asarray(tok.encode(text).ids, np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
                raise data.DataError(
                    f"token id {int(ids.max())} is outside the model's vocabulary [0, {self.cfg.vocab_size})"
                )
            return ids, (str(self.tokenizer) if self.tokenizer else None)

        ids, tok = load() if self.comm is None else self.comm.on_root(load)
        self.tokenizer = Path(tok) if tok else None
        return ids

    def _load_state(self) -> None:
        """Fill this rank's parameters (and moments, when resuming): the elements of the
        whole model's units that its slice and shard hold, read from wherever they lie
        (:mod:`.sources`)."""
        fsdp = self.o.mode == "fsdp"
        source = self.model.source(self.layouts, self.o.seed)

        def reader(i: int, kind: str, dtype):
            return lambda lo, hi: source.read(i, kind, lo, hi, dtype)

        for i, (lay, u) in enumerate(zip(self.local, self.S.units)):
            lo, hi = (u.lo, min(u.hi, lay.numel)) if fsdp else (0, lay.numel)
            dst = u.shard if fsdp else u.full
            if hi > lo:
                dst[: hi - lo] = gather_whole(reader(i, "param", self.dtype), self.cut.index(i, lo, hi))
            a, b = self.S.opt_range(i)
            b = min(b, lay.numel)
            if source.has_moments and b > a:
                idx = self.cut.index(i, a, b)
                for kind, arr in (("exp_avg", self.opt.m[i]), ("exp_avg_sq", self.opt.v[i])):
                    arr[: b - a] = gather_whole(reader(i, kind, arr.dtype), idx)
        self.S.loaded()  # the values forward uses, from the masters
        if self.model.checkpoint is not None:
            self.step, self.opt.t = self.model.checkpoint.progress()

    # ---------------------------------------------------------------- the loop
    def lr_at(self, step: int) -> float:
        o = self.o
        return learning_rate(step, o.lr, o.steps, o.warmup, o.schedule, o.min_lr)

    def _allsum(self, x: float) -> float:
        """Sum over the dp group (a tp group's ranks hold the same number)."""
        if self.dp is None or self.n == 1:
            return x
        return float(self.dp.allreduce(np.array([x], np.float64), algorithm="mpi")[0])

    def _grad_sq_sum(self) -> float:
        total = self.S.grad_sq_sum(self.skip)
        if self.tp is not None:
            total = float(self.tp.allreduce(np.array([total]), algorithm="mpi")[0])
        return total

    def train_step(self) -> dict:
        o, S = self.o, self.S
        t0 = time.perf_counter()
        S.comm_wait = 0.0
        sent = self.sent_bytes()
        idx = data.step_windows(self.step, o.batch, self.windows.count, self.perm)
        mine = idx[data.local_rows(o.batch, self.n, self.rank)]
        S.zero_grads()
        scale = 1.0 / (o.batch * o.seq)
        local = 0.0
        for j, part in enumerate(np.array_split(mine, o.grad_accum)):
            ids, targets = self.windows.batch(part)
            local += self.engine.micro_step(ids, targets, scale, last_micro=j == o.grad_accum - 1)
        loss = self._allsum(local) * scale
        norm = math.sqrt(self._grad_sq_sum())
        coef = clip_coefficient(norm, o.grad_clip)
        grads = [S.opt_grads(i) for i in range(len(self.local))]
        if coef < 1.0:
            for g in grads:
                g *= coef
        lr = self.lr_at(self.step)
        t1 = time.perf_counter()
        self.opt.step([S.opt_params(i) for i in range(len(self.local))], grads, lr)
        S.sync_params()
        self.step += 1
        t2 = time.perf_counter()
        return {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": norm,
            "tokens_per_s": o.batch * o.seq / (t2 - t0),
            "step_s": t2 - t0,
            "comm_wait_s": S.comm_wait,
            "optimizer_s": t2 - t1,
            "sent_bytes": self.sent_bytes() - sent,  # this rank's, every group's counters
            # fsdp: the most gathered parameters held at once so far (units in flight are
            # --param-dtype; the unit in use is widened to --dtype for NumPy's BLAS)
            "gathered_peak_bytes": S.peak_gathered,
        }

    def sent_bytes(self) -> int:
        """Bytes this rank has sent so far over its dp and tp groups (traffic counters)."""
        groups = {id(c): c for c in (self.dp, self.tp) if c is not None}
        return sum(c.traffic.total for c in groups.values())

    def eval_loss(self) -> float | None:
        if self.eval_windows is None:
            return None
        o = self.o
        count = min(self.eval_windows.count, o.eval_batches * o.batch)
        mine = np.arange(count)[data.local_rows(count, self.n, self.rank)]
        per = -(-o.batch // self.n)  # rows per forward: a step's share
        most = -(-count // self.n)  # the most rows any rank has
        chunks = max(1, -(-most // per))  # the same number on every rank
        local = 0.0
        for part in np.array_split(mine, chunks):
            ids, targets = self.eval_windows.batch(part)
            local += self.engine.loss(ids, targets)
        return self._allsum(local) / (count * o.seq)

    def save(self, background: bool = False) -> Path:
        """Checkpoint the current step (collective). ``background``: hand copies of the
        values to a thread on each rank and return at once (:meth:`poll_save` and
        :meth:`finish_save` complete it); at most one is in flight."""
        o = self.o
        if not o.out:
            raise TrainError("saving a checkpoint needs an output directory (--out DIR)")
        self.finish_save()
        ranges: list = []
        tensors: dict[tuple[int, str], np.ndarray] = {}
        for i, (lay, u) in enumerate(zip(self.local, self.S.units)):
            lo, hi = u.lo, max(min(u.hi, lay.numel), u.lo)
            idx = self.cut.index(i, lo, hi)
            keep = np.ones(hi - lo, bool)
            for s, e in self.skip[i]:  # replicated over tp: tp rank 0 saves them
                keep[max(s, lo) - lo : max(min(e, hi), lo) - lo] = False
            ranges.append(runs(idx[keep]))
            params = u.master[u.lo : u.hi] if o.mode == "ddp" else u.shard  # the masters
            a = self.S.opt_range(i)[0]
            tensors[i, "param"] = params[: hi - lo][keep]
            tensors[i, "exp_avg"] = self.opt.m[i][lo - a : hi - a][keep]
            tensors[i, "exp_avg_sq"] = self.opt.v[i][lo - a : hi - a][keep]
        meta = checkpoint.describe(self.cfg, o, self.n, self.step, self.opt.t)
        args = (Path(o.out), self.step, self.comm, self.layouts, ranges, tensors, meta, self.tokenizer)
        if background:  # the values above are copies (boolean indexing): training may go on
            self.pending = checkpoint.Background(*args)
            return Path(o.out) / f"step-{self.step:06d}"
        return checkpoint.save(*args)

    def poll_save(self) -> None:
        """Collective: complete a background checkpoint if every rank has written its file."""
        if self.pending is not None and self.pending.ready():
            self.finish_save()

    def finish_save(self) -> Path | None:
        """Collective: wait for a background checkpoint (if any) and make it the latest."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None

    # ---------------------------------------------------------------- a run
    def fit(self) -> Path | None:
        """Train up to ``steps``: progress bar and JSONL log on rank 0, eval and checkpoints
        when asked, the final checkpoint and loss.png in ``out``. Returns the checkpoint."""
        o, r0 = self.o, self.comm is None or self.comm.rank == 0
        if self.step >= o.steps:
            if r0:
                print(
                    f"mpitp train: the checkpoint is at step {self.step}, --steps is {o.steps}: nothing to do",
                    file=sys.stderr,
                )
            return None
        if r0:
            log.info(self._summary())
        jsonl, bar = None, None
        if r0 and o.log:
            Path(o.log).parent.mkdir(parents=True, exist_ok=True)
            if o.resume:
                reached = trim_log(Path(o.log), self.step)
                if reached > self.step:  # a run that failed after its last checkpoint
                    log.warning(
                        f"resuming at step {self.step}: the log had reached step {reached}, "
                        f"so {reached - self.step} step(s) are done again"
                    )
            jsonl = open(o.log, "a" if o.resume else "w")
        if r0 and o.progress:  # a bar on a terminal, plain lines in a file (a SLURM .out)
            bar = Progress(o.steps, "train", "step", initial=self.step)
        try:
            while self.step < o.steps:
                rec = self.train_step()
                if o.eval_every and (self.step % o.eval_every == 0 or self.step == o.steps):
                    rec["eval_loss"] = self.eval_loss()
                t = time.perf_counter()
                self.poll_save()
                if o.out and o.save_every and self.step % o.save_every == 0 and self.step < o.steps:
                    self.save(background=o.background_save)
                rec["save_s"] = time.perf_counter() - t  # what checkpoints cost the training thread
                if self.comm is not None:  # the busiest rank's bytes (the log is rank 0's)
                    rec["sent_bytes_max"] = self.comm.allreduce_object(rec["sent_bytes"], op="max")
                self.history.append(rec)
                if jsonl:
                    jsonl.write(json.dumps(rec) + "\n")
                    jsonl.flush()
                if bar is not None:
                    bar.update(1, loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        finally:
            if bar is not None:
                bar.close()
            if jsonl:
                jsonl.close()
        final_eval = self.eval_loss()
        where = None
        if o.out:
            where = self.save()
            if r0:
                from .plot import plot_loss

                history = self.history
                if o.log and Path(o.log).exists():  # after a resume: the whole run
                    history = [json.loads(line) for line in open(o.log) if line.strip()]
                plot_loss(history, Path(o.out) / "loss.png")
        if r0:
            last = self.history[-1]
            tps = sorted(h["tokens_per_s"] for h in self.history[1:] or self.history)
            log.info(
                f"step {self.step}: train loss {last['loss']:.4f}"
                + (f", eval loss {final_eval:.4f}" if final_eval is not None else "")
                + f", median {tps[len(tps) // 2]:.0f} tokens/s"
                + (f"; checkpoint {where}" if where else "")
            )
        return where

    def _summary(self) -> str:
        o, mem = self.o, self.memory()
        return (
            f"train {o.mode} on {self.world} rank(s)"
            + (f" (mesh dp {self.n} x tp {o.tp})" if o.tp > 1 else "")
            + f": {mem['psi'] / 1e6:.2f}M parameters, "
            f"{self.windows.count} windows of {o.seq}+1 tokens, global batch {o.batch}, steps {self.step}->{o.steps}; "
            f"held per rank {mem['total'] / 2**20:.1f} MiB (params {mem['params'] / 2**20:.1f}, "
            f"grads {mem['grads'] / 2**20:.1f}, AdamW {mem['optimizer'] / 2**20:.1f})"
        )

    def close(self) -> None:
        """Free the mesh's communicators (collective)."""
        if self.mesh is not None:
            self.mesh.free()
            self.mesh = None

    def memory(self) -> dict:
        """Bytes this rank holds between steps, and the ZeRO formula for comparison."""
        held = dict(self.S.persistent_bytes(), optimizer=self.opt.nbytes())
        psi = sum(lay.numel for lay in self.layouts)
        return {**held, "total": sum(held.values()), "psi": psi}


def trim_log(path: Path, step: int) -> int:
    """Keep the records of steps up to ``step`` (the checkpoint a run resumes from) and
    return the last step the log had reached. Rewritten atomically (temp + rename), so a
    run that died after its last checkpoint leaves each step in the log once, as if
    uninterrupted, and a crash here leaves the old log whole. A line cut short by a crash
    mid-write is dropped."""
    if not path.exists():
        return step
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    steps = [_step_of(line) for line in lines]
    keep = [line for line, s in zip(lines, steps) if s is not None and s <= step]
    if len(keep) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return max([s for s in steps if s is not None], default=step)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
