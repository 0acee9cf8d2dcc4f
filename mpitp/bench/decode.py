"""``mpitp bench decode``: one decode step of a model at batch 1-16, against the memory
read bandwidth and the float32 multiply-add rate measured in the same run.

A decode step streams every weight a rank holds once (``streamed_bytes``), whatever the
batch, so its time is bounded below by ``streamed / bandwidth``, the bandwidth that of
each rank reading its own weights, every rank at once (:func:`weights_bandwidth`). It also does one
multiply-add per weight per row of the batch (``multiply_adds``), in float32 (the
activations are not quantized), so it is bounded below by ``B x multiply_adds / rate`` as
well, the rate being what one core's BLAS reaches on a compute-bound sgemm. The floor of
a step is the larger of the two: the bandwidth's at small batches, the multiply-adds'
from a few rows on. The table gives each batch's step time, its ratio to batch 1, the
tokens/s it means, its share of the bandwidth ceiling, the floor and the share of it.
"""

from __future__ import annotations

import time

import numpy as np

from ..models.loader import LoadOptions

BATCHES = (1, 2, 4, 8, 16)


def _best_rate(work, amount: float, reps: int, comm) -> float:
    """``amount`` per second of ``work()``, best of ``reps``; with ``comm`` (a
    Communicator) every rank runs it at once and the slowest rank's rate counts."""
    best = 0.0
    for _ in range(reps):
        if comm is not None:
            comm.barrier()
        t = time.perf_counter()
        work()
        best = max(best, amount / (time.perf_counter() - t))
    return best if comm is None else comm.allreduce_object(best, op="min")


def read_bandwidth(nbytes: int = 256 << 20, reps: int = 5, comm=None) -> float:
    """GB/s of one core reading ``nbytes`` (an OR-reduction: no writes, little compute),
    best of ``reps``; with ``comm`` every rank reads at once, as every rank streams its
    weights at once. This, not a copy, is what a decode step does."""
    a = np.ones(nbytes // 8, np.uint64)
    return _best_rate(lambda: np.bitwise_or.reduce(a), a.nbytes / 1e9, reps, comm)


def weights_bandwidth(model, comm=None, reps: int = 3) -> float:
    """GB/s of one core reading its own rank's streamed weights (an OR-reduction over the
    first ``streamed_bytes()`` of the model's arena: the pages, the size and the order a
    decode step reads), best of ``reps``; with ``comm`` every rank at once. A decode step
    cannot read its weights faster than this: it is the step's read ceiling. A fresh buffer
    is no stand-in for it: on a Xeon with a 480 MiB L3, 64 MiB read three times by each of 2
    ranks came back at 17.7-19.0 GB/s where 1 GiB, and the 1B's 340 MB of weights a rank,
    read at 16.6-16.8 (the repeated small buffer partly from the L3, measured). Where there
    is no host arena (CuPy) or it is under 1 MiB (a test's model), a 64 MiB buffer read
    ``reps`` times."""
    arena = getattr(model, "_arena", None)
    flat = arena.reshape(-1).view(np.uint8) if isinstance(arena, np.ndarray) else np.empty(0, np.uint8)
    n = min(flat.nbytes, model.streamed_bytes()) // 8 * 8
    big = comm.allreduce_object(n >= 1 << 20, op="min") if comm is not None else n >= 1 << 20
    if not big:  # every rank the same way: each takes part in the other's barriers
        return read_bandwidth(64 << 20, reps, comm)
    a = flat[:n].view(np.uint64)
    return _best_rate(lambda: np.bitwise_or.reduce(a), a.nbytes / 1e9, reps, comm)


def fma_rate(n: int = 512, reps: int = 5, comm=None) -> float:
    """Float32 multiply-adds per second of one core's BLAS on an n x n x n sgemm (bound by
    the FMA units, not memory), best of ``reps``; with ``comm`` as :func:`read_bandwidth`."""
    a, b = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    a @ b  # BLAS's first call sets up its buffers
    return _best_rate(lambda: a @ b, n**3, reps, comm)


def step_times(model, comm, batches=BATCHES, context: int = 32, reps: int = 30) -> dict[int, float]:
    """Median seconds (slowest rank) of one decode step after ``context`` tokens, per batch.
    Each sequence of the batch feeds its own token (fixed, the same on every rank and run):
    a batch of one repeated token would give every row of x the same outliers, and int8o's
    kernels skip the outliers' digit in the blocks where no row has one."""
    out = {}
    vocab = model.config.vocab_size
    for B in batches:
        cache = model.new_cache(B, context + reps + 1)
        cache.valid[:, :context] = True
        cache.length = context
        ids = ((42 + 997 * np.arange(B, dtype=np.int64)) % vocab).reshape(B, 1)
        times = []
        for _ in range(reps):
            cache.valid[:, cache.length] = True
            comm.barrier()
            t = time.perf_counter()
            logits = model.forward(ids, np.full((B, 1), cache.length), cache, last_only=True)
            if model.stage is not None:  # pipeline stages: the tokens back from the last, as generate does
                model.stage.tokens(None if logits is None else ids[:, 0], B)
            times.append(comm.allreduce_object(time.perf_counter() - t, op="max"))
        out[B] = float(np.median(times[min(5, reps // 2) :]))  # the first steps warm caches
    return out


def _in_turn(comm, model, value: int) -> int:
    """A figure of one step on its critical path: the busiest rank's, summed over the
    pipeline stages (one stream passes through them in turn)."""
    stage = model.stage.index if model.stage is not None else 0
    busiest: dict[int, int] = {}
    for s, v in comm.allgather_object((stage, value)):
        busiest[s] = max(busiest.get(s, 0), v)
    return sum(busiest.values())


def run(comm, model_name: str | None, options: LoadOptions, batches=BATCHES, say=print) -> dict:
    """Load the model (``None``: the default one) as ``options`` says, time the steps, print
    the table on rank 0; returns the figures. With pipeline stages a step is one pass through
    every stage (and the tokens back), and its floor the stages' streamed bytes in turn."""
    from ..models.llama import LlamaForCausalLM
    from ..models.pipeline import describe
    from ..models.resolve import model_dir

    path = model_dir(model_name, comm)
    model = LlamaForCausalLM.from_pretrained(str(path), comm, options)
    held = comm.allgather_object(model.weight_bytes())
    streamed = _in_turn(comm, model, model.streamed_bytes())
    kinds = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(model.weight_formats().items()))
    madds = _in_turn(comm, model, model.multiply_adds())
    ceiling = weights_bandwidth(model, comm, reps=5)
    rate = fma_rate(comm=comm)
    steps = step_times(model, comm, batches)
    bw_floor = streamed / (ceiling * 1e9)
    floors = {B: max(bw_floor, B * madds / rate) for B in batches}
    where = describe(comm.size, model.stage)
    say(
        f"# mpitp bench decode: {path.name}, {where}, --weights {options.weights}, {model.arithmetic()}, "
        f"KV cache {model.kv_dtype}"
    )
    say(f"# weights per rank: {', '.join(f'{b / 2**20:.1f}' for b in held)} MiB (rank 0: {kinds})")
    say(
        f"# streamed per step by the busiest rank {streamed / 2**20:.1f} MiB"
        f"{' (summed over the stages, which run in turn)' if options.pp > 1 else ''}; "
        f"read bandwidth {ceiling:.2f} GB/s "
        f"per rank (its weights read, all ranks at once, same run) -> floor {bw_floor * 1e3:.2f} ms a step"
    )
    say(
        f"# multiply-adds per row of the batch {madds:,} on the busiest rank; float32 BLAS "
        f"{rate / 1e9:.1f} G/s per rank (sgemm 512^3, same run) -> {madds / rate * 1e3:.3f} ms per row"
    )
    say("# floor = the larger of the two; 'of floor' = floor / step")
    say(
        f"# {'batch':>5} {'step ms':>9} {'vs b1':>7} {'tokens/s':>9} {'of ceiling':>11} {'floor ms':>9} {'of floor':>9}"
    )
    for B, t in steps.items():
        say(
            f"  {B:>5} {t * 1e3:>9.2f} {t / steps[batches[0]]:>6.2f}x {B / t:>9.1f} {bw_floor / t:>10.0%} "
            f"{floors[B] * 1e3:>9.2f} {floors[B] / t:>8.0%}"
        )
    return {
        "weights_per_rank": held,
        "streamed": streamed,
        "ceiling_gbs": ceiling,
        "multiply_adds": madds,
        "fma_rate": rate,
        "floors": floors,
        "steps": steps,
    }
