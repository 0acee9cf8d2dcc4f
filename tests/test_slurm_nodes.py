"""The sbatch scripts across two real nodes: slurm/testbed.sh up-nodes starts one slurmd
in each minicluster node (network namespaces, a 1 Gbit/s link each) and a slurmctld of
their own; jobs then run through srun --mpi=pmi2 (MPICH) and --mpi=pmix (Open MPI), as
bin/mpitp-run chooses. Needs root, network namespaces and SLURM (.ci/run installs it);
skips with the reason otherwise."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import netns_check
import pytest
import slurm_jobs

ROOT = Path(__file__).resolve().parent.parent
NODES_DIR = Path(os.environ.get("MPITP_SLURM_DIR", "/tmp/mpitp-slurm") + "-nodes")
CONF = NODES_DIR / "slurm.conf"
OMPI_VENV = Path(os.environ.get("MPITP_OMPI_VENV", ROOT / ".venv-ompi"))


WHY_NOT = netns_check.why_not() or (
    None
    if shutil.which("slurmd") and shutil.which("sbatch")
    else "SLURM is not installed (slurm/testbed.sh up installs it)"
)
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def nodes():
    res = subprocess.run(
        ["bash", str(ROOT / "slurm" / "testbed.sh"), "up-nodes", "2"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    yield
    subprocess.run(["bash", str(ROOT / "slurm" / "testbed.sh"), "down-nodes"], capture_output=True, timeout=60)
    subprocess.run([sys.executable, str(ROOT / "bin" / "mpitp-minicluster"), "down"], capture_output=True, timeout=60)


def start(tmp_path: Path, *opts: str, venv: Path | None = None, nodes: int = 2, **env) -> slurm_jobs.Job:
    """A job on ``nodes`` nodes x 2 tasks, submitted (slurm_jobs.Job: waited for as sbatch
    --wait would, without its 10-second polls), its output in tmp_path/job.out."""
    e = dict(
        os.environ,
        SLURM_CONF=str(CONF),
        MPITP_HOME=str(ROOT),
        MPITP_VENV=str(venv or sys.prefix),
        UCX_TLS="tcp,self",
        OPENBLAS_NUM_THREADS="1",
        **env,
    )
    for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "MPITP_RANKS_PER_NODE"):
        e.pop(k, None)
    argv = ["sbatch", f"--nodes={nodes}", "--ntasks-per-node=2", f"--output={tmp_path / 'job.out'}"]
    return slurm_jobs.Job([*argv, f"--chdir={tmp_path}", *opts], e)


def finish(job: slurm_jobs.Job, tmp_path: Path, timeout: float = 600) -> str:
    """Wait for the job; keep its output for the CI log; fail on a non-zero exit."""
    try:
        _, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        _, err = job.communicate()
    out = tmp_path / "job.out"
    text = out.read_text() if out.exists() else ""
    keep = Path(os.environ.get("MPITP_SLURM_DIR", "/tmp/mpitp-slurm")) / "out"
    keep.mkdir(parents=True, exist_ok=True)
    (keep / f"two-nodes-{tmp_path.name}.out").write_text(text)
    assert job.returncode == 0, err + text
    return text


def sbatch(tmp_path: Path, *opts: str, venv: Path | None = None, nodes: int = 2, **env) -> str:
    return finish(start(tmp_path, *opts, venv=venv, nodes=nodes, **env), tmp_path)


def test_hostfile_from_a_two_node_allocation(nodes, tmp_path):
    text = sbatch(tmp_path, f"--wrap={ROOT / 'bin' / 'mpitp-hostfile'} --format openmpi", PYTHON=sys.executable)
    assert text == "mtp-n1 slots=2\nmtp-n2 slots=2\n"


def test_bench_job_across_two_nodes(nodes, tmp_path):
    """MPICH through srun --mpi=pmi2: 4 ranks on 2 nodes, every result checked (--check
    fails the job on a wrong element), the ring's channels within nodes only."""
    text = sbatch(
        tmp_path,
        str(ROOT / "slurm" / "bench.sbatch"),
        MPITP_MIN_BYTES="256K",
        MPITP_MAX_BYTES="1M",
        MPITP_ITERS="10",
        MPITP_TRIALS="2",
    )
    assert "world of 4 rank(s) on 2 node(s): OK" in text
    assert "MPI point-to-point between nodes" in text and "hierarchical" in text and "1 MiB" in text


def test_generate_job_across_two_nodes(nodes, tmp_path):
    text = sbatch(
        tmp_path,
        str(ROOT / "slurm" / "generate.sbatch"),
        MPITP_MODEL=str(ROOT / "tests" / "fixtures" / "mha"),
        MPITP_PROMPT="the quick brown",
        MPITP_MAX_NEW_TOKENS="8",
    )
    assert "world of 4 rank(s) on 2 node(s): OK" in text and "TP=4 × 1 thread: prefill" in text
    assert text.count("the quick brown") == 1


def test_train_job_tp_inside_nodes_fsdp_across(nodes, tmp_path):
    """slurm/train.sbatch with MPITP_TP=2 on 2 nodes x 2 tasks: a 2 x 2 mesh whose tp
    groups are the nodes' own ranks; it learns and leaves a checkpoint of that mesh."""
    text = sbatch(
        tmp_path,
        str(ROOT / "slurm" / "train.sbatch"),
        MPITP_TP="2",
        MPITP_STEPS="6",
        MPITP_SEQ="32",
        MPITP_LR="3e-3",
        MPITP_OUT=str(tmp_path / "run"),
        MPITP_TRAIN_ARGS="--config tiny --data-default",
    )
    assert "world of 4 rank(s) on 2 node(s): OK" in text and "(mesh dp 2 x tp 2)" in text
    assert "mesh dimension" not in text  # no warning: every tp group inside a node
    log = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert len(log) == 6 and log[-1]["loss"] < log[0]["loss"]
    meta = json.loads((tmp_path / "run" / "step-000006" / "meta.json").read_text())
    assert meta["mesh"] == {"dp": 2, "tp": 2} and meta["world_size"] == 4


@pytest.mark.openmpi  # in the Open MPI line only (pyproject.toml)
@pytest.mark.skipif(not (OMPI_VENV / "bin" / "python").exists(), reason="no Open MPI venv (.venv-ompi)")
def test_demo_job_with_open_mpi_over_pmix_across_two_nodes(nodes, tmp_path):
    text = sbatch(
        tmp_path,
        str(ROOT / "slurm" / "demo.sbatch"),
        venv=OMPI_VENV,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    assert "world of 4 rank(s) on 2 node(s): OK" in text and "Open MPI" in text
    assert "2 node(s) (shared-memory), 4 rank(s)" in text  # mpitp info: the real layout


def kill_ranks(node: str, what: str) -> int:
    """SIGKILL every process of ``node``'s network namespace whose command line holds
    ``what`` (the ranks; the node's slurmd stays). Returns how many."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, timeout=10).stdout.split()
    hit = 0
    for pid in pids:
        try:
            if what in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                os.kill(int(pid), signal.SIGKILL)
                hit += 1
        except (FileNotFoundError, ProcessLookupError):
            pass
    return hit


@pytest.mark.parametrize("lost", ["ranks", "node"])  # "node" last: mtp-n2 stays down after it
def test_train_job_survives_a_lost_node(nodes, tmp_path, lost):
    """slurm/train.sbatch on 2 nodes x 2 ranks; once it has a checkpoint and has gone past
    it, every rank on the second node is killed ("ranks"), or every process of that node,
    its slurmd too ("node": SLURM takes the node away). The job starts again by itself from
    the latest checkpoint on the nodes that answer (both, or the first alone at N = 2),
    finishes the planned steps, and says how many it did again. Its losses after the
    restart equal, to the bit, those of a job that resumes from that checkpoint on the
    same nodes and nothing interrupts; log.jsonl holds each step once."""
    steps, every = 12, 4  # killed past step 6, ~5 s before the end at 0.85 s a step
    env = dict(
        MPITP_STEPS=str(steps),
        MPITP_SEQ="32",
        MPITP_BATCH="4",
        MPITP_TRAIN_ARGS=f"--config small --data-default --eval-fraction 0 --save-every {every} --dtype float64",
    )
    out = tmp_path / "run"
    job = start(tmp_path, str(ROOT / "slurm" / "train.sbatch"), MPITP_OUT=str(out), **env)
    log, killed, deadline = out / "log.jsonl", 0, time.monotonic() + 300
    while not killed and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        done = [line for line in log.read_text().splitlines() if line.endswith("}")] if log.exists() else []
        if (out / "latest").exists() and done and json.loads(done[-1])["step"] >= every + 2:
            killed = kill_ranks("mtp-n2", "mpitp train" if lost == "ranks" else "")
    assert killed >= 2, f"killed {killed} process(es); the job {'ended' if job.poll() is not None else 'ran on'}"
    text = finish(job, tmp_path)
    still = ["mtp-n1", "mtp-n2"] if lost == "ranks" else ["mtp-n1"]
    left = f"on {len(still)} node(s) ({','.join(still)})"
    assert "restart 1 of 2: the training step failed" in text and left in text, text
    resumed = text.split("resuming from ")[1].split()[0]  # step-000004 or a later one
    at = int(resumed.split("-")[1])
    assert f"resuming at step {at}: the log had reached step" in text and "step(s) are done again" in text
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # the reference: the same checkpoint, resumed by a job that nothing interrupts
    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copytree(out / resumed, ref / resumed)
    (ref / "latest").write_text(resumed + "\n")
    (tmp_path / "again").mkdir()
    sbatch(tmp_path / "again", str(ROOT / "slurm" / "train.sbatch"), MPITP_OUT=str(ref), nodes=len(still), **env)
    want = [json.loads(line)["loss"] for line in (ref / "log.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in records[at:]]
    assert len(want) == steps - at and got == want
