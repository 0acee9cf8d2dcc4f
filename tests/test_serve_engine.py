"""The serving engine's shared timeline, in one process: a request decoded after others
finished equals the same request decoded alone (greedy), whether the timeline restarted
(nothing running) or dropped the columns of finished requests under a running one."""

from pathlib import Path

import numpy as np
import pytest

from mpitp.models.llama import LlamaForCausalLM
from mpitp.serve.engine import Engine
from mpitp.serve.jobs import Job
from mpitp.serve.pacing import PLANNED, Pacing, take

FIX = Path(__file__).resolve().parent / "fixtures"


def decode(engine: Engine, row: int, first_logits, n: int) -> list[int]:
    """Greedy tokens of the request in ``row`` (the only one fed), ``n`` of them."""
    out = [int(np.argmax(first_logits))]
    engine.took(row, out[0])
    for _ in range(n - 1):
        r = engine.step()[row]  # a greedy row's token, its logits' argmax taken where they are
        out.append(r.token if r.token >= 0 else int(np.argmax(r.logits)))
        engine.took(row, out[-1])
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


def _alone(model, ids):
    """Every position's logits of ``ids`` prefilled alone, the reference."""
    return np.asarray(model([ids]))[0]


def _close(a, b):
    scale = np.abs(b).max()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("budget", [24, 200])
def test_packed_chunked_prefill_equals_each_prompt_alone(budget):
    """Prompts of different lengths packed into one forward, under a budget that cuts the
    long ones into chunks across iterations: each prompt's logits equal its own forward.
    (200: whole prompts longer than a block of query rows, attention's parts, packed.)"""
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 250, n)) for n in (5, 70, 1, 33, 17, 90)]
    e = Engine(model, max_batch=8, max_len=512, budget=budget)
    for i, p in enumerate(prompts):
        e.add(Job(i, [int(t) for t in p], 4, echo=(i == 1), logprobs=(0 if i == 1 else None)))
    out, rounds = {}, 0
    while e.waiting:
        for row, result in e.prefill().items():
            out[e.slots[row].job.id] = result.logits
        rounds += 1
    assert rounds == -(-sum(map(len, prompts)) // budget)  # every iteration filled its budget
    for i, p in enumerate(prompts):
        ref = _alone(model, p)
        _close(out[i], ref if i == 1 else ref[-1])  # job 1 kept every position (echo)
    # and decoding on from the packed prefill gives each prompt's own greedy text
    for row, s in enumerate(e.slots):
        if s is not None:
            e.took(row, int(np.argmax(out[s.job.id] if s.job.id != 1 else out[1][-1])))
    logits = e.step()
    for row, s in enumerate(e.slots):
        if s is not None:
            ids = prompts[s.job.id] + [s.last]
            _close(logits[row].logits, _alone(model, ids)[-1])


def _groupings(n: int):
    """Every way to cut n prompts, in order, into forwards (compositions of n)."""
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in _groupings(n - first):
            yield (first,) + rest


def _mean_ttft(left: list[int], groups, pace: float) -> float:
    t = total = 0.0
    at = 0
    for g in groups:
        t += pace + sum(left[at : at + g])  # this forward's cost delays it and every later one
        total += g * t
        at += g
    return total / len(left)


def test_take_starts_the_grouping_with_the_least_mean_time_to_first_token():
    """pacing.take, applied forward after forward, equals the best of every grouping of the
    waiting prompts (brute force), for prompts of mixed lengths and fixed costs from a
    GPU-like 1000 tokens down to 2."""
    assert take([22] * 7, None) is None  # off: all that fit the budget
    assert take([500], 1.0) is None  # one prompt goes whole (the budget still chunks it)
    assert take([22] * 7, 1000.0) is None  # a GPU-like fixed cost: one forward
    assert take([22] * 7, 40.0) == 4  # 4, 2, 1 (docs: the groups shrink by ~P tokens)
    assert take([22] * 500, 40.0) == take([22] * PLANNED, 40.0) < PLANNED  # a long queue: its head
    assert take([1] * 100, 1000.0) is None  # the planned ones all in one forward: all that fit
    rng = np.random.default_rng(5)
    for _ in range(60):
        left = [int(v) for v in rng.integers(1, 130, rng.integers(2, 9))]
        pace = float(rng.choice([2.0, 5.0, 12.5, 40.0, 80.0, 1000.0]))
        plan, at = [], 0
        while at < len(left):
            n = take(left[at:], pace) or len(left) - at
            plan.append(n)
            at += n
        best = min(_mean_ttft(left, g, pace) for g in _groupings(len(left)))
        assert _mean_ttft(left, plan, pace) == pytest.approx(best, rel=1e-12), (left, pace, plan)
    p = Pacing(0.020, 0.001)
    assert p.pace(False) == pytest.approx(20.0)
    p.stepped(0.010)
    assert p.pace(True) == pytest.approx(30.0) and p.pace(False) == pytest.approx(20.0)
    p.prefilled(100, 0.130)  # a served forward: its fixed part (30 ms) pulls a up by a fifth
    assert p.a == pytest.approx(0.022) and p.b == pytest.approx(0.001)
    assert Pacing().pace(True) is None and Pacing(0.01, -0.001).pace(True) is None


def test_paced_prefill_takes_the_prompts_take_picks_and_equals_each_alone():
    """With a pace the engine starts only the prompts take() picks (whole ones, in arrival
    order), over as many forwards as that takes; each prompt's logits equal its own forward."""
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (5, 70, 1, 33, 17, 9, 21)]
    e = Engine(model, max_batch=8, max_len=512, budget=512)
    for i, p in enumerate(prompts):
        e.add(Job(i, p, 4))
    out, forwards = {}, []
    while e.waiting:
        most = take([len(pf.job.ids) - pf.done for pf in e.waiting], 12.0)
        expect = [pf.job.id for pf in e.waiting[: most or len(e.waiting)]]
        got = e.prefill(12.0)
        assert sorted(e.slots[row].job.id for row in got) == expect  # the budget cut none
        out.update({e.slots[row].job.id: r.logits for row, r in got.items()})
        forwards.append(len(got))
    assert len(forwards) > 2 and sum(forwards) == len(prompts)
    for i, p in enumerate(prompts):
        _close(out[i], _alone(model, p)[-1])


def test_prefix_cache_reuses_prompt_and_conversation_blocks():
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa")
    e = Engine(model, max_batch=2, max_len=512, prefix_bytes=1 << 22)
    system = [7 + i % 200 for i in range(40)]  # a shared system turn: 2 full blocks and 8 tokens
    a = system + [11, 12, 13]
    _close(e.admit(Job(1, a, 3)), _alone(model, a)[-1])
    assert e.prefix.hits == 0 and len(e.prefix) == 2  # 43 tokens: 2 full blocks kept
    b = system + [21, 22, 23, 24, 25]
    _close(e.admit(Job(2, b, 3)), _alone(model, b)[-1])
    assert e.prefix.hits == 32  # the system turn's 2 blocks were not prefilled again
    e.release(1)
    e.release(0)
    # a conversation: a request ends after 6 tokens; its next turn starts with all of it
    reply = decode(e, 0, e.admit(Job(3, a, 6)), 6)
    e.release(0)
    nxt = a + reply[:5] + [30, 31, 32]  # the fed tokens (the sixth was never fed) + a new turn
    hits = e.prefix.hits
    _close(e.admit(Job(4, nxt, 3)), _alone(model, nxt)[-1])
    assert e.prefix.hits - hits == 48  # 43 + 5 = 48 tokens were kept as 3 blocks, all reused
    # a prompt that asks for its own log-probabilities prefills all of it
    hits = e.prefix.hits
    every = e.admit(Job(5, b, 3, logprobs=0, echo=True))
    assert e.prefix.hits == hits
    _close(every, _alone(model, b))


def test_prompts_packed_after_their_cached_blocks_equal_each_alone():
    """Prompts that start with cached blocks, prefilled in one packed forward: each prompt's
    columns are two runs (its cached blocks, then its new tokens) with the others' between
    them, and attention takes exactly those. Each prompt's logits equal its own forward."""
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa")
    e = Engine(model, max_batch=8, max_len=512, prefix_bytes=1 << 22)
    system = [7 + i % 200 for i in range(40)]  # 2 full blocks and 8 tokens
    e.admit(Job(0, system + [3], 1))  # leaves the 2 blocks in the cache
    prompts = [system + [11 + i] * n for i, n in enumerate((3, 90, 1, 17))]  # 90: past a query block
    for i, p in enumerate(prompts, 1):
        e.add(Job(i, p, 1))
    out = e.prefill()
    assert e.prefix.hits == 4 * 32 and not e.waiting  # one forward, every prompt after its 32 cached tokens
    for row, result in out.items():
        _close(result.logits, _alone(model, prompts[e.slots[row].job.id - 1])[-1])


def test_prefix_cache_evicts_least_recently_used_within_its_budget():
    model = LlamaForCausalLM.from_pretrained(FIX / "gqa")
    assert Engine(model, max_batch=1, max_len=512).prefix.capacity == 0  # off unless given memory
    e = Engine(model, max_batch=1, max_len=512, prefix_bytes=3 * _block_bytes(model))
    assert e.prefix.capacity == 3
    x, y = [5] * 32 + [1], [6] * 32 + [1]  # 2 blocks each
    for job, ids in enumerate((x, y, x), 1):
        e.admit(Job(job, ids, 1))
        e.release(0)
    # x (2 blocks), then y (2): y's second block evicts x's first, so x misses when it comes
    # back; keeping x again evicts the two oldest, x's second (it is re-added) and y's first
    assert e.prefix.hits == 0 and len(e.prefix) == 3
    before = e.prefix.hits
    e.admit(Job(4, x, 1))
    assert e.prefix.hits - before == 32  # x is the most recent: both of its blocks are there


def _block_bytes(model) -> int:
    a = model.layers[0].self_attn
    return 2 * len(model.layers) * 16 * a.nkv * model.config.head_dim * np.dtype(model.dtype).itemsize


def test_grammar_bounds_what_a_schema_leaves_unbounded():
    """The grammar a schema compiles to refuses a 17th integer digit, an 11th fraction digit
    and whitespace beyond one space or a newline and 20 of indent (a small model may
    otherwise write them until max_tokens), keeps
    the bounds a schema states, and json_object takes any JSON object, nested, held to the
    same bounds."""
    import pytest

    llguidance = pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    from mpitp.serve.grammar import ANY_OBJECT, grammar_schema

    tok = Tokenizer.from_file(str(FIX / "mha" / "tokenizer.json"))
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[0])

    def accepts(schema, text) -> bool:
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(grammar_schema(schema)))
        ids = lt.tokenize_str(text)
        return m.validate_tokens(ids) == len(ids) and not m.is_error()

    obj = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}
    assert accepts(obj, '{"n": ' + "9" * 16 + ', "x": 0.' + "1" * 10 + "}")
    assert not accepts(obj, '{"n": ' + "9" * 17)
    assert not accepts(obj, '{"n": 1, "x": 0.' + "1" * 11)
    assert accepts(obj, '{"n": 1}') and not accepts(obj, '{"n":  1}')  # one space, or a newline and an indent
    assert accepts(obj, '{"n":\n' + " " * 20 + "1}") and not accepts(obj, '{"n":\n' + " " * 21)
    small = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
    assert accepts(small, '{"n": 5}') and not accepts(small, '{"n": 6}')  # the schema's own bound stays
    assert accepts(ANY_OBJECT, '{"a": [1, -2.5, {"b": null}], "c": "x", "d": true}')
    assert not accepts(ANY_OBJECT, '{"a": ' + "1" * 17) and not accepts(ANY_OBJECT, "[1]")
