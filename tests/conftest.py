"""Outer test process. Multi-rank suites live in tests/mpi/ and run under a real
``mpiexec`` (see test_mpi_suites.py); they are not collected here directly.

In CI (``CI`` set), a test that skips because a reference or tool is missing — torch,
transformers, the openai client, the default model's package, the Open MPI venv, the
SLURM testbed, the minicluster's namespaces and tools, cross-memory attach — fails the
run: CI provides them, so such a skip means a reference silently stopped being checked.
Skips for a reason of the test's own (a world size that has nothing to test) stay
skips."""

import os

import pytest
from hypothesis import settings

collect_ignore = [] if os.environ.get("MPITP_INNER") else ["mpi"]

# Property tests in CI: derandomized, no example database, no deadline, so a run does the
# same, known work every time (each test's own @settings still sets its example count;
# the per-rank suites fix theirs per file). Locally hypothesis explores as it likes.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Skip reasons that name something CI provides. Every one of them must fail a CI run: the
# SLURM node-loss restart, the minicluster and the CMA tests skipped silently before
# "cannot create network namespaces", "needs root", "needs setpriv", "no Open MPI
# environment" and "process_vm_readv not permitted" were listed (tests/test_ci_skips.py).
MISSING = (
    "could not import",
    "not installed",
    "No module named",
    "no Open MPI venv",
    "no Open MPI environment",
    "no SLURM controller",
    "cannot create network namespaces",
    "needs root",
    "needs setpriv",
    "needs '",  # a tool the minicluster needs: ip, tc (iproute2)
    "process_vm_readv not permitted",
    "does not permit cross-memory attach",
)


def missing_reference_skips(stats) -> list[str]:
    """The skip reasons, among ``stats["skipped"]`` reports, that name something missing."""
    found = []
    for rep in stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if any(m in reason for m in MISSING):
            found.append(f"{rep.nodeid}: {reason}")
    return found


def instruction_sets() -> tuple[str, list[str], list[str]]:
    """(this CPU's name, the int8 kernels' instruction sets it runs, those it lacks): the
    first run numerically in the kernel grid (tests/test_kernel_grid.py), the others are
    compiled for CPUs that have them and their machine code checked (tests/test_int8.py)."""
    from mpitp.kernels import cpu

    have = cpu.supported()
    return cpu.host()[0], list(have), [i for i in cpu.ISAS if i not in have]


def pytest_terminal_summary(terminalreporter):
    ran = {r.nodeid.split("::")[0] for rs in terminalreporter.stats.values() for r in rs if hasattr(r, "nodeid")}
    if any(f.endswith(("test_kernel_grid.py", "test_int8.py")) for f in ran):
        name, have, lack = instruction_sets()
        terminalreporter.section("int8 kernels: instruction sets", yellow=bool(lack))
        terminalreporter.line(f"run numerically on this CPU ({name}): {', '.join(have)}")
        if lack:
            terminalreporter.line(
                f"compiled and their machine code checked only (this CPU lacks them): {', '.join(lack)}"
            )
    if os.environ.get("CI"):
        found = missing_reference_skips(terminalreporter.stats)
        if found:
            terminalreporter.section("CI: skipped because a reference or tool is missing", red=True)
            for line in found:
                terminalreporter.line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get("CI") and reporter and missing_reference_skips(reporter.stats):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
