"""A collective that one rank never enters must abort the job within MPITP_TIMEOUT plus
a few seconds, naming the collective, its sequence number and the waiting rank, and
showing where in the program that rank waited."""

import re
import sys
import textwrap

import pytest

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # what each launcher does when a rank hangs

SCRIPT = textwrap.dedent("""
    import time, numpy as np, mpitp
    comm = mpitp.Communicator()
    comm.allreduce(np.ones(4), algorithm="{first}")  # call #1 completes everywhere
    if comm.rank == 1:
        time.sleep(120)                             # rank 1 never enters call #2
    comm.allreduce(np.ones({m}), algorithm="{alg}")
    print("unreachable", flush=True)
""")


# (3, ring, mpi): the ring's shared-memory channel is not open yet when rank 1 stays away;
# (2, ring, ring): it is, and the ranks that came wait on its flags; (3, oneshot, oneshot): the
# one-shot all-reduce's compiled waits come back to the watchdog (3 ranks: yielding ones too)
@pytest.mark.parametrize(
    "n,alg,first",
    [(2, "mpi", "mpi"), (3, "ring", "mpi"), (2, "ring", "ring"), (4, "mpi", "mpi"), (3, "oneshot", "oneshot")],
)
def test_hang_becomes_abort(n, alg, first, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(SCRIPT.format(alg=alg, first=first, m=64 if alg == "oneshot" else 1 << 16))
    res = launch.run(
        n, [sys.executable, str(script)], timeout=90, env={**__import__("os").environ, "MPITP_TIMEOUT": "3"}
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "unreachable" not in out
    assert "mpitp watchdog" in out and "allreduce #2" in out, out.replace("\x00", "")[-8000:]
    waited = re.findall(r"rank (\d+) waited", out)
    assert waited and "1" not in waited, out[-3000:]  # a rank that did enter names itself
    assert "waits here (its Python stack)" in out and f'File "{script}", line 7' in out, out[-3000:]  # its stack
    # the watchdog ended the job, not the launcher's limit (mpiexec's timeout, or launch's kill)
    assert res.returncode != 124 and "killed after" not in out and "TIMED OUT" not in out.upper(), out[-3000:]
