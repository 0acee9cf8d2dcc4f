"""The flags ``mpitp generate``, ``serve`` and ``bench decode`` share, defined once, and
what they become: one :class:`mpitp.models.loader.LoadOptions` for the model, threads per
rank for the kernels, the pp x tp layout checked on every rank before anything loads."""

from __future__ import annotations

from ..models.loader import LoadOptions


def load_options(args, **override) -> LoadOptions:
    """The model's load options from the shared flags (``override``: fields a command sets
    itself, as bench decode's --shape file does for weights)."""
    fields = dict(
        dtype=getattr(args, "dtype", "float32"),
        device=getattr(args, "device", "cpu"),
        weights=args.weights,
        activations=args.activations,
        pp=getattr(args, "pp", 1),
        stage_inside_node=getattr(args, "tp", None) is not None,
        kv_cache_dtype=args.kv_cache_dtype,
        moe=getattr(args, "moe", "auto"),
        dp_attention=getattr(args, "dp_attention", False),
    )
    return LoadOptions(**(fields | override))


def add_weights_argument(p, extra: tuple[str, ...] = (), note: str = "") -> None:
    """--weights, as generate and serve take it (bench decode adds the --shape file types)."""
    p.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "float32", "q8_0", *extra],
        help="how matmul weights are kept: auto = as the file stores them (a GGUF file's Q4_0/Q4_1/Q8_0 "
        "blocks as they are, Q4_K/Q6_K/Q5_0 repacked exactly (in the int8 tiles at about the file's "
        "size); F16/BF16 of GGUF or safetensors at 16 bits; float32 as "
        "float32), float32 = dequantized, "
        "q8_0 = quantized at load (default auto)" + note,
    )
    p.add_argument(
        "--activations",
        default=None,
        choices=["auto", "int8", "int8o", "int8x2", "float32"],
        help="how block weights multiply: int8 = each matmul input quantized to int8 blocks of 32 (as "
        "llama.cpp does) and integer dot products (AVX-VNNI/AVX512-VNNI, AVX2, or portable); int8o = int8, "
        "with the outliers of each block of 32 (above 4x the root mean square of its other values) "
        "quantized apart, as LLM.int8() splits them off (the kernels multiply them only where there are "
        "any), in decode; its prefill multiplies two digits; int8x2 = two int8 digits per value "
        "(what one leaves, quantized again: ~15 bits, twice the "
        "multiply-adds); float32 = float32 inputs, "
        "the exact reference; auto = int8o where the CPU has VNNI or AVX2, else float32 "
        "(default: $MPITP_ACTIVATIONS or auto; $MPITP_ISA forces an instruction set)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="threads per rank in the int8 matmul kernels: each matmul's output rows split over N threads "
        "(as MPI + OpenMP codes run a rank per socket); ranks × threads should not exceed the cores "
        "(default: $MPITP_THREADS or 1)",
    )
    p.add_argument(
        "--moe",
        default="auto",
        choices=["auto", "ep", "tp"],
        help="how a mixture-of-experts model's experts are cut over the ranks: ep = whole experts per rank "
        "(128 over 3 ranks: 43 + 43 + 42; a rank idle in a step where none of its experts is chosen), tp = "
        "every expert's intermediate columns cut (balanced at batch 1); both sum the experts with one "
        "all-reduce per layer; auto = the one whose slowest rank reads fewer expert weights per step, as "
        "`mpitp plan infer` predicts (default auto; dense models ignore it)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "float32", "float16"],
        help="how the KV cache holds keys and values: float16 = half the bytes decode attention reads (as "
        "llama.cpp's default f16 cache), rounded to nearest; auto = float16 with int8 activations on the CPU, "
        "else the model's dtype (float32 activations stay exact) (default: $MPITP_KV_CACHE_DTYPE or auto)",
    )


def add_parallel_arguments(p) -> None:
    """--pp / --tp: pipeline stages and tensor parallelism inside each (pp × tp = ranks)."""
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="P",
        help="pipeline stages: the layers cut into P contiguous runs (balanced by bytes), each run a "
        "tensor-parallel group of world/P ranks placed inside a node; one hidden state per row per step "
        "crosses each stage boundary instead of two all-reduces per layer (default 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="T",
        help="tensor-parallel ranks per stage; must equal world size / --pp, and asks that each stage sit "
        "inside one node (an error where the nodes cannot hold it; default: world size / --pp, anywhere)",
    )


def check_parallel(args, world: int) -> None:
    """pp × tp = world size, or a clear error on every rank (before anything loads)."""
    from ..models.pipeline import check_layout

    check_layout(world, getattr(args, "pp", 1), getattr(args, "tp", None))


def layout(comm, model) -> str:
    """ "TP=2" or "PP=2 × TP=2", for the [mpitp] line."""
    from ..models.pipeline import describe

    if getattr(model, "dp_attention", False):
        return f"attention DP={comm.size}, experts EP={comm.size}"
    return describe(comm.size, getattr(model, "stage", None))


def apply_threads(args) -> int:
    """--threads for the kernels (over MPITP_THREADS), checked on every rank; the count."""
    from ..kernels import parallel

    if getattr(args, "threads", None) is not None:
        parallel.set_threads(args.threads)
    return parallel.check(parallel.threads())
