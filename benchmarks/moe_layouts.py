"""Decode steps of a mixture of experts in its two layouts across ranks (and nodes), in one
run: tp attention with the experts cut as --moe auto cuts them (two all-reduces a layer)
against data-parallel attention (each rank decodes its own rows; each MoE layer reaches the experts by
all-to-all). tp is run twice: greedy (each rank's argmax of its shard of the vocabulary,
as greedy rows take their tokens) and with the logits all-gathered (as sampled rows need
them: V·4 bytes a row); dp twice too, greedy and sampled at temperature 1 (its head's
vocabulary cut over the ranks: the rows all-gathered, each rank's candidate and mass back,
:mod:`mpitp.tp.dp_head`). Prints tokens/s of each (the same rows in all: ``--batch`` in all,
batch / p a rank under dp), rounds alternated, and the bytes each rank sent a token by the
traffic counters beside ``mpitp plan infer``'s expectation under uniform routing (which
counts the logits' all-gather).

    bin/mpitp-minicluster up --nodes 2 --link 1gbit
    bin/mpitp-minicluster exec -n 2 -ppn 1 -- python benchmarks/moe_layouts.py \\
        --model ~/.cache/mpitp/models/qwen3-30b-a3b-12l-q4_k_m-5045267712 --batch 8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

# one BLAS thread a rank (as mpitp's launcher gives every rank): the one-machine cluster's
# exec passes the caller's environment, and OpenBLAS's own threads on the 2 cores the ranks
# share made a step of 8 rows ~6x slower
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import mpitp  # noqa: E402
from mpitp.models.llama import LlamaForCausalLM  # noqa: E402
from mpitp.models.loader import LoadOptions  # noqa: E402


def steps(model, rows: int, n: int, comm, seed: int, how: str) -> tuple[float, int]:
    """Seconds a decode step of ``rows`` rows (the slowest rank's), and the bytes this rank sent
    (``how``: greedy, the next tokens as greedy rows take them; logits, the whole logits as
    tensor parallelism samples; sampled, dp's vocabulary-cut head drawing at temperature 1)."""
    cache = model.new_cache(max(rows, 1), 64 + n)
    cache.valid[:] = True
    rng = np.random.default_rng(seed + comm.rank)
    ids = rng.integers(0, 1000, (rows, 1))

    def one():
        pos = np.full((rows, 1), cache.length)
        out = model.forward(ids, pos, cache, last_only=True, greedy=how == "greedy", hidden=how == "sampled")
        if how == "sampled":
            model.lm_head.pick(out[:, -1], np.ones(rows), rng.random((rows, 2)))

    for _ in range(3):
        one()
    comm.barrier()
    comm.traffic.reset()
    t = time.perf_counter()
    for _ in range(n):
        one()
    comm.barrier()
    return (time.perf_counter() - t) / n, comm.traffic.total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory (an imported GGUF's, or safetensors)")
    ap.add_argument("--batch", type=int, default=8, help="rows decoded a step, in all (default 8)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    comm = mpitp.Communicator()
    p, say = comm.size, (print if comm.rank == 0 else lambda *a, **k: None)
    if args.batch % p:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {p} ranks")
    layouts = {  # (dp attention, how the next tokens are taken)
        "tp attention, experts auto, greedy": (False, "greedy"),
        "tp attention, experts auto, logits": (False, "logits"),
        "dp attention, all-to-all, greedy": (True, "greedy"),
        "dp attention, all-to-all, sampled": (True, "sampled"),
    }
    times: dict[str, list[float]] = {n: [] for n in layouts}
    sent: dict[str, int] = {}
    config = None
    for r in range(args.rounds):  # alternated; one model loaded at a time (loading peaks at ~3x its weights)
        for name, (dp, how) in layouts.items():
            moe = "ep" if dp else "auto"  # dp reaches whole experts; tp attention takes --moe's default
            model = LlamaForCausalLM.from_pretrained(args.model, comm, LoadOptions(moe=moe, dp_attention=dp))
            rows = args.batch // p if dp else args.batch
            t, b = steps(model, rows, args.steps, comm, r, how)
            times[name].append(comm.allreduce_object(t, op="max"))
            sent[name] = comm.allreduce_object(b, op="max") // args.steps
            config = model.config
            del model
            gc.collect()
    from mpitp.plan import infer

    nodes = comm.topology.num_nodes
    plan = infer.moe(config, p, nodes, args.batch)
    runs = f"{args.steps} steps x {args.rounds} rounds"
    say(f"# {args.model}: {p} ranks on {nodes} node(s), batch {args.batch} in all, {runs}")
    base = None
    for name in layouts:
        tok = args.batch / statistics.median(times[name])
        base = base or tok
        per_tok = sent[name] / args.batch * p  # all ranks' bytes a token (every rank alike)
        say(f"{name:<38} {tok:8.1f} tok/s ({', '.join(f'{args.batch / t:.1f}' for t in times[name])}) "
            f"{tok / base:.2f}x; sent {per_tok / 1e6:.3f} MB a token, all ranks")  # fmt: skip
    b = plan["bytes_per_token"]
    tp, greedy, dp = (sum(b[k].values()) / 1e6 for k in ("tp", "tp_greedy", "dp"))
    say(f"plan infer (uniform routing): tp {greedy:.3f} MB greedy, {tp:.3f} MB with the logits, "
        f"dp {dp:.3f} MB a token, all ranks")  # fmt: skip
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
