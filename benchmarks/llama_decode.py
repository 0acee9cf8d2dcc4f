"""Prefill time and decode tokens/s: mpitp TP=1 and TP=2 against Hugging Face
transformers (torch, CPU) on the same random-weight checkpoint, in one run.

    pip install torch==2.13.0 transformers          # the reference
    mpiexec -n 2 python benchmarks/llama_decode.py --shape 56m
    mpiexec -n 2 python benchmarks/llama_decode.py --shape tinyllama-1.1b

Shapes: 56m = hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376, vocab 32000;
tinyllama-1.1b = hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632.
Every figure is the median of --repeats rounds (default 3); each round runs every
contender once, so the machine's slow spells hit all of them alike. Threads: each mpitp
rank runs one BLAS thread; transformers runs with 1 thread and with 2 (the total of TP=2).
The memory-bandwidth ceiling is the weight bytes one rank streams per token divided by
the GEMV bandwidth measured here, in this run, on one core.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

SHAPES = {
    "56m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1376,
        vocab_size=32000,
    ),
    "tinyllama-1.1b": dict(
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        vocab_size=32000,
    ),
}


def make_checkpoint(shape: str, root: Path) -> Path:
    d = root / shape
    if (d / "config.json").exists():
        return d
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None
    )
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(d, safe_serialization=True)
    return d


def gemv_bandwidth(active: bool, seconds: float = 1.0) -> float:
    """Weight bytes per second x @ W streams on this core for one token (fp32, 256 MB W,
    sustained for ``seconds``); ranks that are not ``active`` sleep meanwhile."""
    W = np.random.default_rng(0).standard_normal((8192, 8192), dtype=np.float32)
    x = np.ones((1, 8192), np.float32)
    MPI.COMM_WORLD.Barrier()
    if not active:
        time.sleep(seconds + 0.5)
        return 0.0
    x @ W
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        x @ W
        n += 1
    return n * W.nbytes / (time.perf_counter() - t0)


def median_stats(runs: list[dict]) -> dict:
    """Per-key median over repeated runs (this machine's timings are noisy)."""
    return {k: float(np.median([r[k] for r in runs])) for k in ("prefill_s", "decode_tokens_per_s")}


class Mpitp:
    """An mpitp model kept loaded, so the rounds below can come back to it."""

    def __init__(self, path, comm):
        from mpitp.models.llama import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(path, comm=comm)
        self.runs: list[dict] = []

    def run(self, prompt, new: int, warm: bool = False) -> None:
        self.model.generate([prompt], max_new_tokens=4 if warm else new, stop_tokens=[])
        if not warm:
            self.runs.append(dict(self.model.last_stats))

    def stats(self) -> dict:
        s = median_stats(self.runs)
        s["weight_bytes"] = self.model.weight_bytes()
        s["streamed_bytes"] = self.model.streamed_bytes()
        return s


class Transformers:
    """Hugging Face transformers on torch CPU with a fixed thread count."""

    def __init__(self, path, threads: int):
        import torch
        import transformers

        self.torch, self.threads = torch, threads
        self.model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.runs: list[dict] = []

    def run(self, prompt, new: int, warm: bool = False) -> None:
        torch = self.torch
        torch.set_num_threads(self.threads)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if warm:
                self.model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
                return
            t0 = time.perf_counter()
            self.model(ids)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
            decode = max(time.perf_counter() - t0 - prefill, 1e-9)
        self.runs.append({"prefill_s": prefill, "decode_tokens_per_s": (new - 1) / decode})

    def stats(self) -> dict:
        return median_stats(self.runs)


def idle_until_rank0_done(world) -> None:
    """Rank 1 sleeps (instead of spinning in MPI) while rank 0 measures alone."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="56m")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--repeats", type=int, default=3, help="measured rounds (each runs every contender once); medians are reported"
    )
    ap.add_argument("--models", default=os.environ.get("MPITP_BENCH_MODELS", "/tmp/mpitp-bench-models"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import mpitp

    world = MPI.COMM_WORLD
    if world.size != 2:
        print("run with mpiexec -n 2", file=sys.stderr)
        return 2
    path = make_checkpoint(args.shape, Path(args.models)) if world.rank == 0 else None
    path = world.bcast(str(path) if path else None)
    prompt = list(np.random.default_rng(1).integers(0, SHAPES[args.shape]["vocab_size"], args.prompt_tokens))
    prompt = [int(t) for t in prompt]
    res = {"shape": args.shape, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
    # Rounds: each measures the GEMV ceiling (one core streaming alone, then both cores at
    # once, which share the memory bus), mpitp TP=2 on both ranks, then on rank 0 alone
    # mpitp TP=1 and transformers with 1 and 2 threads. Interleaving the runs lets a slow
    # spell of this shared machine hit every contender alike; medians per contender.
    comm = mpitp.Communicator()
    tp2 = Mpitp(path, comm)
    solo = world.Split(world.rank, 0)
    others = []
    if world.rank == 0:
        others.append(("mpitp_tp1", Mpitp(path, mpitp.Communicator(solo))))
        try:
            others += [("hf_1thread", Transformers(path, 1)), ("hf_2threads", Transformers(path, 2))]
        except ImportError:
            print("transformers is not installed: comparing mpitp with itself only", file=sys.stderr)
    gemv1, gemv2 = [], []
    for k in range(args.repeats + 1):  # round 0 warms every contender up
        warm = k == 0
        if not warm:
            gemv1.append(world.bcast(gemv_bandwidth(world.rank == 0) / 1e9))
            gemv2.append(world.allreduce(gemv_bandwidth(True), op=MPI.MIN) / 1e9)
        tp2.run(prompt, args.new_tokens, warm)
        if world.rank == 0:
            for _, contender in others:
                contender.run(prompt, args.new_tokens, warm)
        idle_until_rank0_done(world)
        if world.rank == 0 and not warm:
            print(f"[llama_decode] round {k}/{args.repeats} done", file=sys.stderr, flush=True)
    res["gemv_GBps_1"], res["gemv_GBps"] = float(np.median(gemv1)), float(np.median(gemv2))
    res["mpitp_tp2"] = tp2.stats()
    res["hf_1thread"] = res["hf_2threads"] = None
    for name, contender in others:
        res[name] = contender.stats()
    del tp2, others
    solo.Free()
    comm.free()
    if world.rank == 0:
        report(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def report(r: dict) -> None:
    tp1, tp2, h1, h2 = r["mpitp_tp1"], r["mpitp_tp2"], r["hf_1thread"], r["hf_2threads"]
    print(
        f"# {r['shape']}: prompt {r['prompt_tokens']} tokens, {r['new_tokens']} new; GEMV {r['gemv_GBps_1']:.1f} GB/s "
        f"on one core alone, {r['gemv_GBps']:.1f} GB/s per core with both streaming"
    )
    print(f"{'run':<24} {'prefill ms':>11} {'decode tok/s':>13} {'ms/token':>9} {'weights/rank MiB':>17}")
    rows = [("mpitp TP=1 (1 rank)", tp1), ("mpitp TP=2 (2 ranks)", tp2)]
    if h1:
        rows += [("transformers 1 thread", h1), ("transformers 2 threads", h2)]
    for name, s in rows:
        wb = f"{s['weight_bytes'] / 2**20:.0f}" if "weight_bytes" in s else "-"
        print(
            f"{name:<24} {s['prefill_s'] * 1e3:>11.1f} {s['decode_tokens_per_s']:>13.1f} "
            f"{1e3 / s['decode_tokens_per_s']:>9.2f} {wb:>17}"
        )
    ceiling = tp2["streamed_bytes"] / (r["gemv_GBps"] * 1e9)
    print(
        f"memory-bandwidth ceiling at TP=2: {ceiling * 1e3:.2f} ms/token "
        f"({tp2['streamed_bytes'] / 2**20:.0f} MiB of weights read per token per rank / GEMV bandwidth); "
        f"measured {1e3 / tp2['decode_tokens_per_s']:.2f} ms/token = "
        f"{(1 / tp2['decode_tokens_per_s']) / ceiling:.2f}x the ceiling"
    )
    c1 = tp1["streamed_bytes"] / (r["gemv_GBps_1"] * 1e9)
    print(
        f"memory-bandwidth ceiling at TP=1: {c1 * 1e3:.2f} ms/token; measured {1e3 / tp1['decode_tokens_per_s']:.2f} "
        f"ms/token = {(1 / tp1['decode_tokens_per_s']) / c1:.2f}x the ceiling"
    )
    print(
        f"TP=2 vs TP=1 decode: {tp2['decode_tokens_per_s'] / tp1['decode_tokens_per_s']:.2f}x "
        f"(bandwidth bound: {2 * r['gemv_GBps'] / r['gemv_GBps_1']:.2f}x at most on this machine)"
    )
    if h1:
        print(
            f"TP=2 vs transformers decode: {tp2['decode_tokens_per_s'] / h1['decode_tokens_per_s']:.2f}x (1 thread), "
            f"{tp2['decode_tokens_per_s'] / h2['decode_tokens_per_s']:.2f}x (2 threads); "
            f"prefill TP=2 vs transformers 2 threads: {h2['prefill_s'] / tp2['prefill_s']:.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
