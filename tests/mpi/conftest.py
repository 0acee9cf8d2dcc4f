"""Fixtures of the per-rank suites (their helpers: helpers.py). Each suite file runs in
its own mpiexec launch, so a session here is one suite at one world size."""

import pytest

import mpitp


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
