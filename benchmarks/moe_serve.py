"""mpitp serve of a mixture of experts across the one-machine cluster's nodes, two layouts in one
run: tensor-parallel attention (experts as --moe auto cuts them) against --dp-attention (each rank its own
requests, experts by all-to-all). Each layout's server is started across the nodes in turn
(``bin/mpitp-minicluster exec``), driven by N concurrent clients (the official openai client,
plain completions, each client's prompts new; greedy, or sampled with --temperature), rounds alternated; prints output
tokens/s and the bytes that crossed each node's link a generated token (the minicluster's
counters).

    sudo bin/mpitp-minicluster up --nodes 2 --link 1gbit
    python benchmarks/moe_serve.py --model ~/.cache/mpitp/models/qwen3-30b-a3b-12l-q4_k_m-5045267712 --clients 8
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama_cpp import load, wait_ready  # noqa: E402

CLUSTER = str(HERE.parent / "bin" / "mpitp-minicluster")


def link_bytes() -> int:
    """Bytes through every node's link so far (tx + rx of the minicluster's veths)."""
    total = 0
    for dev in os.listdir("/sys/class/net"):
        if dev.startswith("mtp"):
            for d in ("tx_bytes", "rx_bytes"):
                try:
                    total += int(Path(f"/sys/class/net/{dev}/statistics/{d}").read_text())
                except OSError:
                    pass
    return total // 2  # each byte leaves one end and arrives at the other


def serve(model: str, ranks: int, port: int, extra: list[str]):
    argv = [CLUSTER, "exec", "-n", str(ranks), "-ppn", "1", "--", sys.executable, "-m", "mpitp.cli.main", "serve",
            "--model", model, "--host", "0.0.0.0", "--port", str(port), *extra]  # fmt: skip
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ranks", type=int, default=2, help="one a node (default 2)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the clients' temperature (default 0: greedy rows, whose tokens tp takes from each rank's "
        "argmax; above 0 rows are sampled and tp gathers their logits, as for the OpenAI API's default of 1)",
    )
    ap.add_argument("--host", default="10.213.0.11", help="rank 0's node address (the minicluster's first)")
    args = ap.parse_args()
    per_rank = max(1, args.clients // args.ranks)
    layouts = {
        "tp attention, experts auto": ["--max-batch", str(args.clients)],
        "dp attention, experts by all-to-all": ["--dp-attention", "--max-batch", str(per_rank)],
    }
    rates: dict[str, list[float]] = {k: [] for k in layouts}
    moved: dict[str, list[float]] = {k: [] for k in layouts}
    for r in range(args.rounds):
        for name, extra in layouts.items():
            port = 8300 + r * 10 + len(rates[name])
            proc = serve(args.model, args.ranks, port, extra + ["--prefill-pacing", "off"])
            url = f"http://{args.host}:{port}"
            try:
                wait_ready(url + "/health", proc, 600)
                load(url, args.clients, 4, chat=False, temperature=args.temperature)  # warm: every rank's kernels
                before, t = link_bytes(), time.perf_counter()
                rate = load(url, args.clients, args.max_tokens, chat=False, temperature=args.temperature)
                tokens = rate * (time.perf_counter() - t)
                rates[name].append(rate)
                moved[name].append((link_bytes() - before) / max(tokens, 1))
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=120)
    base = statistics.median(rates[next(iter(layouts))])
    print(
        f"# {args.model}: {args.ranks} ranks a node each, {args.clients} clients, {args.max_tokens} tokens each, "
        f"temperature {args.temperature:g}"
    )
    for name in layouts:
        m = statistics.median(rates[name])
        print(f"{name:<38} {m:7.1f} tok/s ({', '.join(f'{x:.1f}' for x in rates[name])}) {m / base:.2f}x; "
              f"{statistics.median(moved[name]) / 1e6:.3f} MB on the links a token")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
