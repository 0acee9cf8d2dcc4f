"""``mpitp train``: FSDP / ZeRO / DDP training of a LLaMA-family model on N ranks."""

from __future__ import annotations

import argparse

from ..train.options import Options, add_arguments

EXAMPLE = """examples:
  mpiexec -n 2 mpitp train --config small --data-default --mode fsdp --steps 200 --out runs/small
  mpiexec -n 4 mpitp train --init default --data notes.txt --lr 1e-5 --steps 50 --out runs/ft
  mpiexec -n 3 mpitp train --resume runs/small --steps 400      # continue at another N
  mpiexec -n 4 mpitp train --config small --data-default --tp 2 --mode fsdp --out runs/2d   # TP 2 x FSDP 2
  mpitp export runs/small hf-small                                # a Hugging Face directory"""


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
    add_arguments(p)  # one flag per field of mpitp.train.options.Options


def run(args) -> int:
    from ..comm import Communicator
    from ..train.trainer import Trainer

    opts = Options.from_args(args)
    with Communicator() as comm:  # freed however the command ends
        t = Trainer(opts, comm)
        try:
            t.fit()
        finally:
            t.close()
    return 0
