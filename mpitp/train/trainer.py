"""The training loop behind ``mpitp train``: data, units, AdamW, logging, checkpoints.

Every rank runs the same loop (SPMD). Per step: each rank's piece of the global batch in
``grad_accum`` micro-batches through :class:`~mpitp.train.engine.Engine`; the summed loss
and the gradient norm are all-reduced; clipping; AdamW on the owned slices; zero1/zero2
gather the updated parameters. Rank 0 shows progress and writes the log.

With ``--tp T`` the N ranks form a (dp, tp) mesh of N/T x T (tp innermost, inside a
node): the ranks of a tp group share a piece of the batch and hold slices of every
tensor (:mod:`.tp_layout`); ``--mode`` shards those slices over the dp group.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import MpitpError
from . import checkpoint, data
from .engine import Engine
from .init import HFReader, fresh_range, preset_config
from .layout import llama_units
from .optim import AdamW, clip_coefficient, learning_rate
from .sharding import MODES, Sharding
from .tp_layout import TPCut, TPError, gather_whole, runs


class TrainError(MpitpError, ValueError):
    """The training arguments cannot work."""


@dataclass
class Options:
    config: str | None = None  # tiny | small | config.json path
    init: str | None = None  # Hugging Face directory, or "default"
    data: str | None = None
    data_default: bool = False
    mode: str = "fsdp"
    tp: int = 1  # tensor-parallel size: the mesh is (N / tp, tp)
    steps: int = 100
    batch: int = 8  # global batch, in sequences
    seq: int = 128
    lr: float = 3e-4
    min_lr: float | None = None
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup: int = 0
    schedule: str = "cosine"
    grad_accum: int = 1
    recompute: bool = False
    out: str | None = None
    resume: str | None = None
    log: str | None = None
    save_every: int = 0
    eval_every: int = 0
    eval_fraction: float = 0.05
    eval_batches: int = 4
    shuffle: int | None = None
    seed: int = 0
    dtype: str = "float32"
    algorithm: str = "auto"
    progress: bool = True


class Trainer:
    def __init__(self, opts: Options, comm=None):
        self.o, self.comm = opts, comm
        o = opts
        self.world: int = comm.size if comm is not None else 1
        if o.tp < 1 or self.world % o.tp:
            raise TrainError(f"--tp {o.tp} must divide the {self.world} rank(s)")
        if o.mode not in MODES:
            raise TrainError(f"--mode {o.mode!r}: choose {', '.join(MODES)}")
        for name in ("steps", "batch", "seq", "grad_accum"):
            if getattr(o, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(o, name)}")
        if o.dtype not in ("float32", "float64"):
            raise TrainError(f"--dtype {o.dtype!r}: float32 or float64")
        self.dtype = np.dtype(o.dtype)
        self.ckpt = checkpoint.Reader(Path(o.resume)) if o.resume else None
        self.cfg, self.tokenizer = self._model_source()
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
        self.S = Sharding(self.dp, self.local, o.mode, self.dtype, o.algorithm, keep=keep)
        self.engine = Engine(self.cfg, self.S, recompute=o.recompute, cut=self.cut, tp=self.tp)
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

    # ---------------------------------------------------------------- setup
    def _model_source(self):
        o = self.o
        self.init_dir = None
        if self.ckpt is not None:
            tok = self.ckpt.path / "tokenizer.json"
            return self.ckpt.config, (tok if tok.exists() else None)
        if o.init:
            path = Path(o.init)
            if o.init == "default":
                from ..models import default

                found = default.ensure(self.comm)
                if found is None:
                    raise TrainError(f"--init default needs the embedded model: {default.INSTALL}")
                path = found
            if not path.is_dir():
                raise TrainError(f"--init {path}: no such directory")
            from ..models.config import LlamaConfig

            tok = path / "tokenizer.json"
            self.init_dir = path
            return LlamaConfig.from_path(path), (tok if tok.exists() else None)
        if not o.config:
            raise TrainError("say what to train: --config tiny|small|config.json, --init DIR|default, or --resume DIR")
        if o.config not in ("tiny", "small") and not Path(o.config).exists():
            raise TrainError(f"--config {o.config}: not a preset (tiny, small) and no such file")
        return preset_config(o.config), None

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

    def _source(self, i: int, kind: str, dtype, hf: HFReader | None):
        """``read(lo, hi)`` of unit i's whole flat buffer (``kind``: param, exp_avg,
        exp_avg_sq), from the checkpoint, the Hugging Face files or a fresh init."""
        whole = self.layouts[i]
        if self.ckpt is not None:
            ckpt = self.ckpt
            return lambda lo, hi: ckpt.read(i, kind, lo, hi, dtype)
        if hf is not None:
            return lambda lo, hi: hf.read(whole, lo, hi, dtype)
        return lambda lo, hi: fresh_range(whole, i, lo, hi, self.o.seed, dtype)

    def _load_state(self) -> None:
        """Fill this rank's parameters (and moments, when resuming): the elements of the
        whole model's units that its slice and shard hold, read from wherever they lie."""
        fsdp = self.o.mode == "fsdp"
        hf = HFReader(self.init_dir) if self.init_dir is not None else None
        for i, (lay, u) in enumerate(zip(self.local, self.S.units)):
            lo, hi = (u.lo, min(u.hi, lay.numel)) if fsdp else (0, lay.numel)
            dst = u.shard if fsdp else u.full
            if hi > lo:
                dst[: hi - lo] = gather_whole(self._source(i, "param", self.dtype, hf), self.cut.index(i, lo, hi))
            a, b = self.S.opt_range(i)
            b = min(b, lay.numel)
            if self.ckpt is not None and b > a:
                idx = self.cut.index(i, a, b)
                for kind, arr in (("exp_avg", self.opt.m[i]), ("exp_avg_sq", self.opt.v[i])):
                    arr[: b - a] = gather_whole(self._source(i, kind, arr.dtype, None), idx)
        if self.ckpt is not None:
            self.step = int(self.ckpt.meta["step"])
            self.opt.t = int(self.ckpt.meta["optimizer"]["t"])

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
        }

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

    def save(self) -> Path:
        o = self.o
        if not o.out:
            raise TrainError("saving a checkpoint needs an output directory (--out DIR)")
        ranges, tensors = [], {}
        for i, (lay, u) in enumerate(zip(self.local, self.S.units)):
            lo, hi = u.lo, max(min(u.hi, lay.numel), u.lo)
            idx = self.cut.index(i, lo, hi)
            keep = np.ones(hi - lo, bool)
            for s, e in self.skip[i]:  # replicated over tp: tp rank 0 saves them
                keep[max(s, lo) - lo : max(min(e, hi), lo) - lo] = False
            ranges.append(runs(idx[keep]))
            params = u.shard if o.mode == "fsdp" else u.full[u.lo : u.hi]
            a = self.S.opt_range(i)[0]
            tensors[f"u{i}.param"] = params[: hi - lo][keep]
            tensors[f"u{i}.exp_avg"] = self.opt.m[i][lo - a : hi - a][keep]
            tensors[f"u{i}.exp_avg_sq"] = self.opt.v[i][lo - a : hi - a][keep]
        meta = {
            "config": self.cfg.to_dict(),
            "mode": o.mode,
            "mesh": {"dp": self.n, "tp": o.tp},
            "dtype": o.dtype,
            "optimizer": {"t": self.opt.t, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
            "data": {"step": self.step, "batch": o.batch, "seq": o.seq, "shuffle": o.shuffle},
            # nothing draws random numbers after initialisation: the seeds are the whole state
            "rng": {"init_seed": o.seed, "shuffle_seed": o.shuffle},
            "options": asdict(o),
        }
        return checkpoint.save(Path(o.out), self.step, self.comm, self.layouts, ranges, tensors, meta, self.tokenizer)

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
