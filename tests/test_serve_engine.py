"""The serving engine's shared timeline, in one process: a request decoded after others
finished equals the same request decoded alone (greedy), whether the timeline restarted
(nothing running) or dropped the columns of finished requests under a running one."""

from pathlib import Path

import numpy as np

from mpitp.models.llama import LlamaForCausalLM
from mpitp.serve.engine import Engine, Job

FIX = Path(__file__).resolve().parent / "fixtures"


def decode(engine: Engine, row: int, first_logits, n: int) -> list[int]:
    """Greedy tokens of the request in ``row`` (the only one fed), ``n`` of them."""
    out = [int(np.argmax(first_logits))]
    s = engine.slots[row]
    assert s is not None
    s.last = out[0]
    for _ in range(n - 1):
        logits = engine.step()
        out.append(int(np.argmax(logits[row])))
        s.last, s.pos = out[-1], s.pos
    return out


def test_timeline_restarts_and_compacts_without_changing_answers():
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa")
    prompt = [5, 17, 42, 9]
    alone = model.generate([prompt], max_new_tokens=6, stop_tokens=[])[0][len(prompt) :]
    e = Engine(model, max_batch=2, max_len=512)

    first = decode(e, 0, e.admit(Job(1, prompt, 6)), 6)
    assert first == alone
    e.release(0)
    assert e.cache.length == 0  # nothing runs: the timeline restarts
    assert decode(e, 0, e.admit(Job(2, prompt, 6)), 6) == alone

    # a long request finishes while a short one runs: its columns are dropped once they
    # are most of the timeline, and the running request's answer does not change
    e.release(0)
    long = [3 + i % 250 for i in range(297)]
    decode(e, 0, e.admit(Job(3, long, 2)), 2)
    short = e.admit(Job(4, prompt, 6))
    e.release(0)  # the long one ends; the short one moves into row 0
    before = e.cache.length
    assert decode(e, 0, short, 6) == alone
    assert e.cache.length < before  # compacted
