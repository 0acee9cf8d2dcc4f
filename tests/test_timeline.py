"""MPITP_TIMELINE: one Chrome trace per rank, one event per collective (with algorithm,
bytes, peer class and phase), the ring's steps, and `mpitp timeline merge` / `plot`."""

import json
import os
import subprocess
import sys

import pytest

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # the collectives' trace under each library

SCRIPT = """
import numpy as np, mpitp
c = mpitp.Communicator()
x = np.ones(1000, np.float32)
for _ in range(3):
    c.allreduce(x, algorithm="mpi")      # small: the fast path is off while tracing
c.allreduce(x, algorithm="ring")
with c.phase("forward"):
    c.allgather(np.ones(4))
c.reduce_scatter(np.ones(30), algorithm="ring")
c.barrier()
"""


def test_trace_per_rank_merge_and_plot(tmp_path):
    n = 3
    script = tmp_path / "work.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, MPITP_TIMELINE=str(tmp_path / "trace"), MPITP_SHM="0", OPENBLAS_NUM_THREADS="1")
    res = launch.run(n, [sys.executable, str(script)], timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    for r in range(n):
        events = json.loads((tmp_path / f"trace.rank{r:05d}.json").read_text())["traceEvents"]
        calls = [e for e in events if e.get("cat") == "collective"]
        assert [e["name"] for e in calls] == ["allreduce"] * 4 + ["allgather", "reduce_scatter", "barrier"]
        assert all(e["ph"] == "X" and e["pid"] == r and e["dur"] > 0 for e in calls)
        # one call after another on a rank: each span ends before the next begins
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(calls, calls[1:])), calls
        ring = calls[3]["args"]
        assert ring["algorithm"] == "ring" and ring["bytes"] == 4000 and ring["peer"] == "intra"
        assert calls[0]["args"]["algorithm"] == "mpi" and calls[0]["args"]["peer"] == "mpi"
        assert calls[4]["args"]["phase"] == "forward" and calls[5]["args"]["phase"] is None
        steps = [e["name"] for e in events if e.get("cat") == "ring"]  # the ring over MPI: its 2(N-1) steps
        assert steps == [f"ring step {s} ({'reduce-scatter' if s < n - 1 else 'all-gather'})" for s in range(2 * n - 2)]
    cli = [sys.executable, "-m", "mpitp.cli.main", "timeline"]
    merged = tmp_path / "all.json"
    out = subprocess.run(cli + ["merge", str(tmp_path / "trace"), "-o", str(merged)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    events = json.loads(merged.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == set(range(n)) and sum(e.get("cat") == "collective" for e in events) == 7 * n
    png = tmp_path / "all.png"
    out = subprocess.run(
        cli + ["plot", str(merged), "-o", str(png), "--collective", "-1"], capture_output=True, text=True
    )
    assert out.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", out.stderr
    missing = subprocess.run(cli + ["merge", str(tmp_path / "nope"), "-o", str(merged)], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such trace" in missing.stderr


def test_off_by_default():
    import mpitp

    c = mpitp.Communicator()
    assert os.environ.get("MPITP_TIMELINE") is None and c._timeline is None
    c.free()
