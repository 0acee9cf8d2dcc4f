"""Training throughput: mpitp's four modes against PyTorch's own trainers, in one run.

    pip install torch==2.13.0 transformers          # the peers
    python benchmarks/train.py                       # starts every launch itself
    python benchmarks/train.py --ranks 1,2 --rounds 3 --steps 10

Shape: ``--config small`` (hidden 256, 4 layers, 4 heads, intermediate 672, vocab 4096,
untied), seq 128, global batch 8, one BLAS thread per rank, the same random token windows.
Contenders, each started under ``mpiexec -n N``: mpitp fsdp / zero2 / ddp, torch FSDP2
(``fully_shard`` on every decoder layer and the root, gloo) and torch DDP (gloo). Each
round runs every contender once (interleaved, so the machine's slow spells hit all alike);
a figure is the median over rounds of each run's median step after the first. Columns:
tokens/s, peak RSS per rank (largest rank), and where an mpitp step goes: exposed
communication (waiting on a gather or reduction), the optimizer and parameter sync, and
forward/backward compute with its Python.
"""

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from mpitp import launch  # noqa: E402
from mpitp.train.presets import PRESETS  # noqa: E402

SMALL = PRESETS["small"]  # the torch peers build the same shape

MPITP = textwrap.dedent("""
    import json, resource, sys, numpy as np, mpitp
    from mpitp.train.trainer import Options, Trainer
    mode, data, steps, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    comm = mpitp.Communicator()
    t = Trainer(Options(config="small", data=data, mode=mode, steps=steps, batch=batch, seq=seq, eval_fraction=0), comm)
    recs = [t.train_step() for _ in range(steps)][1:]
    rss = comm.allreduce_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op="max")
    med = lambda k: float(np.median([r[k] for r in recs]))
    if comm.rank == 0:
        print("RESULT" + json.dumps(dict(tokens_per_s=batch * seq / med("step_s"), step_s=med("step_s"),
              comm_s=med("comm_wait_s"), opt_s=med("optimizer_s"), rss_mib=rss / 1024, loss=recs[-1]["loss"],
              held_mib=t.memory()["total"] / 2**20)))
""")

TORCH = textwrap.dedent("""
    import json, os, resource, sys, time, numpy as np, torch, torch.distributed as dist, transformers
    from mpi4py import MPI
    kind, data, port = sys.argv[1], sys.argv[2], sys.argv[6]
    steps, batch, seq = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    shape = json.loads(sys.argv[7])
    torch.set_num_threads(1)
    w = MPI.COMM_WORLD
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=w.rank, world_size=w.size)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    stream = np.load(data)
    count = (len(stream) - 1) // seq
    q, r = divmod(batch, w.size); lo = w.rank * q + min(w.rank, r); hi = lo + q + (w.rank < r)
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        idx = ((k * batch + np.arange(batch)) % count)[lo:hi]
        rows = torch.tensor(np.stack([stream[i * seq:i * seq + seq + 1] for i in idx]))
        logits = model(rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    rss = w.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX)
    med = float(np.median(times[1:]))
    if w.rank == 0:
        print("RESULT" + json.dumps(dict(tokens_per_s=batch * seq / med, step_s=med, rss_mib=rss / 1024)))
    dist.destroy_process_group()
""")


def run_one(name: str, n: int, data: Path, a, port: int) -> dict | None:
    common = [str(data), str(a.steps), str(a.batch), str(a.seq)]
    if name.startswith("mpitp"):
        argv = [sys.executable, "-c", MPITP, name.split()[1]] + common
    else:
        argv = [sys.executable, "-c", TORCH, name.split()[1]] + common + [str(port), json.dumps(SMALL)]
    res = launch.run(n, argv, timeout=600, env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    if res.returncode != 0 or "RESULT" not in res.stdout:
        print(f"  {name} at N={n} failed ({res.returncode}): {res.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    return json.loads(res.stdout.split("RESULT", 1)[1].splitlines()[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--no-torch", action="store_true")
    a = p.parse_args()
    import numpy as np

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        have_torch = not a.no_torch
    except ImportError:
        have_torch = False
        print("(torch/transformers not installed: mpitp rows only)", file=sys.stderr)
    ranks = [int(x) for x in a.ranks.split(",")]
    names = ["mpitp fsdp", "mpitp zero2", "mpitp ddp"] + (["torch fsdp2", "torch ddp"] if have_torch else [])
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "ids.npy"
        np.save(data, np.random.default_rng(0).integers(0, SMALL["vocab_size"], 200_000))
        results: dict = {}
        port = 29500 + os.getpid() % 1000
        for rnd in range(a.rounds):
            for n in ranks:
                for name in names:
                    port += 1
                    r = run_one(name, n, data, a, port)
                    if r:
                        results.setdefault((name, n), []).append(r)
            print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    med = {k: {f: float(np.median([r[f] for r in v])) for f in v[0]} for k, v in results.items()}
    print(f"\nsmall config, seq {a.seq}, global batch {a.batch}, 1 BLAS thread per rank, median of {a.rounds} rounds")
    print(
        f"{'contender':<13} {'N':>2} {'tokens/s':>9} {'vs N=1':>7} {'step ms':>8} {'exposed comm':>13} "
        f"{'optim+sync':>11} {'fwd/bwd':>8} {'peak RSS/rank':>14}"
    )
    for name in names:
        for n in ranks:
            r = med.get((name, n))
            if not r:
                continue
            one = med.get((name, 1))
            speedup = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one else "-"
            if "comm_s" in r:
                rest = r["step_s"] - r["comm_s"] - r["opt_s"]
                split = f"{r['comm_s'] * 1e3:10.1f} ms {r['opt_s'] * 1e3:8.1f} ms {rest * 1e3:6.1f} ms"
            else:
                split = f"{'-':>13} {'-':>11} {'-':>8}"
            print(
                f"{name:<13} {n:>2} {r['tokens_per_s']:9.0f} {speedup:>7} {r['step_s'] * 1e3:8.1f} {split} "
                f"{r['rss_mib']:10.0f} MiB"
            )
    for n in ranks:
        f, t, d = med.get(("mpitp fsdp", n)), med.get(("torch fsdp2", n)), med.get(("mpitp ddp", n))
        if f and t:
            print(f"N={n}: mpitp fsdp / torch FSDP2 = {f['tokens_per_s'] / t['tokens_per_s']:.2f}x", end="")
        if f and d:
            print(f"; mpitp fsdp step / mpitp ddp step = {f['step_s'] / d['step_s']:.2f}x", end="")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
