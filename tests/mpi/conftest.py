"""Fixtures of the per-rank suites (their helpers: helpers.py), and the report each rank
writes for tests/test_mpi_suites.py. One mpiexec launch runs every file at a world size,
so a session here is all the suites at one world size: fixtures that change a
communicator's settings use their own (``fresh_comm``) or restore them.

With ``MPITP_SUITE_REPORT=PATH`` every rank appends one JSON line per test phase to
``PATH.rankR`` as it finishes (so a launch that dies part way still says what ran), after
a first line with the number of tests collected per file."""

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

    def pytest_runtest_logreport(report):
        if report.when == "call" or report.outcome != "passed":  # setup/teardown only when they fail or skip
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
