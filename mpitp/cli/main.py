"""``mpitp`` entry point. Run subcommands under ``mpiexec -n N`` for N ranks."""

from __future__ import annotations

import argparse
import os
import sys

from .. import failfast
from ..errors import MpitpError
from . import bench, demo, export, generate, info, plan, serve, timeline, train

COMMANDS = {
    "info": info,
    "demo": demo,
    "generate": generate,
    "train": train,
    "export": export,
    "bench": bench,
    "plan": plan,
    "timeline": timeline,
    "serve": serve,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpitp",
        description="Large-model parallelism on MPI. Start ranks with your MPI launcher, e.g. "
        "'mpiexec -n 4 mpitp demo'; every subcommand also runs as a single process.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMANDS.values():
        mod.add_parser(sub)
    for q in sub.choices.values():
        q.add_argument(
            "--log-level",
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            type=str.upper,
            help="log level of every rank (default: INFO on rank 0, WARNING elsewhere; "
            "MPITP_LOG_LEVEL; MPITP_LOG_DIR adds a file per rank)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command not in ("plan", "export") or getattr(args, "plan", None) == "fit":
        from mpi4py import MPI

        from ..launch import check_not_singleton

        problem = check_not_singleton(MPI.COMM_WORLD.size)
        if problem:
            print(problem, file=sys.stderr, flush=True)
            return 2
    from ..log import setup

    setup(level=args.log_level)
    try:
        return int(COMMANDS[args.command].run(args) or 0)
    except MpitpError as e:
        # argument, config and checkpoint errors: said once when every rank has the same;
        # a rank alone with its error aborts the job rather than leave the others waiting
        return failfast.usage_error(str(e), f"mpitp {args.command}")
    except BrokenPipeError:  # `mpitp plan ... | head`: the reader left; stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
