"""Fixtures of the per-rank suites (their helpers: helpers.py), and the report each rank
writes for tests/test_mpi_suites.py. One mpiexec launch runs every file at a world size,
so a session here is all the suites at one world size: fixtures that change a
communicator's settings use their own (``fresh_comm``) or restore them.

With ``MPITP_SUITE_REPORT=PATH`` every rank appends one JSON line per test phase to
``PATH.rankR`` as it finishes (so a launch that dies part way still says what ran), after
a first line with the number of tests collected per file, and a last line with the number
it ran per file: a launch passes only where every rank wrote that line and all agree."""

import json
import os
from collections import Counter

import pytest
from mpi4py import MPI

import mpitp

REPORT = os.environ.get("MPITP_SUITE_REPORT")


def _write(record: dict) -> None:
    with open(f"{REPORT}.rank{MPI.COMM_WORLD.rank}", "a") as f:
        f.write(json.dumps(record) + "\n")


if REPORT:

    def pytest_collection_finish(session):
        _write({"collected": Counter(item.nodeid.split("::")[0].rsplit("/", 1)[-1] for item in session.items)})

    RAN: dict[str, set] = {}  # file -> ids of the tests this rank reported

    def pytest_runtest_logreport(report):
        if report.when == "call" or report.outcome != "passed":  # setup/teardown only when they fail or skip
            RAN.setdefault(report.nodeid.split("::")[0].rsplit("/", 1)[-1], set()).add(report.nodeid)
            reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else None
            _write(
                {
                    "id": report.nodeid,
                    "when": report.when,
                    "outcome": report.outcome,
                    "message": reason or (report.longreprtext[-3000:] if report.failed else ""),
                    "seconds": round(report.duration, 3),
                }
            )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(session, exitstatus):
        """The rank's last line: how many tests it ran, per file, and the world's size. A
        rank that left early (an ``_exit`` after the last collective, skipping its own
        asserts) writes none, and the launch fails (tests/suite_report.py)."""
        world = MPI.COMM_WORLD
        _write({"finished": {f: len(ids) for f, ids in sorted(RAN.items())}, "size": world.size})


@pytest.fixture(scope="session")
def comm():
    """The suite's communicator (a Dup of MPI.COMM_WORLD), shared by its tests."""
    c = mpitp.Communicator()
    yield c
    c.free()


@pytest.fixture
def fresh_comm():
    """A communicator of this test's own: counters start at zero, settings are its own."""
    c = mpitp.Communicator()
    yield c
    c.free()
