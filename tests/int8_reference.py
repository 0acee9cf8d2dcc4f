"""An independent NumPy statement of the activation quantizers' rules (DESIGN.md §10), to
check the compiled ones (mpitp.kernels.quantize, mpitp.kernels.ir.quantize) against: written from the
rules, not from their code, in float64 where the rule allows, one block at a time.

    Q8_0 digit:  d = amax / 127 (float32),  q = round(x · (1/d)) half away from zero
    int8x2:      digit 1 of x, digit 2 of x - d·q (float32: a multiply, then a subtract)
    int8x2/256:  int8x2 with each digit's d = amax / 127 over a super-block of 256 values
                 (ggml's Q8_K grouping; d still listed per 32, the 8 equal)
    int8o:       in each block, |x| > 4 · sqrt((Σx² - amax²) / 31) (and that cut > 0) goes
                 to digit 2, quantized in its own block; the rest to digit 1

Each returns (q, d) with the digits interleaved as the kernels read them: x's row i at
q[D·i + j] for digit j; d [D·M, K/32]."""

import numpy as np

LIMIT = 4.0  # int8o's rule, as the issue states it; checked equal to the kernels' constant


def q8_0(v: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """ggml's Q8_0 of float32 ``v`` [M, K]: (q int8 [M, K], d float32 [M, K/32]); ``group``
    256: one d for each 256 values (Q8_K's), listed for each of its 8 blocks."""
    M, K = v.shape
    b = v.reshape(M, K // 32, 32).astype(np.float32)
    amax = np.abs(b).max(-1)
    if group == 256:
        amax = np.repeat(amax.reshape(M, K // 256, 8).max(-1), 8, axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    t = (b * inv[..., None]).astype(np.float32).astype(np.float64)  # the float32 product, exactly
    q = np.sign(t) * np.floor(np.abs(t) + 0.5)  # float64: exact for any float32 t
    return q.astype(np.int8).reshape(M, K), d


def outlier_mask(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(big [M, K] bool: int8o's outliers, the cut per block [M, K/32] float64)."""
    M, K = x.shape
    b = np.abs(x.reshape(M, K // 32, 32).astype(np.float64))
    amax = b.max(-1)
    rest = np.maximum((b * b).sum(-1) - amax * amax, 0.0)
    cut = LIMIT * np.sqrt(rest / 31)
    big = (b > cut[..., None]) & (cut[..., None] > 0)
    return big.reshape(M, K), cut


def interleave(*digits):
    """Digits [M, ...] each -> [D·M, ...] with x's row i at D·i + j."""
    D, M = len(digits), digits[0].shape[0]
    out = np.empty((D * M,) + digits[0].shape[1:], digits[0].dtype)
    for j, a in enumerate(digits):
        out[j::D] = a
    return out


def quantize(x: np.ndarray, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 under ``scheme`` ('int8', 'int8x2', 'int8x2/256', 'int8o') -> (q, d)
    interleaved."""
    x = np.ascontiguousarray(x, np.float32)
    if scheme == "int8":
        return q8_0(x)
    if scheme in ("int8x2", "int8x2/256"):
        group = 256 if scheme.endswith("/256") else 32
        q1, d1 = q8_0(x, group)
        step = (np.repeat(d1, 32, axis=1) * q1.astype(np.float32)).astype(np.float32)
        q2, d2 = q8_0((x - step).astype(np.float32), group)
        return interleave(q1, q2), interleave(d1, d2)
    if scheme == "int8o":
        big, _ = outlier_mask(x)
        q1, d1 = q8_0(np.where(big, np.float32(0), x))
        q2, d2 = q8_0(np.where(big, x, np.float32(0)))
        return interleave(q1, q2), interleave(d1, d2)
    raise ValueError(scheme)


def dequantized(q: np.ndarray, d: np.ndarray, digits: int) -> np.ndarray:
    """The float64 value the digits hold: Σ over digits of d·q, [M, K]."""
    DM, K = q.shape
    v = (q.reshape(DM, K // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)).reshape(DM, K)
    return v.reshape(DM // digits, digits, K).sum(1)


def sums(q: np.ndarray, d: np.ndarray, digits: int, group: int) -> np.ndarray:
    """x's sums the kernels take (a weight's minimum multiplies them): per ``group`` (32 or
    16) values, Σ over digits of d·Σq, float64 [M, K/group]."""
    DM, K = q.shape
    per = q.reshape(DM, K // group, group).astype(np.int64).sum(-1) * np.repeat(d, 32 // group, axis=1)
    return per.reshape(DM // digits, digits, -1).sum(1)


def k_blocks(rng, t: str, n: int, k: int) -> np.ndarray:
    """Random blocks of GGML type t (sane scales, any quants) as a file holds them; K-quants'
    super-block scales of either sign and size."""
    from mpitp.bench.shapes import random_blocks

    raw = random_blocks(rng, t, n, k)
    if t in ("Q4_K", "Q6_K"):
        per = raw.reshape(-1, 144 if t == "Q4_K" else 210)
        at = slice(0, 2) if t == "Q4_K" else slice(208, 210)
        d = per[:, at].copy().view(np.float16)[:, 0] * rng.uniform(-3, 3, per.shape[0]).astype(np.float16)
        per[:, at] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw
