"""mpitp bench as a user runs it: rows present, nothing wrong, JSON schema, plot written,
tuning file written and read back. No timing assertions."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # collectives timed and checked under each library

MPITP = [sys.executable, "-m", "mpitp.cli.main"]
FIXTURES = Path(__file__).parent / "fixtures"
KEYS = {
    "collective",
    "algorithm",
    "size_bytes",
    "count",
    "dtype",
    "ranks",
    "time_us",
    "algbw_gbs",
    "busbw_gbs",
    "wrong",
}


def bench(n, *args, env=None, timeout=240):
    res = launch.run(n, MPITP + ["bench", *args], timeout=timeout, env=env or dict(os.environ))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.parametrize(
    "collective", ["allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "alltoall"]
)
@pytest.mark.parametrize("n", [2, 3])
def test_rows_and_json(collective, n, tmp_path):
    out = tmp_path / "rows.json"
    res = bench(
        n,
        collective,
        "--min-bytes",
        "4",
        "--max-bytes",
        "64K",
        "--factor",
        "16",
        "--iters",
        "3",
        "--check",
        "--json",
        str(out),
    )
    rows = json.loads(out.read_text())
    algs = {r["algorithm"] for r in rows}
    assert "mpi" in algs
    if collective in ("allreduce", "allgather", "reduce_scatter"):
        assert {"ring", "auto"} <= algs
    for r in rows:
        assert KEYS <= set(r), set(r) ^ KEYS
        assert r["ranks"] == n and r["collective"] == collective
        if r["algorithm"] != "mpi4py":
            assert r["wrong"] == 0, r
    assert "Avg bus bandwidth (mpi)" in res.stdout and "memcpy" in res.stdout
    assert "#wrong" in res.stdout and "busbw" in res.stdout
    sizes = sorted({r["size_bytes"] for r in rows if r["algorithm"] == "mpi"})
    assert len(sizes) == 4  # 4, 64, 1K, 16K (64K in bytes rounded to whole elements per rank)
    assert "timed between those trials" in res.stdout  # the ceiling again, beside the largest size
    assert "# ring transport (one node: shared memory up to 2 MiB, " in res.stdout


@pytest.mark.parametrize("inplace", [False, True])
def test_large_allreduce_is_right(inplace):
    """Above the shared-memory channel's limit the ring reads by CMA (where permitted):
    the rows of a 5 MiB all-reduce at 3 ranks, in place or not, have nothing wrong."""
    res = bench(
        3,
        "allreduce",
        "--min-bytes",
        "5M",
        "--max-bytes",
        "5M",
        "--iters",
        "2",
        "--trials",
        "1",
        "--check",
        *(["--inplace"] if inplace else []),
    )
    rows = [line.split() for line in res.stdout.splitlines() if line.strip().startswith("5 MiB")]
    assert [r[5] for r in rows] == ["mpi", "ring", "auto"], res.stdout
    assert all(r[11] == "0" for r in rows), res.stdout


def test_plot_written(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bw.png"
    bench(2, "allreduce", "--max-bytes", "256K", "--factor", "64", "--iters", "2", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tune_writes_file_that_auto_reads(tmp_path):
    path = tmp_path / "tuning.json"
    env = dict(os.environ, MPITP_TUNING=str(path))
    bench(2, "allreduce", "--tune", "--min-bytes", "1K", "--max-bytes", "1M", "--factor", "32", "--iters", "3", env=env)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and "2" in data["allreduce"]
    # a file that says "always ring" must make auto choose the ring, identically on every rank
    path.write_text(json.dumps({"version": 1, "allreduce": {"2": 0}}))
    script = (
        "import numpy as np, mpitp; c = mpitp.Communicator(); c.allreduce(np.ones(8));"
        "t = c.mpi.gather(c.traffic.by_peer.get('intra', 0)); c.rank or print('ring bytes', t)"
    )
    res = launch.run(2, [sys.executable, "-c", script], timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert "ring bytes [64, 64]" in res.stdout  # 8 float64: each rank sends 2*8 - 4 - 4 elements of 8 B


def test_tune_reduce_scatter_and_refuse_the_rest(tmp_path):
    path = tmp_path / "tuning.json"
    env = dict(os.environ, MPITP_TUNING=str(path))
    bench(
        2,
        "reduce_scatter",
        "--tune",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "1M",
        "--factor",
        "32",
        "--iters",
        "3",
        env=env,
    )
    data = json.loads(path.read_text())
    assert "2" in data["reduce_scatter"] and "allreduce" not in data
    res = launch.run(2, MPITP + ["bench", "allgather", "--tune"], timeout=60, env=env)
    assert res.returncode == 2 and "--tune applies to allreduce and reduce_scatter" in res.stderr


def test_refuses_sizes_that_do_not_fit():
    res = launch.run(2, MPITP + ["bench", "allreduce", "--max-bytes", "1024G"], timeout=60)
    assert res.returncode == 2
    assert "lower --max-bytes" in res.stderr


@pytest.mark.parametrize("n,weights,kind", [(1, "auto", "float32"), (2, "q8_0", "Q8_0")])
def test_decode_rows_per_batch(n, weights, kind, tmp_path):
    """mpitp bench decode: the model held as --weights says, one row per batch size with
    its step time, ratio to batch 1, share of the read bandwidth measured in the run, and
    the floor (bandwidth or float32 multiply-adds, whichever is larger) with its share."""
    js = tmp_path / "decode.json"
    out = bench(n, "decode", "--model", str(FIXTURES / "gqa"), "--weights", weights, "--json", str(js)).stdout
    assert f"TP={n}, --weights {weights}" in out and f"(rank 0: {kind} " in out, out
    num = r"\s+([\d.]+)"
    rows = re.findall(rf"^\s+(\d+){num}{num}x{num}{num}%{num}{num}%$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16], out
    assert rows[0][2] == "1.00" and all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows), out
    # a row of the batch costs one multiply-add per weight of the linear layers and the head
    cfg = json.loads((FIXTURES / "gqa" / "config.json").read_text())
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    qkv = h * d * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    total = cfg["num_hidden_layers"] * (qkv + cfg["num_attention_heads"] * d * h + 3 * h * i) + v * h
    res = json.loads(js.read_text())
    assert res["multiply_adds"] == total // n, (res["multiply_adds"], total, n)  # the fixture cuts evenly at n = 2
    assert f"multiply-adds per row of the batch {total // n:,} on" in out, out
    # the bandwidth floor's input: the bytes a step reads are every weight the rank holds but
    # the embedding table (one row of it is looked up); counted here from the config: the
    # matmul weights in the format (float32: 4 bytes; Q8_0 as the int8 kernels hold it: 32
    # int8 and the float16 scale a block of 32), the norms float32 on every rank, the
    # embedding in the same format cut by rows
    norms = 4 * (2 * cfg["num_hidden_layers"] + 1) * h
    per_weight = {"float32": 4, "Q8_0": 34 / 32}[kind]
    assert res["streamed"] == total // n * per_weight + norms, (res["streamed"], total, n)
    held = res["streamed"] + v * h // n * per_weight
    assert res["weights_per_rank"] == [held] * n, (res["weights_per_rank"], held)
    mib = f"{res['weights_per_rank'][0] / 2**20:.1f}"
    assert f"weights per rank: {', '.join([mib] * n)} MiB" in out, out
    bw, row = res["streamed"] / (res["ceiling_gbs"] * 1e9), res["multiply_adds"] / res["fma_rate"]
    assert res["fma_rate"] > 1e8 and bw > 0, res
    for (B, t), r in zip(res["steps"].items(), rows):
        assert res["floors"][B] == max(bw, int(B) * row) and t > 0, res
        assert r[1] == f"{t * 1e3:.2f}" and r[5] == f"{res['floors'][B] * 1e3:.2f}", (r, t)
        # the table's tokens/s is the batch over the step, its share of the ceiling the
        # bandwidth floor over the step
        assert r[3] == f"{int(B) / t:.1f}" and r[4] == f"{bw / t:.0%}".rstrip("%"), (r, B, t, bw)


def test_decode_through_pipeline_stages(tmp_path):
    """--pp 2: a step is one pass through both stages (and the tokens back); the floor's
    inputs are the stages' bytes and multiply-adds in turn: summed, the whole model's."""
    js = tmp_path / "decode.json"
    out = bench(2, "decode", "--model", str(FIXTURES / "gqa"), "--weights", "q8_0", "--pp", "2", "--json", str(js))
    assert "PP=2 × TP=1, --weights q8_0" in out.stdout and "summed over the stages" in out.stdout, out.stdout
    cfg = json.loads((FIXTURES / "gqa" / "config.json").read_text())
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    qkv = h * d * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    total = cfg["num_hidden_layers"] * (qkv + cfg["num_attention_heads"] * d * h + 3 * h * i) + v * h
    res = json.loads(js.read_text())
    assert res["multiply_adds"] == total, (res["multiply_adds"], total)
    norms = 4 * (2 * cfg["num_hidden_layers"] + 1) * h
    assert res["streamed"] == total * 34 / 32 + norms, (res["streamed"], total)  # the embedding is looked up
    assert sorted(res["steps"]) == ["1", "16", "2", "4", "8"] and all(t > 0 for t in res["steps"].values())
