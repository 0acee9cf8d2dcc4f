"""One launch runs several per-rank files; each file's outcome is read back from the JSON
lines every rank wrote (tests/mpi/conftest.py) and judged as its own test. Used by
test_mpi_suites.py (one launch per world size) and test_minicluster.py (the suites across
two nodes)."""

import json
import os
import tempfile
import warnings
from pathlib import Path

import pytest
from conftest import MISSING


def new_path(prefix: str) -> Path:
    """Where a launch's ranks write their reports (``PATH.rankR``)."""
    return Path(tempfile.mkdtemp(prefix=prefix)) / "report"


def pytest_args(files, select: str = "") -> list[str]:
    """``python -m pytest`` over per-rank files, as every rank runs it."""
    argv = ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "--color=no"]
    argv += ["--timeout=0", "--capture=sys"]  # fd 2 stays the launcher's: a watchdog abort's message reaches us
    return argv + ["-rs", *(["-k", select] if select else []), *(f"tests/mpi/{f}" for f in files)]


def read(res, report: Path) -> dict:
    """The launch's result: its exit code and output, the number of tests collected per
    file, and each test's outcome merged over ranks (failed if it failed on any)."""
    collected: dict = {}
    tests: dict = {}
    finished: dict[int, dict] = {}  # rank -> its last line
    for path in report.parent.glob(report.name + ".rank*"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "collected" in rec:
                collected = rec["collected"]
                continue
            if "finished" in rec:
                finished[int(path.name.rsplit("rank", 1)[1])] = rec
                continue
            t = tests.setdefault(rec["id"], {"outcome": "passed", "messages": [], "seconds": 0.0})
            t["seconds"] = max(t["seconds"], rec["seconds"])
            if rec["outcome"] != "passed" and t["outcome"] != "failed":
                t["outcome"] = rec["outcome"]
            if rec["message"] and rec["message"] not in t["messages"]:
                t["messages"].append(rec["message"])
    return {"res": res, "collected": collected, "tests": tests, "finished": finished}


def ranks_disagree(finished: dict[int, dict], suite: str) -> str:
    """What is wrong with the ranks' last lines for ``suite`` ('' if nothing): each rank
    of the world must have written one, and all must have run as many of its tests."""
    if not finished:
        return "no rank wrote its last line (the launch ended before pytest finished on any rank)"
    size = max(rec["size"] for rec in finished.values())
    missing = sorted(set(range(size)) - set(finished))
    if missing:
        return f"ranks {missing} of {size} did not finish their session (left early, or died): their asserts never ran"
    counts = {r: rec["finished"].get(suite, 0) for r, rec in sorted(finished.items())}
    if len(set(counts.values())) > 1:
        return f"the ranks ran different numbers of its tests: {counts}"
    return ""


def judge(where: str, suite: str, run: dict) -> None:
    """Fail if ``suite``'s tests in ``run`` failed on any rank or did not all run; warn of
    its skips (in CI, a skip for something missing fails)."""
    res, mine = run["res"], {k: v for k, v in run["tests"].items() if k.split("::")[0].endswith("/" + suite)}
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
    wrong = ranks_disagree(run["finished"], suite)
    if wrong:
        pytest.fail(f"{where}: {wrong}\n--- stderr\n{res.stderr[-4000:]}", pytrace=False)
    assert any(v["outcome"] == "passed" for v in mine.values()), f"{where}: nothing passed"
    skipped = {k: "; ".join(v["messages"]) for k, v in mine.items() if v["outcome"] == "skipped"}
    missing = [k for k, why in skipped.items() if any(m in why for m in MISSING)]
    if os.environ.get("CI") and missing:
        pytest.fail(f"{where}: skipped because a reference or tool is missing: {missing}", pytrace=False)
    failed_anywhere = any(v["outcome"] == "failed" for v in run["tests"].values())
    if res.returncode != 0 and not failed_anywhere and sum(run["collected"].values()) <= len(run["tests"]):
        pytest.fail(f"{where}: every test passed but the launch exited {res.returncode}\n{res.stderr[-4000:]}")
    if skipped:
        warnings.warn(
            f"{where} skipped: " + "; ".join(f"{k.split('::')[-1]}: {v}" for k, v in skipped.items()), stacklevel=3
        )
