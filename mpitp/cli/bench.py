"""``mpitp bench COLLECTIVE``: nccl-tests / OSU style rows for every algorithm, side by side;
``mpitp bench decode``: a model's decode step at batch 1-16 against the bandwidth ceiling."""

from __future__ import annotations

import json
import sys

import numpy as np

from ..bench import collectives as bc
from ..models.config import ConfigError
from .options import add_parallel_arguments, add_weights_argument, apply_threads, check_parallel, load_options

EPILOG = """\
columns: size and count of the buffer, dtype, reduction op, algorithm, time of one call
(average over ranks; min/max over ranks as in OSU), algbw = size/time, busbw = algbw x
factor (allreduce 2(n-1)/n; reduce_scatter, allgather, alltoall (n-1)/n; others 1) as in
nccl-tests, #wrong elements (with --check), and the speed relative to MPI's own call
(mpi4py called directly, measured in the same run). The header names the ring's
transport on this machine (shared memory, cross-memory attach or MPI, by size); the
closing lines give each algorithm's average busbw and, for the largest size, its share
of a memcpy timed between the same trials.

examples:
  mpiexec -n 2 mpitp bench allreduce --algorithms mpi,ring,auto --check
  mpiexec -n 4 mpitp bench allgather --min-bytes 1K --max-bytes 64M --json ag.json --plot ag.png
  mpiexec -n 2 mpitp bench allreduce --tune          # measure crossovers for algorithm='auto'
  mpiexec -n 2 mpitp bench decode --weights auto     # the default model's decode step, batch 1-16

decode: one decode step (every rank's forward of one token per row) at batch 1, 2, 4, 8
and 16, the slowest rank's median; its ratio to batch 1, tokens/s, and the share of the
read ceiling (every rank reading at once, measured in the same run) that the bytes each step streams reach.
--model and --weights as mpitp generate takes them.
"""


TUNABLE = ("allreduce", "reduce_scatter")  # collectives whose auto picks by a size crossover


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark a collective for every algorithm (nccl-tests/OSU style)",
        description="Benchmark one collective across message sizes for every algorithm "
        "mpitp has, against MPI's own call, in one run.",
        epilog=EPILOG,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument("collective", choices=(*bc.COLLECTIVES, "decode"), help="a collective, or decode (a model)")
    p.add_argument(
        "--min-bytes",
        default=4,
        type=_size,
        help="smallest message (4, 1K, 64M, 8MB ...: K/M/G and "
        "KiB/MiB/GiB are powers of 1024, KB/MB/GB of 1000; "
        "default 4)",
    )
    p.add_argument("--max-bytes", default=64 << 20, type=_size, help="largest message (default 64M)")
    p.add_argument("--factor", type=float, default=4.0, help="size multiplier between rows (default 4)")
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed calls per trial (default: by size, 1000 for small messages down to 5)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before the first trial (default 2)")
    p.add_argument(
        "--trials",
        type=int,
        default=5,
        help="timed repetitions, interleaved across algorithms; the median counts (default 5)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        type=_dtype,
        help="element type: float32 (default), float64, float16, bfloat16, int32, ...",
    )
    p.add_argument(
        "--op",
        default="sum",
        choices=["sum", "avg", "prod", "max", "min", "band", "bor", "bxor"],
        help="reduction (default sum; avg for floating types, band/bor/bxor for integers)",
    )
    p.add_argument(
        "--algorithms",
        default=None,
        help="comma list among mpi, ring, auto, hierarchical ... (an entry the collective does not "
        "have is an error; default: those of mpi, ring, auto that it has)",
    )
    p.add_argument("--check", action="store_true", help="count wrong elements in each row")
    p.add_argument("--inplace", action="store_true", help="in-place allreduce/reduce")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="buffers on the host or on a GPU (CuPy)")
    p.add_argument("--json", metavar="FILE", help="write the rows as a JSON list (decode: the figures as an object)")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (needs matplotlib)")
    p.add_argument(
        "--tune",
        action="store_true",
        help="allreduce, reduce_scatter: measure where the ring overtakes MPI and write the "
        "tuning file that algorithm='auto' reads",
    )
    p.add_argument("--model", help="decode: as mpitp generate takes it (default: the embedded model)")
    p.add_argument(
        "--shape",
        choices=["llama-3.2-1b", "llama-3.2-3b", "qwen3-0.6b", "qwen3-30b-a3b"],
        help="decode: a model of this shape with random weights (written once into the cache as a GGUF "
        "file llama.cpp loads too; the default model's tokenizer, padded with unused tokens to the shape's "
        "vocabulary), in the file type --weights names",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="decode --shape: only the shape's first N layers (qwen3-30b-a3b's 48 layers are ~17 GB in "
        "Q4_K_M; 12 are ~4.7 GB)",
    )
    add_weights_argument(
        p, ("q4_0", "q4_k_m"), "; with --shape: the file's type, q4_0 (default), q4_k_m or q8_0, kept as stored"
    )
    add_parallel_arguments(p)  # decode
    p.add_argument(
        "--tune-file", default=None, help="where --tune writes (default: MPITP_TUNING or ~/.config/mpitp/tuning.json)"
    )


def _dtype(text: str) -> str:
    from argparse import ArgumentTypeError

    from ..comm.mpi_types import SUPPORTED

    if text not in SUPPORTED:
        raise ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(SUPPORTED)}")
    return text


def _size(text) -> int:
    from argparse import ArgumentTypeError

    from ..units import parse_size

    try:
        return text if isinstance(text, int) else parse_size(text, "message size")
    except ValueError as e:
        raise ArgumentTypeError(str(e)) from None


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(comm, collective: str, max_bytes: int) -> str | None:
    """Refuse before allocating when the largest row cannot fit on this node."""
    per_rank = max_bytes * (4 if collective in ("allgather", "gather", "alltoall") else 3)
    need = per_rank * comm.topology.local_size
    avail = _available_bytes()
    if avail is not None and need > 0.8 * avail:
        return (
            f"--max-bytes {bc.human(max_bytes)} needs about {bc.human(need)} on this node "
            f"({comm.topology.local_size} rank(s) x {bc.human(per_rank)}) but only {bc.human(avail)} is "
            "available; lower --max-bytes"
        )
    return None


def _transports(comm) -> str:
    """What the ring's messages travel over on this machine, by size (collective: the CMA
    probe reads each rank's neighbour on its node)."""
    from mpi4py import MPI

    from ..comm.transport import cma

    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        ok = cma.works(node)[0] if node.size > 1 else True
        one_node = comm.allreduce_object(node.size, op="min") == comm.size
    finally:
        node.Free()
    ok = comm.all_true(ok)
    where = "one node" if one_node else "within a node"
    small = f"shared memory up to {bc.human(comm.shm_max_bytes)}" if comm.shm else "MPI point-to-point"
    if not comm.cma:
        large = "MPI point-to-point above (MPITP_CMA=0)"
    elif ok:
        large = "cross-memory attach above"
    else:
        large = "MPI point-to-point above (cross-memory attach not permitted here)"
    tail = "" if one_node else "; MPI point-to-point between nodes"
    return f"{where}: {small}, {large}{tail}"


def _xp(device: str):
    if device == "cpu":
        return np
    try:
        import cupy
    except ImportError:
        raise SystemExit("mpitp bench: --device cuda needs CuPy (pip install 'mpitp[cuda12]')") from None
    return cupy


def run(args) -> int:
    from ..comm import Communicator

    with Communicator() as comm:  # freed however the command ends
        if args.collective == "decode":
            from ..bench import decode

            model, weights = args.model, args.weights
            apply_threads(args)
            check_parallel(args, comm.size)
            if args.shape:
                ftype = "q4_0" if weights == "auto" else weights
                model, weights = _shape_file(comm, args.shape, ftype, args.layers), "auto"
            elif weights in ("q4_0", "q4_k_m"):
                raise ConfigError(f"--weights {weights} names a --shape file's type; give --shape")
            say = print if comm.rank == 0 else (lambda *a, **k: None)
            res = decode.run(comm, model, load_options(args, weights=weights, dtype="float32", device="cpu"), say=say)
            if args.json and comm.rank == 0:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
            return 0
        return _bench(args, comm)


def _shape_file(comm, shape: str, ftype: str, layers: int | None = None) -> str:
    """Rank 0 writes the shape's file (once); every rank gets its path."""
    from ..bench import shapes

    if ftype == "float32":
        raise ConfigError("--shape files are q4_0, q4_k_m or q8_0")
    err, path = None, None
    if comm.rank == 0:
        try:
            path = str(shapes.ensure(shape, ftype, layers=layers))
        except (OSError, RuntimeError, ValueError) as e:
            err = str(e)
    err, path = comm.bcast_object((err, path))
    if err:
        raise ConfigError(err)
    return path


def _bench(args, comm) -> int:
    from ..comm.algorithms.tuning import library_version

    r0 = comm.rank == 0
    say = (lambda *a, **k: print(*a, **k, flush=True)) if r0 else (lambda *a, **k: None)
    lo, hi = args.min_bytes, args.max_bytes
    try:
        across = comm.topology.num_nodes > 1 and args.collective == "allreduce"  # tune the two-level one
        algs = (
            ["mpi", "hierarchical" if across else "ring"]
            if args.tune
            else bc.algorithms_for(args.collective, args.algorithms)
        )
    except ValueError as e:
        say(f"mpitp bench: {e}", file=sys.stderr)
        return 2
    if args.tune and args.collective not in TUNABLE:
        say(f"mpitp bench: --tune applies to {' and '.join(TUNABLE)} (where auto chooses by size)", file=sys.stderr)
        return 2
    problem = _check_memory(comm, args.collective, hi)
    if problem:
        say(f"mpitp bench: {problem}", file=sys.stderr)
        return 2
    xp = _xp(args.device)
    sz = bc.sizes(lo, hi, args.factor)
    memcpy = bc.memcpy_bandwidth(min(max(hi, 1 << 20), 64 << 20), comm=comm.mpi)
    memcpy = float(np.mean(comm.allgather_object(memcpy)))
    lib = library_version()
    say(f"# mpitp bench {args.collective}: {comm.size} rank(s), {args.dtype}, {lib}")
    say(f"# single-core memcpy bandwidth (same run, all ranks copying): {memcpy:.2f} GB/s  <- ceiling")
    transports = _transports(comm) if comm.size > 1 else "none (one rank)"
    say(f"# ring transport ({transports})")
    say(
        f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'algorithm':>10} {'time(us)':>10} "
        f"{'min(us)':>9} {'max(us)':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'vs MPI':>7}"
    )
    rows: list[bc.Row] = []
    for i, nbytes in enumerate(sz):
        last = i == len(sz) - 1
        found, ref, copy = bc.measure_size(
            comm,
            args.collective,
            nbytes,
            algs,
            dtype=args.dtype,
            op=args.op,
            iters=args.iters,
            warmup=args.warmup,
            check=args.check,
            inplace=args.inplace,
            xp=xp,
            trials=args.trials,
            reference=True,
            memcpy=last and args.device == "cpu",
        )
        for alg, row in zip(algs, found):
            rows.append(row)
            rel = f"{ref / (row.time_us * 1e-6):6.2f}x" if ref else "      -"
            wrong = "-" if row.wrong is None else str(row.wrong)
            say(
                f"  {bc.human(row.size_bytes):>10} {row.count:>10} {row.dtype:>8} {row.op:>6} {alg:>10} "
                f"{row.time_us:10.1f} {row.min_us:9.1f} {row.max_us:9.1f} {row.algbw_gbs:7.3f} "
                f"{row.busbw_gbs:7.3f} {wrong:>6} {rel:>7}"
            )
        if ref:
            rows.append(
                bc.Row(
                    args.collective,
                    "mpi4py",
                    nbytes,
                    nbytes // np.dtype(args.dtype).itemsize,
                    args.dtype,
                    args.op,
                    comm.size,
                    ref * 1e6,
                    ref * 1e6,
                    ref * 1e6,
                    nbytes / ref / 1e9,
                    nbytes / ref / 1e9 * bc.BUSBW[args.collective](comm.size),
                    None,
                )
            )
        if r0 and nbytes >= (1 << 20):
            print(f"[mpitp bench] {i + 1}/{len(sz)} sizes done ({bc.human(nbytes)})", file=sys.stderr, flush=True)
    for alg in algs:
        mine = [r.busbw_gbs for r in rows if r.algorithm == alg]
        say(f"# Avg bus bandwidth ({alg}): {np.mean(mine):.3f} GB/s")
    if copy:  # the ceiling again, timed between the largest size's trials
        share = ", ".join(f"{r.algorithm} {100 * r.busbw_gbs / copy:.0f}%" for r in found)
        say(
            f"# memcpy of {bc.human(sz[-1])} timed between those trials: {copy:.2f} GB/s; "
            f"busbw at {bc.human(sz[-1])} as a share of it: {share}"
        )
    if any(r.wrong for r in rows):
        say("# WRONG RESULTS: see the #wrong column", file=sys.stderr)
    if r0:
        data = [dict(r.to_dict(), memcpy_gbs=memcpy) for r in rows]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
        if args.plot:
            from ..bench.plot import busbw_plot

            busbw_plot(data, memcpy, args.plot, f"{args.collective}, {comm.size} ranks, {lib}")
    if args.tune:
        from ..comm.algorithms import tuning

        nodes = comm.topology.num_nodes if args.collective == "allreduce" else 1
        path = tuning.write_crossover(args.tune_file, args.collective, comm.size, rows, nodes) if r0 else None
        say(f"# tuning written to {path}")
    bad = comm.allreduce_object(sum(r.wrong or 0 for r in rows))
    return 1 if bad else 0
