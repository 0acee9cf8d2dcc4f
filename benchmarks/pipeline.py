"""Pipeline stages against tensor parallelism across two real nodes, in one run (root).

    bin/mpitp-minicluster up --nodes 2 --link 1gbit
    python benchmarks/pipeline.py [--model DIR] [--dllama DIR]

On the one-machine cluster (bin/mpitp-minicluster: network namespaces, a shaped link per
node; these kernels have no netem, so no latency is added), one rank a node:

* one stream, ``--tokens`` tokens after "Once upon a time" (end-of-text ignored): one rank
  alone on one node, P = 2 (``--pp 2``: a stage a node) and T = 2 (tensor parallelism
  across the nodes), tokens/s as ``mpitp generate`` reports it, medians of alternating
  rounds; and the bytes each layout puts on the link per token: each node's eth0 tx bytes
  over a run of ``--tokens`` less those of a run of 16, over the difference in tokens
  (start-up and prefill cancel out);
* ``mpitp serve`` as P = 2 and as T = 2, 1 client and 8 concurrent clients (the 8 prompts
  of benchmarks/serve.py as plain completions, greedy, ``--max-tokens`` each; llama_cpp.py's
  load), output tokens/s;
* with ``--dllama``: distributed-llama's root on node 1 and a worker on node 2, 1 thread
  each, its model converted by benchmarks/dllama.py, its "Prediction" tokens/s.
"""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(ROOT / "bin" / "mpitp-minicluster")]
BIN = Path(sys.executable).parent
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", PATH=f"{BIN}:{os.environ['PATH']}")
ENV.pop("MPITP_RANKS_PER_NODE", None)
PROMPT = "Once upon a time"
sys.path.insert(0, str(Path(__file__).parent))
from llama_cpp import load  # noqa: E402  (8 concurrent clients, as against llama-server)


def cluster_cmd(n: int, ppn: int, *command: str) -> list[str]:
    out = subprocess.run(
        TOOL + ["exec", "-n", str(n), "-ppn", str(ppn), "--print", "--", *command],
        capture_output=True,
        text=True,
        env=ENV,
        check=True,
    )
    return shlex.split(out.stdout)


def counters() -> dict:
    return json.loads(subprocess.run(TOOL + ["counters"], capture_output=True, text=True, check=True).stdout)


def generate(n: int, model: str, tokens: int, *extra: str) -> tuple[float, int]:
    """(decode tokens/s, bytes both nodes sent over their links during the run)."""
    argv = ["mpitp", "generate", "--no-chat", "--model", model, "--prompt", PROMPT, "--max-new-tokens", str(tokens)]
    argv += ["--stop", "999999999", *extra]
    before = counters()
    res = subprocess.run(cluster_cmd(n, 1, *argv), capture_output=True, text=True, env=ENV, timeout=1200)
    after = counters()
    hit = re.search(r"decode \d+ tokens at ([\d.]+) tokens/s", res.stderr)
    if res.returncode or not hit:
        raise RuntimeError(res.stderr[-3000:])
    wire = sum(after[k]["tx_bytes"] - before[k]["tx_bytes"] for k in after)
    return float(hit.group(1)), wire


def serve(model: str, max_tokens: int, *extra: str) -> dict:
    host, port = "10.213.0.11", 18500 + os.getpid() % 1000  # rank 0 on node 1
    argv = ["mpitp", "serve", "--model", model, "--host", "0.0.0.0", "--port", str(port), "--max-batch", "8", *extra]
    proc = subprocess.Popen(
        cluster_cmd(2, 1, *argv), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    url = f"http://{host}:{port}"
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode()[-3000:]) from None  # type: ignore[union-attr]
                time.sleep(0.25)
        return {n: load(url, n, max_tokens, chat=False) for n in (1, 8)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def dllama(dl: Path, model: Path, tokens: int) -> float:
    sys.path.insert(0, str(Path(__file__).parent))
    from dllama import converted

    m, t = converted(dl, model, Path(os.path.expanduser("~/.cache/mpitp/dllama")))
    worker = subprocess.Popen(
        ["ip", "netns", "exec", "mtp-n2", str(dl / "dllama"), "worker", "--port", "9998", "--nthreads", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        time.sleep(1.0)
        cmd = ["ip", "netns", "exec", "mtp-n1", str(dl / "dllama"), "inference", "--model", str(m), "--tokenizer",
               str(t), "--buffer-float-type", "q80", "--prompt", PROMPT, "--steps", str(tokens), "--nthreads", "1",
               "--workers", "10.213.0.12:9998"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        hit = re.search(r"Prediction\s+nTokens:\s*\d+\s+tokens/s:\s*([\d.]+)", out.stdout)
        if not hit:
            raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
        return float(hit.group(1))
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def main() -> int:
    from mpitp.models import resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an mpitp model directory (default: the default model)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32, help="per server request (default 32)")
    ap.add_argument("--dllama", help="distributed-llama's repository, built (make dllama)")
    ap.add_argument("--no-server", action="store_true", help="leave out the servers")
    ap.add_argument("--no-stream", action="store_true", help="leave out the one-stream runs")
    a = ap.parse_args()
    model = a.model or str(resolve.model_dir(None, None))
    layouts = {"one rank": (1, ()), "P=2": (2, ("--pp", "2")), "T=2": (2, ())}
    rates: dict[str, list[float]] = {k: [] for k in layouts}
    for _ in range(0 if a.no_stream else a.rounds):
        for k, (n, extra) in layouts.items():
            rates[k].append(generate(n, model, a.tokens, *extra)[0])
    wire = {}
    for k, (n, extra) in layouts.items() if not a.no_stream else ():
        short, long = generate(n, model, 16, *extra)[1], generate(n, model, a.tokens, *extra)[1]
        wire[k] = (long - short) / (a.tokens - 16)
    print(f"# {Path(model).name}: one rank a node, two nodes; {a.tokens} tokens; medians of {a.rounds} rounds")
    alone = median(rates["one rank"]) if not a.no_stream else 0.0
    for k in layouts if not a.no_stream else ():
        r = median(rates[k])
        print(f"{k:<9} one stream: {r:6.1f} tok/s ({', '.join(f'{x:.1f}' for x in rates[k])}; {r / alone:.2f}x one "
              f"rank), {wire[k]:,.0f} bytes per token on the links")  # fmt: skip
    if wire.get("P=2"):
        print(f"T=2 / P=2 bytes per token on the links: {wire['T=2'] / wire['P=2']:.1f}x")
    if not a.no_server:
        served = {}
        for k, extra in (("P=2", ("--pp", "2")), ("T=2", ())):
            r = served[k] = serve(model, a.max_tokens, *extra)
            print(f"serve {k}: 1 client {r[1]:.1f} tok/s, 8 clients {r[8]:.1f} tok/s ({r[8] / r[1]:.2f}x)")
        print(f"serve, 8 clients: P=2 / T=2 = {served['P=2'][8] / served['T=2'][8]:.2f}x")
    if a.dllama:
        print(
            f"distributed-llama root + worker, 1 thread each: {dllama(Path(a.dllama), Path(model), a.tokens):.1f} tok/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
