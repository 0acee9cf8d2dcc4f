"""What the training tests share: launching ``mpitp train`` under mpiexec on the tiny
config, and reading what a run left (its log's losses, its checkpoint's parameters in the
whole model's layout)."""

import json
import sys

import numpy as np

from mpitp import launch
from mpitp.train.checkpoint import Reader

TRAIN = [sys.executable, "-m", "mpitp.cli.main", "train"]


def make_ids(path):
    """A learnable stream: a noisy repeating pattern over the tiny config's 512 ids."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 512, 97)
    stream = np.tile(pattern, 40)
    noise = rng.random(stream.size) < 0.1
    stream[noise] = rng.integers(0, 512, noise.sum())
    np.save(path, stream)
    return path


def train(n, out, data, *extra, timeout=180, check=True, progress=False, script=None):
    """``mpiexec -n n mpitp train`` on the tiny config (``script``: a ``python -c`` program
    that patches something, then runs the CLI's main with the rest of the arguments)."""
    head = TRAIN if script is None else [sys.executable, "-c", script, "train"]
    argv = head + [
        "--config",
        "tiny",
        "--data",
        str(data),
        "--seq",
        "32",
        "--batch",
        "5",
        "--lr",
        "3e-3",
        "--warmup",
        "1",
        *([] if progress else ["--no-progress"]),
        "--out",
        str(out),
        *map(str, extra),
    ]
    res = launch.run(n, argv, timeout=timeout)
    if check:
        assert res.returncode == 0, f"{n} ranks: {res.stderr[-3000:]}"
    return res


def losses(out):
    return [json.loads(line)["loss"] for line in open(out / "log.jsonl")]


def params(out):
    r = Reader(out)
    return np.concatenate([r.read(i, "param", 0, u["numel"], np.float64) for i, u in enumerate(r.meta["units"])])


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())
