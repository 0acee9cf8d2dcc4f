"""examples/ are the documentation's API snippets: each block of the README or a docs/ page
that names an example file holds exactly that file, and each file runs under a real
mpiexec and prints its result."""

import os
import re
import sys
from pathlib import Path

import pytest

from mpitp import launch

pytestmark = pytest.mark.both_mpis  # the README's examples under each mpiexec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
BLOCK = re.compile(r"```python\n# (examples/[\w.]+)\n(.*?)```", re.S)


def test_readme_blocks_are_the_example_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = dict(b for page in pages for b in BLOCK.findall(page.read_text()))
    assert sorted(blocks) == [f"examples/{name}" for name in EXAMPLES]
    for path, text in blocks.items():
        assert text == (ROOT / path).read_text(), f"the documentation's {path} differs from the file"


def run(example: str, n: int, *args: str) -> str:
    """The example's stdout: every rank prints one line (mpiexec may interleave them)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", MPITP_TIMEOUT="60")
    res = launch.run(n, [sys.executable, str(ROOT / "examples" / example), *args], timeout=180, env=env, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("n", [1, 3])
def test_collectives(n):
    out = run("collectives.py", n)
    if n == 1:
        assert out.strip() == "0 Counter() Counter()", out  # alone, nothing is sent
    else:  # every rank counted its bytes, in its phase and to its neighbours on this node
        assert out.count("'forward': ") == n and out.count("'intra': ") == n, out


def test_tp_llama():
    out = run("tp_llama.py", 2, str(ROOT / "tests" / "fixtures" / "gqa"))
    ids = re.findall(r"\[\[1, 15, [\d, ]+\], \[1, 45, 7, 31, [\d, ]+\]\]", out)
    assert out.count("(1, 3, 256)") == 2 and len(ids) == 2 and ids[0] == ids[1], out  # same ids on both ranks


def test_train():
    out = run("train.py", 2)
    losses = re.findall(r"(\d+\.\d+) \d+\.\d+ \d+$", out, re.M)  # loss, eval loss, bytes held
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < float(losses[0]) < 10, out
