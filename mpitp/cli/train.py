"""``mpitp train``: FSDP / ZeRO / DDP training of a LLaMA-family model on N ranks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..log import get_logger
from ..train.sharding import MODES
from ..train.trainer import Options

log = get_logger("train")

EXAMPLE = """examples:
  mpiexec -n 2 mpitp train --config small --data-default --mode fsdp --steps 200 --out runs/small
  mpiexec -n 4 mpitp train --init default --data notes.txt --lr 1e-5 --steps 50 --out runs/ft
  mpiexec -n 3 mpitp train --resume runs/small --steps 400      # continue at another N
  mpiexec -n 4 mpitp train --config small --data-default --tp 2 --mode fsdp --out runs/2d   # TP 2 x FSDP 2
  mpitp export runs/small hf-small                                # a Hugging Face directory"""


def _betas(s: str) -> tuple:
    try:
        b1, b2 = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas takes two numbers like 0.9,0.95, got {s!r}") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"--betas must lie in [0, 1), got {s!r}")
    return b1, b2


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train or fine-tune with FSDP (ZeRO-3), ZeRO-1/2 or DDP across the ranks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLE,
        description="Train a LLaMA-family model on N ranks (mpiexec -n N). Each decoder layer, the embedding "
        "and the head are flat units cut over the ranks; --mode picks what is sharded (ddp: nothing, "
        "zero1: AdamW state, zero2: + gradients, fsdp: + parameters, gathered per unit). --batch is "
        "the GLOBAL batch in sequences, so the same command at any N trains on the same data. Rank 0 "
        "shows a progress bar; --out gets checkpoints, the log and loss.png.",
    )
    src = p.add_argument_group("model (one of)")
    src.add_argument("--config", help="tiny | small | a config.json: train from scratch")
    src.add_argument(
        "--init", help="a Hugging Face checkpoint directory to fine-tune, or 'default' (the embedded SmolLM2-135M)"
    )
    src.add_argument("--resume", help="a checkpoint (or an --out directory: its latest), at any N")
    d = p.add_argument_group("data")
    d.add_argument(
        "--data",
        help="text file (tokenized with the model's tokenizer, or a BPE trained on it), "
        ".npy of ids, or .bin of uint16 ids (nanoGPT / llm.c)",
    )
    d.add_argument("--data-default", action="store_true", help="Python's own documentation text (no download)")
    d.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    d.add_argument("--batch", type=int, default=8, help="GLOBAL batch in sequences (default 8)")
    d.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    d.add_argument("--shuffle", type=int, metavar="SEED", help="permute the windows with this seed")
    d.add_argument("--eval-every", type=int, default=0, help="eval loss on the held-out tail every K steps")
    d.add_argument("--eval-fraction", type=float, default=0.05, help="held-out tail of the data (default 0.05)")
    o = p.add_argument_group("optimization")
    o.add_argument("--mode", default="fsdp", choices=MODES, help="across the dp groups (default fsdp)")
    o.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size T (default 1): the ranks form a (N/T) x T mesh, tp groups of consecutive "
        "ranks inside a node; attention is cut by KV heads (T <= KV heads), the MLP by columns, the "
        "vocabulary by rows; --mode shards each rank's slices over its dp group",
    )
    o.add_argument("--steps", type=int, default=100)
    o.add_argument("--lr", type=float, default=3e-4)
    o.add_argument("--min-lr", type=float, help="cosine floor (default lr/10)")
    o.add_argument("--schedule", default="cosine", choices=["constant", "cosine"])
    o.add_argument("--warmup", type=int, default=0, help="linear warmup steps")
    o.add_argument("--weight-decay", type=float, default=0.1, help="on >=2-D weights only (default 0.1)")
    o.add_argument("--betas", type=_betas, default=(0.9, 0.95), help="AdamW betas (default 0.9,0.95)")
    o.add_argument("--eps", type=float, default=1e-8)
    o.add_argument("--grad-clip", type=float, default=1.0, help="global norm (0 = off; default 1.0)")
    o.add_argument("--recompute", action="store_true", help="recompute each layer's activations in backward")
    o.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    o.add_argument("--seed", type=int, default=0, help="initialisation seed")
    o.add_argument("--algorithm", default="auto", help="collective algorithm (auto, mpi, ring)")
    r = p.add_argument_group("output")
    r.add_argument(
        "--out", help="directory for checkpoints, the log and loss.png (default with --resume: the resumed run's)"
    )
    r.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (and at the end)")
    r.add_argument("--log", help="JSONL file: one object per step (default OUT/log.jsonl)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from ..comm import Communicator
    from ..train.trainer import Trainer, TrainError

    if args.eval_fraction < 0 or args.eval_fraction >= 1:
        raise TrainError(f"--eval-fraction must lie in [0, 1), got {args.eval_fraction}")
    if args.resume and not args.out:  # keep writing where the run lives
        from ..train.checkpoint import resolve

        args.out = str(resolve(args.resume).parent)
    opts = Options(
        config=args.config,
        init=args.init,
        data=args.data,
        data_default=args.data_default,
        mode=args.mode,
        tp=args.tp,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        betas=args.betas,
        eps=args.eps,
        grad_clip=args.grad_clip,
        warmup=args.warmup,
        schedule=args.schedule,
        grad_accum=args.grad_accum,
        recompute=args.recompute,
        out=args.out,
        resume=args.resume,
        save_every=args.save_every,
        eval_every=args.eval_every,
        eval_fraction=args.eval_fraction,
        shuffle=args.shuffle,
        seed=args.seed,
        dtype=args.dtype,
        algorithm=args.algorithm,
        progress=not args.no_progress,
        log=args.log or (str(Path(args.out) / "log.jsonl") if args.out else None),
    )
    with Communicator() as comm:  # freed however the command ends
        t = Trainer(opts, comm)
        try:
            return _loop(t, comm)
        finally:
            t.close()


def _loop(t, comm) -> int:
    o, r0 = t.o, comm.rank == 0
    if t.step >= o.steps:
        if r0:
            print(
                f"mpitp train: the checkpoint is at step {t.step}, --steps is {o.steps}: nothing to do", file=sys.stderr
            )
        return 0
    if r0:
        mem = t.memory()
        log.info(
            f"train {o.mode} on {comm.size} rank(s)"
            + (f" (mesh dp {t.n} x tp {o.tp})" if o.tp > 1 else "")
            + f": {mem['psi'] / 1e6:.2f}M parameters, "
            f"{t.windows.count} windows of {o.seq}+1 tokens, global batch {o.batch}, steps {t.step}->{o.steps}; "
            f"held per rank {mem['total'] / 2**20:.1f} MiB (params {mem['params'] / 2**20:.1f}, "
            f"grads {mem['grads'] / 2**20:.1f}, AdamW {mem['optimizer'] / 2**20:.1f})"
        )
    jsonl = None
    if r0 and o.log:
        Path(o.log).parent.mkdir(parents=True, exist_ok=True)
        jsonl = open(o.log, "a" if o.resume else "w")
    bar = None
    if r0 and o.progress:
        from tqdm import tqdm

        bar = tqdm(total=o.steps, initial=t.step, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    try:
        while t.step < o.steps:
            rec = t.train_step()
            if o.eval_every and (t.step % o.eval_every == 0 or t.step == o.steps):
                rec["eval_loss"] = t.eval_loss()
            t.history.append(rec)
            if jsonl:
                jsonl.write(json.dumps(rec) + "\n")
                jsonl.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
            if o.out and o.save_every and t.step % o.save_every == 0 and t.step < o.steps:
                t.save()
    finally:
        if bar is not None:
            bar.close()
        if jsonl:
            jsonl.close()
    final_eval = t.eval_loss()
    if o.out:
        where = t.save()
        if r0:
            history = t.history
            if o.log and Path(o.log).exists():  # after a resume: the whole run
                history = [json.loads(line) for line in open(o.log) if line.strip()]
            _plot(history, Path(o.out) / "loss.png")
    if r0:
        last = t.history[-1]
        tps = sorted(h["tokens_per_s"] for h in t.history[1:] or t.history)
        log.info(
            f"step {t.step}: train loss {last['loss']:.4f}"
            + (f", eval loss {final_eval:.4f}" if final_eval is not None else "")
            + f", median {tps[len(tps) // 2]:.0f} tokens/s"
            + (f"; checkpoint {where}" if o.out else "")
        )
    return 0


def _plot(history: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss.png (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train")
    ev = [(h["step"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval (held-out tail)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
