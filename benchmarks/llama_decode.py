"""Prefill time and decode tokens/s: mpitp TP=1 and TP=2 against Hugging Face
transformers (torch, CPU) on the same random-weight checkpoint, in one run.

    pip install torch==2.13.0 transformers          # the reference
    mpiexec -n 2 python benchmarks/llama_decode.py --shape 56m
    mpiexec -n 2 python benchmarks/llama_decode.py --shape tinyllama-1.1b

Shapes: 56m = hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1376, vocab 32000;
tinyllama-1.1b = hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632.
Every figure is the median of --repeats runs (default 3). Threads: each mpitp rank runs one BLAS thread; transformers runs with 1 thread and with
2 (the total of TP=2). The memory-bandwidth ceiling is the weight bytes one rank streams
per token divided by the GEMV bandwidth measured here, in this run, on one core.
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
    "56m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1376, vocab_size=32000),
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=32000),
}


def make_checkpoint(shape: str, root: Path) -> Path:
    d = root / shape
    if (d / "config.json").exists():
        return d
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=False,
                                   eos_token_id=None, bos_token_id=None)
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


def run_mpitp(path, comm, prompt, new, repeats):
    from mpitp.models.llama import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, comm=comm)
    model.generate([prompt], max_new_tokens=4, stop_tokens=[])          # warm-up
    runs = []
    for _ in range(repeats):
        model.generate([prompt], max_new_tokens=new, stop_tokens=[])
        runs.append(dict(model.last_stats))
    s = median_stats(runs)
    s["weight_bytes"] = model.weight_bytes()
    s["streamed_bytes"] = model.streamed_bytes()
    return s


def run_hf(path, prompt, new, threads, repeats):
    import torch
    import transformers
    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    runs = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
            decode = max(time.perf_counter() - t0 - prefill, 1e-9)
            runs.append({"prefill_s": prefill, "decode_tokens_per_s": (new - 1) / decode})
    return median_stats(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="56m")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians are reported")
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
    # the ceiling: one core streaming alone (TP=1) and both cores at once (TP=2), which share
    # the memory bus
    res["gemv_GBps_1"] = world.bcast(gemv_bandwidth(world.rank == 0) / 1e9)
    res["gemv_GBps"] = world.allreduce(gemv_bandwidth(True), op=MPI.MIN) / 1e9
    # TP=2 on both ranks
    comm = mpitp.Communicator()
    res["mpitp_tp2"] = run_mpitp(path, comm, prompt, args.new_tokens, args.repeats)
    comm.free()
    # TP=1 on rank 0 (rank 1 idles), then transformers on rank 0 with 1 and 2 threads
    solo = world.Split(world.rank, 0)
    if world.rank == 0:
        c1 = mpitp.Communicator(solo)
        res["mpitp_tp1"] = run_mpitp(path, c1, prompt, args.new_tokens, args.repeats)
        c1.free()
        try:
            res["hf_1thread"] = run_hf(path, prompt, args.new_tokens, 1, args.repeats)
            res["hf_2threads"] = run_hf(path, prompt, args.new_tokens, 2, args.repeats)
        except ImportError:
            res["hf_1thread"] = res["hf_2threads"] = None
    solo.Free()
    req = world.Ibarrier()          # rank 1 sleeps instead of spinning in MPI while rank 0 measures
    while not req.Test():
        time.sleep(0.01)
    if world.rank == 0:
        report(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def report(r: dict) -> None:
    tp1, tp2, h1, h2 = r["mpitp_tp1"], r["mpitp_tp2"], r["hf_1thread"], r["hf_2threads"]
    print(f"# {r['shape']}: prompt {r['prompt_tokens']} tokens, {r['new_tokens']} new; GEMV {r['gemv_GBps_1']:.1f} GB/s "
          f"on one core alone, {r['gemv_GBps']:.1f} GB/s per core with both streaming")
    print(f"{'run':<24} {'prefill ms':>11} {'decode tok/s':>13} {'ms/token':>9} {'weights/rank MiB':>17}")
    rows = [("mpitp TP=1 (1 rank)", tp1), ("mpitp TP=2 (2 ranks)", tp2)]
    if h1:
        rows += [("transformers 1 thread", h1), ("transformers 2 threads", h2)]
    for name, s in rows:
        wb = f"{s['weight_bytes'] / 2**20:.0f}" if "weight_bytes" in s else "-"
        print(f"{name:<24} {s['prefill_s'] * 1e3:>11.1f} {s['decode_tokens_per_s']:>13.1f} "
              f"{1e3 / s['decode_tokens_per_s']:>9.2f} {wb:>17}")
    ceiling = tp2["streamed_bytes"] / (r["gemv_GBps"] * 1e9)
    print(f"memory-bandwidth ceiling at TP=2: {ceiling * 1e3:.2f} ms/token "
          f"({tp2['streamed_bytes'] / 2**20:.0f} MiB of weights read per token per rank / GEMV bandwidth); measured {1e3 / tp2['decode_tokens_per_s']:.2f} ms/token = "
          f"{(1 / tp2['decode_tokens_per_s']) / ceiling:.2f}x the ceiling")
    c1 = tp1["streamed_bytes"] / (r["gemv_GBps_1"] * 1e9)
    print(f"memory-bandwidth ceiling at TP=1: {c1 * 1e3:.2f} ms/token; measured {1e3 / tp1['decode_tokens_per_s']:.2f} "
          f"ms/token = {(1 / tp1['decode_tokens_per_s']) / c1:.2f}x the ceiling")
    print(f"TP=2 vs TP=1 decode: {tp2['decode_tokens_per_s'] / tp1['decode_tokens_per_s']:.2f}x "
          f"(bandwidth bound: {2 * r['gemv_GBps'] / r['gemv_GBps_1']:.2f}x at most on this machine)")
    if h1:
        print(f"TP=2 vs transformers decode: {tp2['decode_tokens_per_s'] / h1['decode_tokens_per_s']:.2f}x (1 thread), "
              f"{tp2['decode_tokens_per_s'] / h2['decode_tokens_per_s']:.2f}x (2 threads); "
              f"prefill TP=2 vs transformers 2 threads: {h2['prefill_s'] / tp2['prefill_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
