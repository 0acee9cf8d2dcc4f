"""ZeRO / FSDP memory and communication per rank (Rajbhandari et al., arXiv 1910.02054).

Mixed-precision Adam keeps 2 bytes of fp16 parameters, 2 of fp16 gradients and K = 12 of
optimizer state (fp32 master weights, momentum, variance) per parameter, Psi parameters,
N data-parallel ranks (Table 1)::

    baseline DP          (2 + 2 + K) Psi
    ZeRO-1  (P_os)       2 Psi + 2 Psi + K Psi / N
    ZeRO-2  (P_os+g)     2 Psi + (2 + K) Psi / N
    ZeRO-3  (P_os+g+p)   (2 + 2 + K) Psi / N

Communication volume per step (section 7): DP all-reduce 2 Psi; ZeRO-1/2 reduce-scatter +
all-gather 2 Psi; ZeRO-3 all-gather in forward + all-gather in backward + reduce-scatter
3 Psi. Each ring rank sends (N-1)/N of every volume.
"""

from __future__ import annotations

STAGES = ("dp", "zero1", "zero2", "zero3")


def memory_per_rank(params: float, ranks: int, k: int = 12) -> dict:
    psi, n = float(params), ranks
    return {
        "dp": (2 + 2 + k) * psi,
        "zero1": 2 * psi + 2 * psi + k * psi / n,
        "zero2": 2 * psi + (2 + k) * psi / n,
        "zero3": (2 + 2 + k) * psi / n,
    }


def volume(stage: str) -> int:
    """Communication volume per step in units of Psi elements."""
    return 3 if stage == "zero3" else 2


def plan(params: float, ranks: int, k: int = 12, grad_bytes: int = 2) -> dict:
    mem = memory_per_rank(params, ranks, k)
    rows = []
    for s in STAGES:
        v = volume(s)
        rows.append(
            {
                "stage": s,
                "memory_bytes": mem[s],
                "volume_psi": v,
                "volume_bytes": v * params * grad_bytes,
                "sent_per_rank_bytes": v * params * grad_bytes * (ranks - 1) / ranks,
            }
        )
    return {"params": params, "ranks": ranks, "K": k, "stages": rows}


def fp32_memory(padded: list[int], ranks: int, mode: str) -> int:
    """Bytes per rank held between steps by mpitp's trainer with fp32 parameters,
    gradients and AdamW moments (K = 8): ``padded`` are the units' padded element counts
    (each a multiple of ``ranks``). ddp 16Ψ; zero1 4Ψ + 4Ψ + 8Ψ/N; zero2 4Ψ + 12Ψ/N;
    fsdp 16Ψ/N."""
    psi, n = sum(padded), ranks
    return {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi // n, "zero2": 4 * psi + 12 * psi // n, "fsdp": 16 * psi // n}[
        mode
    ]


def train_step_bytes(
    padded: list[int],
    gathered_backward: list[bool],
    kept: list[bool],
    ranks: int,
    mode: str,
    itemsize: int,
    accum: int = 1,
    *,
    param_itemsize: int | None = None,
    reduce_itemsize: int | None = None,
) -> int:
    """Bytes one rank sends per training step with ring collectives: each ring all-gather
    or reduce-scatter of P elements sends (N-1)/N·P, an all-reduce twice that.

    ddp: one all-reduce of every unit; zero1: one reduce-scatter and one all-gather; zero2:
    a reduce-scatter per micro-batch and one all-gather; fsdp, per micro-batch: a gather of
    every unit in forward, again in backward for the units that need it (not ``kept``
    ones, whose gather lasts the step), and a reduce-scatter. Plus the loss (and, with
    sharded gradients, the gradient norm): one float64 each, through MPI. With mixed
    precision the gathers carry ``param_itemsize`` bytes an element and the reductions
    ``reduce_itemsize`` (default: ``itemsize``)."""
    n = ranks
    if n == 1:
        return 0
    ps, rs = param_itemsize or itemsize, reduce_itemsize or itemsize
    gather = lambda p: (n - 1) * (p // n) * ps  # noqa: E731
    reduce = lambda p: (n - 1) * (p // n) * rs  # noqa: E731
    total = sum(padded)
    if mode == "ddp":
        return 2 * reduce(total) + 8
    if mode == "zero1":
        return reduce(total) + gather(total) + 16
    if mode == "zero2":
        return accum * reduce(total) + gather(total) + 16
    bwd = sum(p for p, g, k in zip(padded, gathered_backward, kept) if g and not k)
    return accum * (gather(total) + gather(bwd) + reduce(total)) + 16
