"""LLVM IR that decodes the tiles' weight blocks (:mod:`.tiles`) for the int8 kernels: a
format's name parsed, each tile row's scale (float32, or float16 widened), the K-quants'
integer scales and minimums, Q6_K's 6-bit quants from their two planes."""

from __future__ import annotations

from ..cpu import FACTS
from .build import Body, idx, load, offset_at, per_tile, splat


def parse(fmt: str) -> tuple[str, bool, bool]:
    """ "q40h" -> ("q4", Q4_0's implied minimum, float16 scales)."""
    half = fmt.endswith("h") and fmt[:-1] in ("q4", "q40", "q8", "q4k", "q6k")
    core = fmt[:-1] if half else fmt
    return ("q4" if core == "q40" else core), core == "q40", half


def scales(e: Body, isa: str, ptr: str, offset, half: bool) -> str:
    """F: each row's scale at element ``offset(tb, ts)`` of ``ptr`` (float32, or float16)."""
    if not half:
        return per_tile(e, "<8 x float>", ptr, offset, "float")
    if FACTS[isa].f16c:  # vcvtph2ps
        return e(f"fpext <{e.V} x half> {per_tile(e, '<8 x half>', ptr, offset, 'half')} to {e.F}")
    h = e(f"zext <8 x i16> {per_tile(e, '<8 x i16>', ptr, offset, 'i16')} to <8 x i32>")
    low15, top = splat("i32", 8, 0x7FFF), splat("i32", 8, 0x8000)
    mag = e(f"shl <8 x i32> {e(f'and <8 x i32> {h}, {low15}')}, {splat('i32', 8, 13)}")
    sign = e(f"shl <8 x i32> {e(f'and <8 x i32> {h}, {top}')}, {splat('i32', 8, 16)}")
    f = e(f"bitcast <8 x i32> {e(f'or <8 x i32> {mag}, {sign}')} to <8 x float>")
    return e(f"fmul <8 x float> {f}, {splat('float', 8, '0x46F0000000000000')}")  # × 2^112: exact


def k_scales(e: Body, fmt: str, isa: str, half: bool) -> tuple[list[str], list[tuple[str, int]]]:
    """The K-quants' float scales of this step's rows, formed from the integer ones as
    the planar weight forms them (:mod:`.tiles`): (scale vectors, minimum vectors)."""
    raws = [load(e, "<16 x i8>", "%d", e(f"shl i64 {tb}, 4", "ko")) for tb, _ in e.tiles]  # 16 bytes a (tile, block)
    b, V = raws[-1], e.V  # each tile's first 8 bytes, then its last 8
    lo = e(f"shufflevector <16 x i8> {raws[0]}, <16 x i8> {b}, {idx([*range(8), *range(16, 16 + V - 8)])}")
    hi = e(f"shufflevector <16 x i8> {raws[0]}, <16 x i8> {b}, {idx([*range(8, 16), *range(24, 24 + V - 8)])}")
    F = e.F
    if fmt == "q4k":  # sc | mn (unsigned 6 bits); m: d | dmin per super-block
        dd = scales(e, isa, "%m", offset_at(e, 4, 0, 1), half)
        dmin = scales(e, isa, "%m", offset_at(e, 4, 8, 1), half)
        sc = e(f"uitofp <{V} x i8> {lo} to {F}")
        mn = e(f"uitofp <{V} x i8> {hi} to {F}")
        ndmin = e(f"fneg {F} {dmin}")
        return [e(f"fmul {F} {dd}, {sc}")], [(e(f"fmul {F} {ndmin}, {mn}"), -1)]
    dd = scales(e, isa, "%m", offset_at(e, 3, 0, 1), half)  # q6k: signed scales of k 0-15 | 16-31; m: d per super-block
    dvs = [e(f"fmul {F} {dd}, {e(f'sitofp <{V} x i8> {v} to {F}')}") for v in (lo, hi)]
    m32 = splat("float", V, "-32.0")
    return dvs, [(e(f"fmul {F} {dv}, {m32}"), h) for h, dv in enumerate(dvs)]


def k_int_scales(e: Body, fmt: str, half: bool) -> tuple[str, list[str]]:
    """The K-quants' integer scales for avx2's ``vpmaddwd``: (the super-block's d of each
    row of the step, one <16 x i16> a scale group: lanes 2c and 2c+1 hold row c's scale, as
    ``vpmaddubsw`` leaves row c's pair sums): q4k one (unsigned, 6 bits), q6k two (signed:
    k 0-15, 16-31)."""
    raw = load(e, "<16 x i8>", "%d", e(f"shl i64 {e.tiles[0][0]}, 4", "ko"))
    twice = idx([c // 2 for c in range(16)])
    out = []
    for h in (0, 1) if fmt == "q6k" else (0,):
        v = e(f"shufflevector <16 x i8> {raw}, <16 x i8> poison, {idx(range(8 * h, 8 * h + 8))}")
        w = e(f"{'sext' if fmt == 'q6k' else 'zext'} <8 x i8> {v} to <8 x i16>")
        out.append(e(f"shufflevector <8 x i16> {w}, <8 x i16> poison, {twice}"))
    dd = scales(e, "avx2", "%m", offset_at(e, 4 if fmt == "q4k" else 3, 0, 1), half)
    return dd, out


def q4_quants(e: Body) -> list[str]:
    """q4, q4k: the 8 vectors of this block's unsigned 4-bit quants (0..15), the low nibbles
    of its 4 byte vectors, then their high nibbles."""
    B, n = e.B, 4 * e.V
    lo, hi = [], []
    for g in range(4):
        v = per_tile(e, "<32 x i8>", "%qs", offset_at(e, 7, 32 * g))
        lo.append(e(f"and {B} {v}, {splat('i8', n, 15)}"))
        hi.append(e(f"lshr {B} {v}, {splat('i8', n, 4)}"))
    return lo + hi


def q6_quants(e: Body) -> list[str]:
    """q6k: the 8 vectors of this block's unsigned 6-bit quants (0..63), low 4 bits from
    the nibble vectors 0-3, high 2 bits from vectors 4-5."""
    B, n = e.B, 4 * e.V
    nib: list[str] = []
    high: list[str] = []

    def at(g: int):
        return lambda tb, ts: e(f"add i64 {e(f'mul i64 {tb}, 192', 'qo')}, {32 * g}", "qo")

    for g in range(6):
        (nib if g < 4 else high).append(per_tile(e, "<32 x i8>", "%qs", at(g)))
    u = []
    for g in range(8):
        if g < 4:
            lo = e(f"and {B} {nib[g]}, {splat('i8', n, 15)}")
        else:
            lo = e(f"lshr {B} {nib[g - 4]}, {splat('i8', n, 4)}")
        h = high[g // 4]
        if g % 4:
            h = e(f"lshr {B} {h}, {splat('i8', n, 2 * (g % 4))}")
        h = e(f"and {B} {h}, {splat('i8', n, 3)}")
        h = e(f"shl {B} {h}, {splat('i8', n, 4)}")
        u.append(e(f"or {B} {lo}, {h}"))
    return u
