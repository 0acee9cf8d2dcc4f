"""``mpitp serve``: the model behind an OpenAI-compatible HTTP API, on rank 0."""

from __future__ import annotations

import sys

from .options import add_parallel_arguments, add_weights_argument, apply_threads, check_parallel, layout, load_options


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (run under mpiexec -n P for TP=P)",
        description="Rank 0 answers /v1/chat/completions, /v1/completions (stream: true for "
        "server-sent events), /v1/models and /health; every rank runs the same tensor-parallel "
        "steps. Requests join the running batch at the next decode step. SIGTERM finishes the "
        "requests in flight and stops every rank.",
    )
    p.add_argument(
        "--model", help="directory, .gguf file, or org/name in the local HF cache (default: the embedded one)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument(
        "--max-model-len",
        type=int,
        help="the longest prompt + completion a request may have; each batch row holds this many "
        "tokens of keys/values, allocated at start (default: the model's context, at most 4096)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="prompt tokens prefilled per iteration, packed into one forward; a longer prompt goes on in "
        "the next iterations' chunks while running requests keep decoding (default 256)",
    )
    p.add_argument(
        "--prefill-pacing",
        choices=["auto", "off"],
        default="auto",
        help="auto: prompts that wait together are prefilled a few per forward, as many as the costs "
        "measured at start make best for their mean time to first token (where a forward's fixed cost "
        "is small against its tokens', as on CPUs); off: one forward takes all that fit "
        "--max-num-batched-tokens (default auto)",
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=float,
        default=256.0,
        help="memory per rank for the keys/values of 16-token prompt blocks that later requests reuse "
        "(the chat template's system turn, a conversation's history); 0 turns it off (default 256)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 503")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cut off")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--tool-template",
        default=None,
        metavar="NAME|FILE",
        help="a chat template that renders `tools`, for models whose own does not: hermes (ChatML with "
        "<tool_call>, as Qwen2.5), llama3_json, or a Jinja file (default: none; such a request is a 400)",
    )
    p.add_argument(
        "--tool-parser",
        default=None,
        choices=["hermes", "llama3", "mistral"],
        help="how the model writes tool calls (default: read from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none"],
        help="auto: a reply's <think> block becomes reasoning_content where the template knows <think> "
        "(Qwen3, DeepSeek-R1); none: the raw text (default auto)",
    )
    p.add_argument(
        "--dp-attention",
        action="store_true",
        help="a mixture-of-experts model: each rank serves its own requests (attention and dense layers whole "
        "on every rank, --max-batch rows a rank; the head's vocabulary cut over the ranks, the rows all-gathered, "
        "sampled rows drawn exactly in two stages), the experts cut ep and reached by all-to-all "
        "(DeepSeek's and SGLang's layout; fewer bytes between nodes than tensor parallelism's all-reduces: "
        "across nodes the faster layout for sampled requests, whose logits tp gathers, about level for greedy "
        "ones, docs/moe.md); "
        "log-probabilities and constrained output are refused in this mode",
    )
    p.add_argument("--served-model-name", help="the model id clients see (default: the directory name)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    add_weights_argument(p)
    add_parallel_arguments(p)


def run(args) -> int:
    from ..comm import Communicator

    if args.max_batch < 1 or args.max_queue < 1 or args.max_num_batched_tokens < 1:
        raise SystemExit("mpitp serve: --max-batch, --max-queue and --max-num-batched-tokens must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise SystemExit(f"mpitp serve: --max-model-len must be at least 2, got {args.max_model_len}")
    if args.prefix_cache_mib < 0:
        raise SystemExit(f"mpitp serve: --prefix-cache-mib must be 0 or more, got {args.prefix_cache_mib}")
    with Communicator() as comm:  # freed however the command ends
        return _serve(args, comm)


def _serve(args, comm) -> int:
    from pathlib import Path

    from ..log import get_logger
    from ..models import chat, default, resolve
    from ..models.llama import LlamaForCausalLM
    from ..serve.engine import Engine
    from ..serve.http import start_http
    from ..serve.requests import Service
    from ..serve.results import HandBack
    from ..serve.scheduler import Stop
    from ..serve.scheduler import run as serve_loop

    if not args.model and default.gguf_file() is None:
        print(f"mpitp serve: no --model and no default model ({default.INSTALL})", file=sys.stderr)
        return 2
    model_dir = resolve.model_dir(args.model or None, comm)
    apply_threads(args)
    check_parallel(args, comm.size)
    tool_template = chat.named_template(args.tool_template) if args.tool_template else None  # every rank: a clear error
    model = LlamaForCausalLM.from_pretrained(str(model_dir), comm, load_options(args))
    context = model.config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > context:
        raise SystemExit(f"mpitp serve: --max-model-len {args.max_model_len} exceeds the model's context {context}")
    # with pipeline stages, one engine per stage (micro-batches in flight, every stage busy),
    # each a share of the rows; they share the prefix cache
    stages = args.pp or 1
    engines: list[Engine] = []
    back = HandBack(model.stage) if model.stage is not None else None  # the engines' results, in one order
    for _ in range(stages):
        engines.append(
            Engine(
                model,
                -(-args.max_batch // stages),
                max_len=args.max_model_len,
                budget=args.max_num_batched_tokens,
                prefix_bytes=int(args.prefix_cache_mib * 2**20),
                comm=comm,
                prefix=engines[0].prefix if engines else None,
                hand_back=back,
            )
        )
    engine = engines[0]
    pacing = None
    if (
        args.prefill_pacing == "auto" and stages == 1 and not args.dp_attention
    ):  # timed before the HTTP side takes requests
        from ..serve.scheduler import calibrate

        pacing = calibrate(model, comm.rank == 0, comm, engine.max_len)
    service = None
    if comm.rank == 0:
        tok = resolve.tokenizer(model_dir)
        service = Service(
            tok,
            str(model_dir),
            args.served_model_name or Path(model_dir).name,
            engine.max_len,
            args.max_queue,
            args.request_timeout,
            args.api_key,
        )
        service.tool_template, service.dp = tool_template, args.dp_attention
        service.tool_parser, service.reasoning_parser = args.tool_parser, args.reasoning_parser
        service.eos = tuple(model.config.eos_token_id)
        service.vocab = model.config.vocab_size
    stop = Stop()  # from here on, SIGTERM/SIGINT end the server cleanly
    # every rank has its handler before rank 0 answers /health (a bcast lets the root
    # run ahead while a slower rank still loads: a signal then would kill that rank)
    ok = comm.all_true(True)
    server = None
    if comm.rank == 0 and ok:
        assert service is not None
        server = start_http(service, args.host, args.port)
        get_logger("serve").info(
            f"serving {service.name} at http://{args.host}:{args.port}/v1 "
            f"({layout(comm, model)}, batch {args.max_batch}"
            + (f" in {stages} micro-batches of {engine.B}, one per stage in flight)" if stages > 1 else ")")
        )
        get_logger("serve").info(
            f"KV cache per rank: {stages * engine.B} rows x {engine.max_len} tokens, "
            f"{sum(e.cache_bytes for e in engines) / 2**20:.0f} MiB; "
            f"prefix cache up to {engine.prefix.capacity} blocks "
            f"of 16 tokens, {engine.prefix.capacity * engine.prefix.block_bytes / 2**20:.0f} MiB"
        )
        get_logger("serve").info(f"prefill pacing: {pacing.describe() if pacing else 'off'}")
    if args.dp_attention:
        from ..serve.dp import run_dp

        run_dp(engine, service, stop)
    else:
        serve_loop(engines, service, stop, pacing if comm.rank == 0 else None)
    if server is not None:
        server.shutdown()
    get_logger("serve").info("stopped")
    return 0
