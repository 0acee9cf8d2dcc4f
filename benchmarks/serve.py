"""mpitp serve under load: N concurrent streaming clients (1, 4, 8, 16) against the same
prompts one at a time, in one run: time to first token, inter-token latency, output
tokens/s. Each round's prompts are new (numbered by round), so the prefix cache holds only
what real traffic shares (the chat template's system prompt), not the previous round's
questions; then the time to first token of a question after a long document an earlier
request sent, with the prefix cache and with it off. Starts the server itself (the
embedded model by default).

    python benchmarks/serve.py --tp 2 --max-tokens 48 --clients 1,8 --rounds 5
"""

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import openai

from mpitp import launch

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain MPI in one paragraph.",
    "List five fruits.",
    "What is tensor parallelism?",
    "Tell a joke about computers.",
    "Describe Paris.",
    "How do rings reduce data?",
    "Name three planets.",
]


def concurrently(fn, n: int) -> float:
    """``fn(0)`` … ``fn(n - 1)``, each in its own thread, all started at once: the wall seconds."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def one(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps = []
    s = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, stream=True
    )
    for ch in s:
        if ch.choices and ch.choices[0].delta.content:
            stamps.append(time.perf_counter())
    gaps = np.diff(stamps) if len(stamps) > 1 else np.array([0.0])
    return {
        "ttft": stamps[0] - t0 if stamps else float("nan"),
        "itl": float(np.median(gaps)),
        "pieces": len(stamps),
        "end": stamps[-1] if stamps else t0,
        "start": t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every client count, alternated (default 3)")
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=80,
        help="sentences (~14 tokens each) of a document two questions share; 0 skips it (default 80)",
    )
    ap.add_argument("--serve-args", default="", help="more arguments for mpitp serve, e.g. '--prefill-pacing off'")
    args = ap.parse_args()
    proc, client = start(args.tp, args.model, *shlex.split(args.serve_args))
    try:
        one(client, PROMPTS[0], 4)  # warm
        served = " ".join(["mpitp serve", args.serve_args]).strip()
        print(f"# {served}, TP={args.tp}, {args.max_tokens} new tokens per request, greedy")
        counts = [int(c) for c in args.clients.split(",")]
        runs: dict[int, list[tuple[float, float, float]]] = {n: [] for n in counts}
        batch = 0  # numbers each batch of requests, so that no prompt repeats
        for _ in range(args.rounds):  # the client counts alternated, so that drift hits all alike
            for n in counts:
                results: list = [None] * n

                def client_run(i: int, results=results, tag=f"Request {batch}.{{}}: ") -> None:
                    results[i] = one(client, tag.format(i) + PROMPTS[i % len(PROMPTS)], args.max_tokens)

                batch += 1
                wall = concurrently(client_run, n)
                ttft = float(np.median([r["ttft"] for r in results])) * 1e3
                itl = float(np.median([r["itl"] for r in results])) * 1e3
                runs[n].append((ttft, itl, sum(r["pieces"] for r in results) / wall))
        print(f"# medians over {args.rounds} round(s) per client count (TTFT: each round's median client)")
        print(
            f"{'clients':>8} {'TTFT ms':>9} {'(rounds)':>15} {'vs 1':>6} {'ITL ms':>8} {'output tok/s':>13} {'vs 1':>6}"
        )
        first = None
        for n in counts:
            t, i, r = (np.median([x[k] for x in runs[n]]) for k in range(3))
            lo, hi = min(x[0] for x in runs[n]), max(x[0] for x in runs[n])
            first = first or (t, r)
            spread = f"{lo:.0f}-{hi:.0f}"
            print(f"{n:>8} {t:>9.1f} {spread:>15} {t / first[0]:>5.2f}x {i:>8.1f} {r:>13.1f} {r / first[1]:>5.2f}x")
        # the same prompts one at a time through mpitp generate, for reference
        gen = [sys.executable, "-m", "mpitp.cli.main", "generate", "--max-new-tokens", str(args.max_tokens), "--chat"]
        gen += ["--model", args.model] if args.model else []
        t0 = time.perf_counter()
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        out = launch.run(args.tp, gen + sum((["--prompt", p] for p in PROMPTS), []), timeout=3600, env=env)
        print(
            f"# mpitp generate, the {len(PROMPTS)} prompts as one batch (process start and load included): "
            f"{time.perf_counter() - t0:.1f} s; {out.stderr.strip().splitlines()[-1] if out.stderr else ''}"
        )
        if args.shared_prefix:
            shared_prefix(client, args)
    finally:
        stop(proc)
    return 0


def start(tp: int, model: str | None, *extra: str):
    """``mpitp serve`` on a free port (16 rows, a queue of 64), once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "mpitp.cli.main", "serve", "--port", str(port), "--max-batch", "16"]
    argv += ["--max-queue", "64", *extra] + (["--model", model] if model else [])
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen(
        launch.command(tp, argv, timeout=3600), env=launch.environment(env, timeout=3600), start_new_session=True
    )
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    return proc, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)


def stop(proc) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def shared_prefix(client, args) -> None:
    """A question after a long shared document: time to first token when an earlier request
    with the same document left its blocks in the prefix cache, against a server with the
    cache off (same prompt, same run)."""
    doc = " ".join(f"Register r{i} holds {i * 37 % 101} and feeds unit {i % 7}." for i in range(args.shared_prefix))
    ask = lambda q: [{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}]  # noqa: E731

    def ttft(c, q) -> tuple[float, int]:
        t0 = time.perf_counter()
        r = c.chat.completions.create(model="m", messages=ask(q), max_tokens=1, temperature=0)
        return time.perf_counter() - t0, r.usage.prompt_tokens

    cold, n = ttft(client, "Which register holds 5?")  # computes the whole prompt, fills the cache
    hit, _ = ttft(client, "Which unit does r3 feed?")  # shares the document
    proc, off = start(args.tp, args.model, "--prefix-cache-mib", "0")
    try:
        ttft(off, "warm up")
        miss, _ = ttft(off, "Which unit does r3 feed?")
    finally:
        stop(proc)
    print(
        f"# shared prefix: {n} prompt tokens; first token (max_tokens 1) of a second question on the same document: "
        f"{hit * 1e3:.0f} ms with the prefix cache, {miss * 1e3:.0f} ms with it off ({hit / miss:.2f}x); "
        f"the first question {cold * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
