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
        rows.append({"stage": s, "memory_bytes": mem[s], "volume_psi": v,
                     "volume_bytes": v * params * grad_bytes,
                     "sent_per_rank_bytes": v * params * grad_bytes * (ranks - 1) / ranks})
    return {"params": params, "ranks": ranks, "K": k, "stages": rows}
