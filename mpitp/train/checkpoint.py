"""Sharded, atomic, reshardable training checkpoints, and export to Hugging Face.

    OUT/step-000100/meta.json              step, config, mode, mesh, each unit's tensors
                                           and each rank's runs, optimizer and data state,
                                           sha256 of every file
    OUT/step-000100/rank00003.safetensors  rank 3's elements of every unit: u{i}.param,
                                           u{i}.exp_avg, u{i}.exp_avg_sq
    OUT/step-000100/tokenizer.json
    OUT/latest                             name of the newest complete checkpoint

Every rank writes its file into a temporary directory; rank 0 writes meta.json last, then
renames the directory into place and only then updates ``latest`` (both renames atomic),
so a crash mid-save leaves the previous checkpoint as it was. :class:`Background` does
the writing in a thread on every rank while training goes on. Positions are in the whole
model's unpadded flat buffer of each unit, whatever the mesh: a rank's elements of unit i
are the concatenation of its runs ``[start, end)`` (one run under FSDP alone; one per row
of a column-cut tensor under tensor parallelism), every element saved by exactly one
rank. So a run saved on one mesh resumes on any other: each rank reads the pieces of the
old runs that overlap what it needs (safetensors slices).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..models.config import LlamaConfig
from ..models.loader import CheckpointError  # one error for every checkpoint, read or written
from .layout import UnitLayout

FORMAT = "mpitp-train-1"
KINDS = ("param", "exp_avg", "exp_avg_sq")  # what each rank's file holds of every unit


def key(unit: int, kind: str) -> str:
    """The safetensors name of a rank's values of ``kind`` of unit ``unit``."""
    return f"u{unit}.{kind}"


def describe(cfg: LlamaConfig, options, dp: int, step: int, adam_t: int) -> dict:
    """meta.json's account of the run (:func:`save` adds the format, units and ranks):
    ``options`` is the run's :class:`~mpitp.train.options.Options`."""
    o = options
    return {
        "config": cfg.to_dict(),
        "mode": o.mode,
        "mesh": {"dp": dp, "tp": o.tp},
        "dtype": o.dtype,
        "optimizer": {"t": adam_t, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        "data": {"step": step, "batch": o.batch, "seq": o.seq, "shuffle": o.shuffle},
        # nothing draws random numbers after initialisation: the seeds are the whole state
        "rng": {"init_seed": o.seed, "shuffle_seed": o.shuffle},
        "options": asdict(o),
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def agree(comm, err: Exception | None, what: str) -> None:
    """Raise the same error on every rank if any rank failed (``Communicator.agree``)."""
    if comm is not None:
        comm.agree(err, what, CheckpointError)
    elif err is not None:
        raise CheckpointError(f"{what}: {err}")


def save(
    out: Path,
    step: int,
    comm,
    layouts: list[UnitLayout],
    ranges: list[list[list[int]]],
    tensors: dict[tuple[int, str], np.ndarray],
    meta: dict,
    tokenizer: Path | None = None,
) -> Path:
    """Collective. ``ranges[i]`` are this rank's [start, end) runs of unit i (whole model,
    unpadded); ``tensors`` maps ``(i, kind)`` to this rank's values over those runs, in
    order. ``layouts`` are the whole model's units; ``meta`` is :func:`describe`'s."""
    tmp = _begin(out, step, comm)
    written, err = None, None
    try:
        written = _write(tmp, comm.rank if comm is not None else 0, tensors)
    except OSError as e:
        err = e
    return _finish(out, step, comm, layouts, ranges, meta, tokenizer, tmp, written, err)


class Background:
    """A checkpoint written while training goes on (collective to start and to finish).

    Every rank hands over copies of its values; a thread writes, fsyncs and checksums the
    rank's file into the temporary directory (no MPI in the thread). :meth:`ready` asks
    all ranks whether their files are down; :meth:`finish` then does what :func:`save`
    does last: rank 0 writes meta.json, renames the directory into place and updates
    ``latest``. Until then the previous checkpoint is the latest, so a crash during the
    write leaves it usable."""

    def __init__(self, out: Path, step: int, comm, layouts, ranges, tensors, meta, tokenizer=None):
        import threading

        self.args = (out, step, comm, layouts, ranges, meta, tokenizer)
        self.comm, self.step = comm, step
        self.tmp = _begin(out, step, comm)
        self.written: tuple[str, str] | None = None
        self.err: Exception | None = None
        rank = comm.rank if comm is not None else 0
        self.thread = threading.Thread(target=self._run, args=(rank, tensors), name=f"checkpoint-{step}", daemon=True)
        self.thread.start()

    def _run(self, rank: int, tensors) -> None:
        try:
            self.written = _write(self.tmp, rank, tensors)
        except Exception as e:  # reported on every rank by finish()
            self.err = e

    def ready(self) -> bool:
        """Collective: has every rank's thread finished writing?"""
        done = not self.thread.is_alive()
        return done if self.comm is None else self.comm.all_true(done)

    def finish(self) -> Path:
        """Collective: wait for the writes, then make the checkpoint the latest."""
        self.thread.join()
        out, step, comm, layouts, ranges, meta, tokenizer = self.args
        return _finish(out, step, comm, layouts, ranges, meta, tokenizer, self.tmp, self.written, self.err)


def _begin(out: Path, step: int, comm) -> Path:
    """The empty temporary directory of checkpoint ``step`` (made by rank 0; collective)."""
    tmp = out / f".step-{step:06d}.tmp"
    err = None
    try:
        if comm is None or comm.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except OSError as e:
        err = e
    agree(comm, err, f"cannot create {tmp}")
    return tmp


def _write(tmp: Path, rank: int, tensors: dict[tuple[int, str], np.ndarray]) -> tuple[str, str]:
    """This rank's file, on disk (fsynced): (its name, its sha256). No MPI: any thread."""
    from safetensors.numpy import save_file

    fname = f"rank{rank:05d}.safetensors"
    save_file({key(*k): np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / fname))
    with open(tmp / fname, "rb+") as f:
        os.fsync(f.fileno())
    return fname, sha256(tmp / fname)


def _finish(out, step, comm, layouts, ranges, meta, tokenizer, tmp, written, err) -> Path:
    """Collective: every rank's error or file; rank 0 writes meta.json last, renames the
    directory into place, then points ``latest`` at it."""
    n = comm.size if comm is not None else 1
    agree(comm, err, f"saving {tmp}")
    every = [(*written, ranges)] if comm is None else comm.gather_object((*written, ranges))
    name = f"step-{step:06d}"
    final = out / name
    if comm is None or comm.rank == 0:
        try:
            full = dict(
                meta,
                format=FORMAT,
                step=step,
                world_size=n,
                units=[
                    {
                        "name": u.name,
                        "numel": u.numel,
                        "tensors": [[t.key, t.name, list(t.shape), t.offset] for t in u.tensors],
                    }
                    for u in layouts
                ],
                ranks=[{"file": f, "sha256": d, "ranges": rg} for f, d, rg in every],
            )
            if tokenizer is not None and Path(tokenizer).exists():
                shutil.copyfile(tokenizer, tmp / "tokenizer.json")
            (tmp / "meta.json").write_text(json.dumps(full, indent=1))
            _fsync_dir(tmp)
            if final.exists():  # saving the same step again
                old = out / f".{name}.old"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            (out / "latest.tmp").write_text(name + "\n")
            (out / "latest.tmp").rename(out / "latest")
            _fsync_dir(out)
        except OSError as e:
            err = e
    agree(comm, err, f"finishing checkpoint {final}")
    return final


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a training output directory (its ``latest``)."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    if (path / "latest").exists():
        return path / (path / "latest").read_text().strip()
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    raise CheckpointError(f"{path} holds no complete checkpoint (no meta.json, no 'latest')")


class Reader:
    """Reads any range of any unit from a checkpoint written at any N."""

    def __init__(self, path: Path):
        self.path = resolve(path)
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path / 'meta.json'}: unreadable ({e})") from None
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: not an mpitp training checkpoint (format {self.meta.get('format')!r})")
        self.config = LlamaConfig.from_dict(self.meta["config"])
        self._verified: set[str] = set()

    def progress(self) -> tuple[int, int]:
        """(steps done, AdamW's step count) when it was saved."""
        return int(self.meta["step"]), int(self.meta["optimizer"]["t"])

    def _open(self, rank_entry: dict):
        from safetensors import safe_open

        f = self.path / rank_entry["file"]
        if f.name not in self._verified:
            if not f.exists():
                raise CheckpointError(f"{f}: missing")
            if sha256(f) != rank_entry["sha256"]:
                raise CheckpointError(f"{f}: checksum mismatch (the file is corrupt or was changed after saving)")
            self._verified.add(f.name)
        try:
            return safe_open(str(f), framework="numpy")
        except Exception as e:
            raise CheckpointError(f"{f}: unreadable safetensors ({e})") from None

    def read(self, unit: int, kind: str, lo: int, hi: int, dtype) -> np.ndarray:
        """Values of ``kind`` of unit ``unit`` over [lo, hi) of the unpadded flat buffer."""
        out = np.zeros(max(hi - lo, 0), dtype)
        for entry in self.meta["ranks"]:
            rg = entry["ranges"][unit]
            if rg and isinstance(rg[0], int):  # one [lo, hi) per unit (mpitp before 2-D meshes)
                rg = [rg]
            pos, pieces = 0, []  # (where in the rank's tensor, where in out, length)
            for a, b in rg:
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    pieces.append((pos + s - a, s - lo, e - s))
                pos += b - a
            if not pieces:
                continue
            first, last = pieces[0][0], max(p + n for p, _, n in pieces)
            with self._open(entry) as h:
                span = h.get_slice(key(unit, kind))[first:last]
            for p, o, n in pieces:
                out[o : o + n] = span[p - first : p - first + n]
        return out


def export_hf(ckpt: Path, out: Path) -> Path:
    """A Hugging Face directory (config.json, model.safetensors, tokenizer.json)."""
    from safetensors.numpy import save_file

    r = Reader(ckpt)
    tensors = {}
    for i, unit in enumerate(r.meta["units"]):
        flat = r.read(i, "param", 0, unit["numel"], np.float32)
        for _key, name, shape, off in unit["tensors"]:
            tensors[name] = flat[off : off + int(np.prod(shape))].reshape(shape)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = r.config.to_dict()
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if (r.path / "tokenizer.json").exists():
        shutil.copyfile(r.path / "tokenizer.json", out / "tokenizer.json")
    return out
