"""What `mpitp generate` feeds the model: prompts from the command line, a file or stdin,
formatted with the chat template and tokenized; sampling defaults from the model's
``generation_config.json``.

``--prompt-file FILE`` (``-`` for stdin) holds one prompt per line, or one JSON
conversation per line, either ``[{"role": "user", "content": "..."}, ...]`` or
``{"messages": [...]}``; blank lines are skipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import chat
from .generate import GenerationError

Prompt = str | list  # text, or a conversation (list of messages)


def read_prompt_file(name: str) -> list[Prompt]:
    try:
        lines = sys.stdin.read().splitlines() if name == "-" else Path(name).read_text().splitlines()
    except OSError as e:
        raise GenerationError(f"--prompt-file {name}: {e.strerror}") from None
    out: list[Prompt] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith(("[", "{")):
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise GenerationError(f"--prompt-file {name}, line {n}: not JSON ({e})") from None
            messages = obj.get("messages") if isinstance(obj, dict) else obj
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise GenerationError(f"--prompt-file {name}, line {n}: expected a list of {{role, content}} messages")
            out.append(messages)
        else:
            out.append(line)
    if not out:
        raise GenerationError(f"--prompt-file {name}: no prompts in it")
    return out


def encode(
    tok,
    prompts: list[Prompt],
    model_dir,
    use_chat: bool,
    system: str | None,
    tools: list | None = None,
    template: str | None = None,
    extra: dict | None = None,
) -> list[list[int]]:
    """Token ids of each prompt: a conversation always goes through the chat template, a
    text only with ``use_chat`` (as a user turn, after ``system`` when given); ``tools``
    (OpenAI's list), ``template`` (instead of the model's) and ``extra`` template variables
    (``enable_thinking``) as the template takes them."""
    own, special = chat.load(model_dir)
    template = template or own
    special = {**special, **(extra or {})}
    ids = []
    for p in prompts:
        if isinstance(p, list) or use_chat:
            head = [{"role": "system", "content": system}] if system and not isinstance(p, list) else []
            messages = p if isinstance(p, list) else head + [{"role": "user", "content": p}]
            text = chat.render(template, messages, tools=tools, **special)
            ids.append(tok.encode(text, add_special_tokens=False).ids)
        else:
            ids.append(tok.encode(p).ids)
    return ids


def generation_defaults(model_dir) -> dict:
    """Sampling defaults from ``generation_config.json`` in transformers' sense: greedy
    unless ``do_sample``; its eos ids as stop tokens. Missing file: {}."""
    try:
        cfg = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    out: dict = {}
    if cfg.get("do_sample"):
        for key in ("temperature", "top_k", "top_p", "min_p"):
            if cfg.get(key) is not None:
                out[key] = cfg[key]
    if cfg.get("repetition_penalty") is not None:
        out["repetition_penalty"] = float(cfg["repetition_penalty"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        out["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos)
    return out
