"""Everything a training run is told, in one dataclass; ``mpitp train``'s flags come from
its fields (``--grad-accum`` is ``grad_accum``), so the CLI, the Python API and the
checkpoint's ``options`` never disagree on a name or a default."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from ..errors import MpitpError
from .sharding import MODES

MODEL, DATA, OPTIM, OUTPUT = "model (one of)", "data", "optimization", "output"


class TrainError(MpitpError, ValueError):
    """The training arguments cannot work."""


def _betas(s: str) -> tuple:
    try:
        b1, b2 = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas takes two numbers like 0.9,0.95, got {s!r}") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"--betas must lie in [0, 1), got {s!r}")
    return b1, b2


def opt(default, group: str, help: str, **argparse_kw):
    """A field that is also a flag of ``mpitp train`` (in ``group``)."""
    return field(default=default, metadata=dict(group=group, help=help, **argparse_kw))


@dataclass
class Options:
    config: str | None = opt(None, MODEL, "tiny | small | a config.json: train from scratch")
    init: str | None = opt(
        None,
        MODEL,
        "a model to fine-tune, named as --model of generate and serve (a checkpoint directory, a .gguf file, "
        "org/name from the local Hugging Face cache), or 'default' (the embedded SmolLM2-135M)",
    )
    resume: str | None = opt(None, MODEL, "a checkpoint (or an --out directory: its latest), at any N")
    data: str | None = opt(
        None,
        DATA,
        "text file (tokenized with the model's tokenizer, or a BPE trained on it), .npy of ids, "
        "or .bin of uint16 ids (nanoGPT / llm.c)",
    )
    data_default: bool = opt(False, DATA, "Python's own documentation text (no download)", action="store_true")
    seq: int = opt(128, DATA, "tokens per sequence (default 128)", type=int)
    batch: int = opt(8, DATA, "GLOBAL batch in sequences (default 8)", type=int)
    grad_accum: int = opt(1, DATA, "micro-batches per step (default 1)", type=int)
    shuffle: int | None = opt(None, DATA, "permute the windows with this seed", type=int, metavar="SEED")
    eval_every: int = opt(0, DATA, "eval loss on the held-out tail every K steps", type=int)
    eval_fraction: float = opt(0.05, DATA, "held-out tail of the data (default 0.05)", type=float)
    eval_batches: int = 4  # global batches of the held-out tail per evaluation (no flag)
    mode: str = opt("fsdp", OPTIM, "across the dp groups (default fsdp)", choices=MODES)
    tp: int = opt(
        1,
        OPTIM,
        "tensor-parallel size T (default 1): the ranks form a (N/T) x T mesh, tp groups of consecutive "
        "ranks inside a node; attention is cut by KV heads (T <= KV heads), the MLP by columns, the "
        "vocabulary by rows; --mode shards each rank's slices over its dp group",
        type=int,
    )
    steps: int = opt(100, OPTIM, "steps to reach (default 100; counted from 0, also when resuming)", type=int)
    lr: float = opt(3e-4, OPTIM, "peak learning rate (default 3e-4)", type=float)
    min_lr: float | None = opt(None, OPTIM, "cosine floor (default lr/10)", type=float)
    schedule: str = opt("cosine", OPTIM, "learning-rate schedule (default cosine)", choices=["constant", "cosine"])
    warmup: int = opt(0, OPTIM, "linear warmup steps", type=int)
    weight_decay: float = opt(0.1, OPTIM, "on >=2-D weights only (default 0.1)", type=float)
    betas: tuple = opt((0.9, 0.95), OPTIM, "AdamW betas (default 0.9,0.95)", type=_betas)
    eps: float = opt(1e-8, OPTIM, "AdamW epsilon (default 1e-8)", type=float)
    grad_clip: float = opt(1.0, OPTIM, "global norm (0 = off; default 1.0)", type=float)
    recompute: bool = opt(False, OPTIM, "recompute each layer's activations in backward", action="store_true")
    dtype: str = opt("float32", OPTIM, "parameters, gradients and AdamW state", choices=["float32", "float64"])
    param_dtype: str | None = opt(
        None,
        OPTIM,
        "mixed precision (FSDP2's param_dtype): the type parameters are gathered and used in; the "
        "masters and AdamW stay --dtype; with --tp the activations' all-reduces carry it too "
        "(default: --dtype; bfloat16 halves those bytes)",
        choices=["float32", "bfloat16"],
    )
    reduce_dtype: str | None = opt(
        None,
        OPTIM,
        "the type gradients are reduced in (FSDP2's reduce_dtype; default: --dtype)",
        choices=["float32", "bfloat16"],
    )
    seed: int = opt(0, OPTIM, "initialisation seed", type=int)
    algorithm: str = opt("auto", OPTIM, "collective algorithm (auto, mpi, ring)")
    out: str | None = opt(
        None, OUTPUT, "directory for checkpoints, the log and loss.png (default with --resume: the resumed run's)"
    )
    save_every: int = opt(0, OUTPUT, "checkpoint every K steps (and at the end)", type=int)
    background_save: bool = opt(
        True,
        OUTPUT,
        "write the --save-every checkpoints before training goes on (default: a thread on each rank "
        "writes them while the next steps run; the last one is always written before the end)",
        action="store_false",
        flag="--sync-save",
    )
    log: str | None = opt(None, OUTPUT, "JSONL file: one object per step (default OUT/log.jsonl)")
    progress: bool = opt(True, OUTPUT, "no progress bar", action="store_false", flag="--no-progress")

    def check(self, world: int) -> None:
        """Raise a TrainError naming the flag when the options cannot work on ``world`` ranks."""
        if self.tp < 1 or world % self.tp:
            raise TrainError(f"--tp {self.tp} must divide the {world} rank(s)")
        if self.mode not in MODES:
            raise TrainError(f"--mode {self.mode!r}: choose {', '.join(MODES)}")
        for name in ("steps", "batch", "seq", "grad_accum"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "float64"):
            raise TrainError(f"--dtype {self.dtype!r}: float32 or float64")
        if not 0 <= self.eval_fraction < 1:
            raise TrainError(f"--eval-fraction must lie in [0, 1), got {self.eval_fraction}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        """The options of parsed flags; with --resume and no --out, the run keeps writing
        where it lives; the log defaults to OUT/log.jsonl."""
        o = cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.metadata})
        if o.resume and not o.out:
            from .checkpoint import resolve

            o.out = str(resolve(Path(o.resume)).parent)
        if o.log is None and o.out:
            o.log = str(Path(o.out) / "log.jsonl")
        return o


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``mpitp train``'s flags, one per field of :class:`Options`, in their groups."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(Options):
        if not f.metadata:
            continue
        kw = dict(f.metadata)
        group = groups.setdefault(kw.pop("group"), p.add_argument_group(f.metadata["group"]))
        name = kw.pop("flag", "--" + f.name.replace("_", "-"))
        default = f.default if f.default is not MISSING else None
        group.add_argument(name, dest=f.name, default=default, **kw)
