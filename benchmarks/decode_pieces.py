"""Where a decode step's time goes, piece by piece, on every rank at once.

    mpiexec -n 2 python benchmarks/decode_pieces.py                 # the default model, batches 1 and 8
    mpiexec -n 2 python benchmarks/decode_pieces.py --batches 1,8,16 --model DIR

The layer loop of a decode step (:mod:`mpitp.models.decode_step`) runs each half layer as
one compiled call between two all-reduces. Here the same kernels run one at a time, on
the same arrays in the same order, with a clock around each: the norms, each matmul's
quantizer and kernel (``mpitp.kernels.fused._matmul``, the quantizer also timed apart),
attention's core, swiglu, the all-reduces (which hold a rank's wait for the slowest), then
the LM head with its all-gather and the embedding. Each row is ms a step (the median of
``--steps``), one figure per rank, after a prompt of ``--context`` tokens per sequence,
each sequence its own token (as ``mpitp bench decode``). The last column is the whole
step through ``model.forward`` (the slowest rank), measured in the same loop.

Read the all-reduce rows as wait plus transfer: a rank that finishes its half first waits
there for the other. With 3 KV heads on 2 ranks, rank 0 holds two and rank 1 one, so rank
1's first all-reduce holds most of the difference of the attention halves.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
from numba import njit

from mpitp.comm import Communicator
from mpitp.kernels import decode as K
from mpitp.kernels import fused
from mpitp.kernels.calls import quantizer_at
from mpitp.models.layers import Step
from mpitp.models.llama import LlamaForCausalLM
from mpitp.models.resolve import model_dir


@njit
def _quantize_only(plan, x):
    """The quantizers of a matmul's plan alone (what ``fused._matmul`` runs first)."""
    M, k = x.shape
    q = fused._Q
    for p in plan:
        quantizer_at(p[q], x.ctypes.data, p[q + 2], p[q + 3], p[q + 4], M, k, p[q + 1])


def pieces(model, fast, B: int, context: int, steps: int, comm) -> dict[str, float]:
    """ms a step per piece on this rank (median over ``steps``), and the whole forward."""
    cache = model.new_cache(B, context + steps + 4)
    cache.valid[:, : context + 1] = True
    cache.length = context
    ids = ((42 + 997 * np.arange(B, dtype=np.int64)) % model.config.vocab_size).reshape(B, 1)
    h0 = model.embed_tokens(ids)
    spans: dict[str, list[float]] = defaultdict(list)
    clock = time.perf_counter
    marks: list[tuple[str, float]] = []  # (piece, the clock when it ended) in one layer

    def mark(name: str) -> None:
        marks.append((name, clock()))

    def matmul(plan, x, out, name: str) -> None:
        """A matmul as the fused halves run it (x quantized, then the kernel), timed apart."""
        _quantize_only(plan, x)
        mark("quantize")
        fused._matmul(plan, x, out)
        mark(name)

    for n in range(steps):
        s = context + n
        cache.valid[:, s] = True
        step = Step(model.rotary, np.full((B, 1), s), cache, 1, np)
        acc: dict[str, float] = defaultdict(float)
        h = np.array(h0.reshape(B, fast.hidden), np.float32)
        xn, r = np.empty_like(h), np.empty_like(h)
        comm.barrier()
        for i, (w1, (_, nqkv, _), _, w2, (_, ngu, _), _) in enumerate(fast.layers):
            pq, po, pgu, pd = fast.plans[i]
            y = np.empty((B, nqkv), np.float32)
            att = np.empty((B, fast.q_width), np.float32)
            g = np.empty((B, ngu), np.float32)
            act = np.empty((B, ngu // 2), np.float32)
            cache.length = s
            marks.clear()
            mark("")
            if i:
                fused._residual(h, r, fast.none, 1)
            K.rms_norm(h, w1, fast.eps, xn)
            mark("norms")
            matmul(pq, xn, y, "qkv")
            kv = K._cache(cache.k[i], cache.v[i])
            fused._attend_core(fast.core, y, step.cos1, step.sin1, kv, cache.valid, s, fast.nh, fast.nkv,
                               fast.head_dim, fast.scale, step.masked, att)  # fmt: skip
            mark("attention core")
            matmul(po, att, r, "o")
            comm.allreduce(r, out=r)
            mark("all-reduce (attention)")
            fused._residual(h, r, fast.none, 1)
            K.rms_norm(h, w2, fast.eps, xn)
            mark("norms")
            matmul(pgu, xn, g, "gate_up")
            K.swiglu(g, act)
            mark("swiglu")
            matmul(pd, act, r, "down")
            comm.allreduce(r, out=r)
            mark("all-reduce (mlp)")
            for (_, a), (name, b) in zip(marks, marks[1:]):
                acc[name] += b - a
        t = clock()
        model.lm_head(model.norm(h[:, None]))
        acc["LM head + all-gather"] += clock() - t
        t = clock()
        model.embed_tokens(ids)
        acc["embedding"] += clock() - t
        cache.length = s
        comm.barrier()
        t = clock()
        model.forward(ids, np.full((B, 1), s), cache, last_only=True)
        acc["forward (whole step)"] = comm.allreduce_object(clock() - t, op="max")
        for k, v in acc.items():
            spans[k].append(v)
    skip = min(3, steps // 2)  # the first steps warm caches
    return {k: float(np.median(v[skip:])) * 1e3 for k, v in spans.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory or name (default: the embedded default model)")
    ap.add_argument("--batches", default="1,8", help="comma list (default 1,8)")
    ap.add_argument("--context", type=int, default=40, help="cached tokens per sequence (default 40)")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per batch (default 15)")
    args = ap.parse_args()
    with Communicator() as comm:
        model = LlamaForCausalLM.from_pretrained(str(model_dir(args.model, comm)), comm=comm)
        fast = model._decode_layers()
        if fast is None or any(p is None for p in fast.plans):
            raise SystemExit(
                "decode_pieces: this model's decode step is not the fused int8 loop (float32 activations?)"
            )
        say = print if comm.rank == 0 else (lambda *a: None)
        say(f"# ms a step, rank 0 / rank 1 / ...; {model.arithmetic()}, {comm.size} ranks, context {args.context}")
        for B in (int(b) for b in args.batches.split(",")):
            rows = comm.allgather_object(pieces(model, fast, B, args.context, args.steps, comm))
            say(f"batch {B}")
            parts = 0.0
            for name in rows[0]:
                say(f"  {name:<24} " + " / ".join(f"{r[name]:6.2f}" for r in rows))
                parts += rows[0][name] if name != "forward (whole step)" else 0.0
            say(f"  {'sum of the pieces':<24} {parts:6.2f} (rank 0)")


if __name__ == "__main__":
    main()
