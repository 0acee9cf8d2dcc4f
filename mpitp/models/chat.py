"""Chat prompts rendered with the model's own template, as transformers renders them.

A model directory's ``tokenizer_config.json`` carries ``chat_template`` (Jinja) and the
special tokens it refers to; the GGUF importer writes one from the file's
``tokenizer.chat_template``. Rendering follows transformers' ``apply_chat_template``: a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-control
extension, ``raise_exception`` and ``strftime_now``, the special tokens as variables; the
text is then tokenized without adding special tokens. A model without a template gets
ChatML (the format most small instruct models use)::

    <|im_start|>user
    What is the capital of France?<|im_end|>
    <|im_start|>assistant
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from ..errors import MpitpError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(MpitpError, ValueError):
    """A chat template that does not render (a Jinja error, or the template's own raise)."""


def load(model_dir) -> tuple[str, dict]:
    """(template, special tokens) of a model directory; ChatML when it has no template."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return CHATML, {}
    special = {k: _token_text(cfg.get(k)) for k in SPECIAL if cfg.get(k) is not None}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return (template or CHATML), special


def _token_text(tok) -> str:
    return tok["content"] if isinstance(tok, dict) else str(tok)


def render(
    template: str, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None, **special
) -> str:
    """The conversation as the model's template writes it; ``tools`` (OpenAI's list of
    ``{"type": "function", "function": ...}``) as transformers passes them; ``special``: the
    special tokens and any further variables (``enable_thinking``: chat_template_kwargs)."""
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          tools=tools or None, documents=None, **special)  # fmt: skip
    except ChatTemplateError:
        raise
    except Exception as e:  # a template error: name it
        raise ChatTemplateError(f"the chat template does not render: {type(e).__name__}: {e}") from None


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refuses the conversation: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


TEMPLATES = Path(__file__).resolve().parent.parent / "serve" / "templates"


def named_template(name: str) -> str:
    """A chat template by name (``hermes``, ``llama3_json``: mpitp's own, for tools) or path."""
    p = TEMPLATES / f"{name}.jinja"
    if not p.exists():
        p = Path(name)
    if not p.is_file():
        known = ", ".join(sorted(t.stem for t in TEMPLATES.glob("*.jinja")))
        raise ChatTemplateError(f"no chat template {name!r}: one of {known}, or a file")
    return p.read_text()
