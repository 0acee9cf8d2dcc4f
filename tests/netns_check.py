"""Whether this machine allows a minicluster: bin/mpitp-minicluster's own check (root,
network namespaces, tc), for the tests that need one to skip with its reason."""

import subprocess
import sys
from pathlib import Path

TOOL = [sys.executable, str(Path(__file__).resolve().parent.parent / "bin" / "mpitp-minicluster")]


def why_not() -> str | None:
    res = subprocess.run(TOOL + ["check"], capture_output=True, text=True, timeout=60)
    return None if res.returncode == 0 else res.stderr.strip().removeprefix("mpitp-minicluster: ")
