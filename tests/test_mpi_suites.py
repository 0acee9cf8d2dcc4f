"""Run every per-rank suite in tests/mpi/ under a real mpiexec at world sizes 1-4, and the
cases whose outcome depends on the world size again at 5-8 oversubscribed ranks and over
the ring's MPI transport.

One mpiexec launch per world size (and variant) runs all the files it needs: a launch pays
Python's start, the imports and numba's cache load once, not once per file. Each file's
outcome is still its own test here (``test_suite[test_allreduce.py-3]``), read from the
JSON lines every rank writes as each test finishes (tests/mpi/conftest.py): a test fails
here if it failed on any rank, and a launch that died part way (a watchdog abort, a
timeout) fails every file it did not finish, with the launch's output.

Each launch has a time limit (MPIEXEC_TIMEOUT / --timeout, plus a kill of the whole
process group), and ranks run with the mpitp watchdog on, so a hang fails in seconds with
a message instead of eating CI's time. A test that skips inside a suite is reported here
as a warning naming the suite, world size and reason (in CI, a skip for something missing
fails the inner run itself: see conftest.py).
"""

import functools
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from conftest import MISSING

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # every collective and layer, run by each library's mpiexec

HERE = Path(__file__).parent
ROOT = HERE.parent
SUITES = sorted(p.name for p in (HERE / "mpi").glob("test_*.py"))
FLAVOR = launch.flavor()
MIN_RANKS = {"test_validation.py": 2}  # a mismatch needs two ranks to disagree

# 5-8 oversubscribed ranks: only what the world size changes. Three simulated nodes of
# uneven size for the two-level all-reduce (chunking, leaders, plan bytes; one dtype per
# kind of reduction instead of the 1-4 rank runs' six), uneven head and column cuts at 5.
TWO_LEVEL = "test_hierarchical.py"
SIZE_CASES = "not test_matches_mpi or float32-sum or int64-sum"  # test_matches_mpi's grid: two of its dtypes
EXTRA_SIZES = {
    5: [TWO_LEVEL, "test_tp_layers.py", "test_llama.py"],
    6: [TWO_LEVEL],
    7: [TWO_LEVEL],
    8: [TWO_LEVEL],
}
# the ring over MPI point-to-point, as across nodes (one node uses shared memory by
# default): the ring's own cases (the all-reduce ring, its segments and pipeline, the
# ring reduce-scatter and all-gather, their byte counts), at 2-4 ranks
MPI_TRANSPORT = ["test_allreduce.py", "test_collectives.py", "test_traffic.py"]
RING_CASES = "ring or reduce_scatter or allgather"
NO_SHM = {"MPITP_SHM": "0", "MPITP_CMA": "0"}


@functools.cache
def launch_files(n: int, files: tuple[str, ...], select: str = "", transport: str = "") -> dict:
    """Run ``files`` in one launch of ``n`` ranks; per file, its tests' outcomes (merged over
    ranks), the number collected, and the launch's exit code and output."""
    report = Path(tempfile.mkdtemp(prefix=f"mpitp-suites-{n}-")) / "report"
    env = dict(os.environ, MPITP_INNER="1", MPITP_TIMEOUT="60", PYTHONHASHSEED="0", MPITP_SUITE_REPORT=str(report))
    if transport == "mpi":
        env.update(NO_SHM)
    argv = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "--color=no"]
    argv += ["--timeout=0", "--capture=sys"]  # fd 2 stays the launcher's: a watchdog abort's message reaches us
    argv += ["-rs", *(["-k", select] if select else []), *(f"tests/mpi/{f}" for f in files)]
    res = launch.run(n, argv, timeout=1500, env=env, cwd=str(ROOT))
    collected: dict = {}
    tests: dict = {}
    for path in report.parent.glob("report.rank*"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "collected" in rec:
                collected = rec["collected"]
                continue
            t = tests.setdefault(rec["id"], {"outcome": "passed", "messages": [], "seconds": 0.0})
            t["seconds"] = max(t["seconds"], rec["seconds"])
            if rec["outcome"] != "passed" and t["outcome"] != "failed":
                t["outcome"] = rec["outcome"]
            if rec["message"] and rec["message"] not in t["messages"]:
                t["messages"].append(rec["message"])
    return {"res": res, "collected": collected, "tests": tests}


def check(n: int, suite: str, files: list[str], select: str = "", transport: str = "") -> None:
    """Fail if ``suite``'s tests in that launch failed on any rank or did not all run."""
    run = launch_files(n, tuple(files), select, transport)
    res, mine = run["res"], {k: v for k, v in run["tests"].items() if k.split("::")[0].endswith("/" + suite)}
    where = f"{suite} at {n} ranks ({FLAVOR}{', ring over MPI' if transport else ''})"
    failed = [f"{k}\n{chr(10).join(v['messages'])}" for k, v in mine.items() if v["outcome"] == "failed"]
    if failed:
        pytest.fail(f"{where}: {len(failed)} failed\n" + "\n\n".join(failed)[-12000:], pytrace=False)
    want = run["collected"].get(suite)
    if want is None or len(mine) < want:
        pytest.fail(
            f"{where}: {len(mine)} of {want} tests reported; the launch exited {res.returncode}\n--- stdout\n"
            f"{res.stdout[-8000:]}\n--- stderr\n{res.stderr[-4000:]}",
            pytrace=False,
        )
    assert any(v["outcome"] == "passed" for v in mine.values()), f"{where}: nothing passed"
    missing = [
        k for k, v in mine.items() if v["outcome"] == "skipped" and any(m in " ".join(v["messages"]) for m in MISSING)
    ]
    if os.environ.get("CI") and missing:
        pytest.fail(f"{where}: skipped because a reference or tool is missing: {missing}", pytrace=False)
    explained = any(v["outcome"] == "failed" for v in run["tests"].values()) or sum(run["collected"].values()) > len(
        run["tests"]
    )
    if res.returncode != 0 and not explained:  # every test ran and passed, yet the launch failed
        pytest.fail(f"{where}: every test passed but the launch exited {res.returncode}\n{res.stderr[-4000:]}")
    skips = sorted(
        {f"{k.split('::')[-1]}: {'; '.join(v['messages'])}" for k, v in mine.items() if v["outcome"] == "skipped"}
    )
    if skips:
        warnings.warn(f"{where} skipped: " + "; ".join(skips), stacklevel=2)


def launched(request, files: list[str]) -> list[str]:
    """The files of this test's launch: those of ``files`` whose test of the same kind and
    world size was collected (all of them in a full run; one when you ask for one)."""
    me = request.node
    mine = {
        it.callspec.params["suite"]
        for it in request.session.items
        if getattr(it, "originalname", None) == me.originalname and it.callspec.params["n"] == me.callspec.params["n"]
    }
    return [f for f in files if f in mine]


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("suite", SUITES)
def test_suite(request, suite, n):
    if n < MIN_RANKS.get(suite, 1):
        pytest.skip(f"{suite} needs at least {MIN_RANKS[suite]} ranks")
    check(n, suite, launched(request, [s for s in SUITES if n >= MIN_RANKS.get(s, 1)]))


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("suite,n", [(s, n) for n, files in EXTRA_SIZES.items() for s in files])
def test_suite_large(request, suite, n):
    check(n, suite, launched(request, EXTRA_SIZES[n]), select=SIZE_CASES)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("suite", MPI_TRANSPORT)
def test_suite_ring_over_mpi(request, suite, n):
    check(n, suite, launched(request, MPI_TRANSPORT), select=RING_CASES, transport="mpi")
