"""Reference texts of ``mpitp generate``, made once per pytest session: many requests in
one process (one launch, one model import and kernel load), each through the CLI's own
``main(["generate", ...])`` with its stdout captured, so the text is exactly what the
command prints. Tests that compare a server (or anything else) with generate's text ask
here instead of launching generate once per prompt per test."""

import functools
import json
import sys

from mpitp import launch

SCRIPT = """
import contextlib, io, json, sys
from mpitp.cli.main import main
texts = []
for args in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["generate", *args])
    if rc != 0:
        sys.exit(f"mpitp generate {args} exited {rc}")
    texts.append(buf.getvalue())
print("TEXTS" + json.dumps(texts))
"""


@functools.cache
def _run(requests: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    res = launch.run(1, [sys.executable, "-c", SCRIPT, json.dumps(requests)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return tuple(json.loads(res.stdout.split("TEXTS", 1)[1]))


def greedy(
    model: str, requests: list[tuple[str, bool]], max_new_tokens: int, extra: tuple[str, ...] = ()
) -> dict[tuple[str, bool], str]:
    """{(prompt, chat): the text generate prints after the prompt}, greedy, at TP = 1
    (``extra``: more of generate's options, the same for every request)."""
    args = tuple(
        ("--model", model, "--prompt", p, "--max-new-tokens", str(max_new_tokens), "--chat" if chat else "--no-chat")
        + extra
        for p, chat in requests
    )
    out = _run(args)
    return {(p, chat): text[len(p) + (1 if chat else 0) :].rstrip("\n") for (p, chat), text in zip(requests, out)}
