"""mpitp against distributed-llama on the same weights and the same cores, in one run.

    python benchmarks/dllama.py --dllama DIR                 # the embedded default model
    python benchmarks/dllama.py --dllama DIR --model ~/.cache/mpitp/models/llama-3.2-1b-q4_0-606027904

distributed-llama (github.com/b4rtaz/distributed-llama) is built from its repository
(``make dllama`` in DIR) and reads its own format, which its converter writes from a
Hugging Face directory. Here the mpitp model directory's GGUF is dequantized (the
``gguf`` package's values, q/k rows back in Hugging Face's order) into float32
safetensors beside its tokenizer, then ``converter/convert-hf.py ... q40`` quantizes the
matmul weights to its Q4_0 (its own quantizer: the values differ from the GGUF's, the
bytes per weight are the same) and ``convert-tokenizer-hf.py`` writes its tokenizer
(needs torch, transformers and sentencepiece, as its converters do). Converted once into --work.

Rows: decode tokens/s over ``--steps`` tokens after "Once upon a time" (distributed-llama
``inference --nthreads T --buffer-float-type q80``, its "Prediction" rate; mpitp
``generate`` at TP = ranks, end-of-text ignored), the median of ``--rounds`` alternating
rounds and each round's ratio.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import median

from mpitp import launch

ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
PROMPT = "Once upon a time"


def hf_dir(model: Path, out: Path) -> None:
    """config.json, tokenizer files and float32 model.safetensors of an mpitp GGUF directory."""
    import numpy as np
    from safetensors.numpy import save_file

    from mpitp.models.gguf_weights import sources

    cfg = json.loads((model / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    if abs(cfg.get("rms_norm_eps", 1e-5) - 1e-5) < 1e-9:
        cfg["rms_norm_eps"] = 1e-5  # distributed-llama accepts 1e-5 or 1e-6 exactly
    cfg.setdefault("hidden_act", "silu")
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    tensors = {}
    for name, src in sources(model, cfg["num_attention_heads"], cfg["num_key_value_heads"]):
        tensors[name] = np.ascontiguousarray(src.rows(0, src.shape[0]), np.float32)
        print(f"  {name} {tensors[name].shape}", file=sys.stderr)
    save_file(tensors, str(out / "model.safetensors"))


def converted(dllama: Path, model: Path, work: Path) -> tuple[Path, Path]:
    """(model .m, tokenizer .t) of distributed-llama, converted once."""
    name = model.name
    m, t = work / f"dllama_model_{name}_q40.m", work / f"dllama_tokenizer_{name}.t"
    if m.exists() and t.exists():
        return m, t
    hf = work / f"{name}-hf"
    print(f"# converting {model} for distributed-llama (once)", file=sys.stderr)
    hf_dir(model, hf)
    conv = dllama / "converter"
    for cmd in (["convert-hf.py", str(hf), "q40", name], ["convert-tokenizer-hf.py", str(hf), name]):
        subprocess.run([sys.executable, str(conv / cmd[0]), *cmd[1:]], cwd=work, check=True, env=ENV)
    return m, t


def dllama_rate(dllama: Path, m: Path, t: Path, steps: int, threads: int) -> float:
    cmd = [str(dllama / "dllama"), "inference", "--model", str(m), "--tokenizer", str(t), "--buffer-float-type",
           "q80", "--prompt", PROMPT, "--steps", str(steps), "--nthreads", str(threads)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    hit = re.search(r"Prediction\s+nTokens:\s*\d+\s+tokens/s:\s*([\d.]+)", out.stdout)
    if out.returncode or not hit:
        raise RuntimeError(f"dllama failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(hit.group(1))


def mpitp_rate(model: Path, ranks: int, threads: int, steps: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "mpitp.cli.main",
        "generate",
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(steps),
        "--stop",
        "999999999",
        "--threads",
        str(threads),
    ]  # end-of-text ignored
    res = launch.run(ranks, cmd, timeout=600, env=ENV)
    hit = re.search(r"decode \d+ tokens at ([\d.]+) tokens/s", res.stderr)
    if res.returncode or not hit:
        raise RuntimeError(f"mpitp failed ({res.returncode}): {res.stderr[-2000:]}")
    return float(hit.group(1))


def main() -> int:
    from mpitp.models import default, resolve

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dllama", required=True, help="distributed-llama's repository, built (make dllama)")
    p.add_argument("--model", help="an mpitp model directory (config.json + model.gguf); default: the default model")
    p.add_argument("--work", default=os.path.expanduser("~/.cache/mpitp/dllama"), help="where conversions are kept")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="distributed-llama's threads (default 2)")
    p.add_argument("--mpitp", default="2x1,1x2", help="mpitp ranks x threads to run (default 2x1,1x2)")
    a = p.parse_args()
    model = Path(a.model) if a.model else resolve.model_dir(None, None)
    if not a.model and default.gguf_file() is None:
        raise SystemExit(default.INSTALL)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    m, t = converted(Path(a.dllama), model, work)
    runs = [tuple(int(v) for v in s.split("x")) for s in a.mpitp.split(",")]
    rates: dict[str, list[float]] = {"dllama": []}
    for _ in range(a.rounds):
        rates["dllama"].append(dllama_rate(Path(a.dllama), m, t, a.steps, a.threads))
        for ranks, threads in runs:
            rates.setdefault(f"{ranks}x{threads}", []).append(mpitp_rate(model, ranks, threads, a.steps))
    base = rates["dllama"]
    print(f"# {model.name}: decode {a.steps} tokens after {PROMPT!r}, {a.rounds} alternating rounds, medians")
    print(
        f"distributed-llama q40, {a.threads} threads: {median(base):.1f} tok/s  ({', '.join(f'{r:.1f}' for r in base)})"
    )
    for ranks, threads in runs:
        r = rates[f"{ranks}x{threads}"]
        ratio = [x / y for x, y in zip(r, base)]
        print(
            f"mpitp TP={ranks} x {threads} thread(s): {median(r):.1f} tok/s  ({', '.join(f'{x:.1f}' for x in r)}); "
            f"vs distributed-llama {median(ratio):.2f}x ({', '.join(f'{x:.2f}' for x in ratio)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
