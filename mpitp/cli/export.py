"""``mpitp export``: a training checkpoint as a Hugging Face model directory."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a training checkpoint as a Hugging Face directory",
        description="Gather every unit of a training checkpoint (saved at any N) into "
        "config.json, model.safetensors and tokenizer.json, which mpitp generate "
        "and transformers' LlamaForCausalLM load. Runs as one process.",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a training --out directory (its latest)")
    p.add_argument("out", help="directory to write")


def run(args) -> int:
    from ..train.checkpoint import export_hf

    out = export_hf(args.checkpoint, args.out)
    from ..log import get_logger

    get_logger("export").info(f"exported {args.checkpoint} -> {out}")
    return 0
