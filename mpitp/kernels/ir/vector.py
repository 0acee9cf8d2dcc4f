"""LLVM IR of the int8 matmul kernels: ``y = x @ Wᵀ`` with x quantized to int8 blocks.

numba cannot emit the integer dot-product instructions (its int8 products widen to
int64), so these kernels are written as LLVM IR, built here from a template, compiled by
:mod:`.jit` with llvmlite (numba's own LLVM) and called through ctypes (which releases the
GIL). One function per (weight format, instruction set, rows of x R, output rows C)::

    for n in 0, C, 2C, ... N-C:                    weights walked once, C rows at a time
        for b in blocks of 32 along K:
            w_c  = block b of row n+c, as 32 bytes  (q4: nibbles 0..15 unsigned; q8: |w|)
            for r < R:  isum = Σ₃₂ w_c · xq_r        <8 x i32>: 4 consecutive k per lane
                        acc[c, r] += float(isum) · (d[n+c, b] · xd[r, b])      8 float lanes
                        t[c, r]   += m[n+c, b] · xs[r, b]                     (q4 minimum)
        y[r, n+c] = Σ lanes acc[c, r] + t[c, r]       for r < M (rows ≥ M are padding)

The weights (:mod:`.formats`)::

    q4  qs [N, K/2] u8: byte j of block b = k 32b+j (low nibble) and 32b+16+j (high)
        d, m [N, K/32] f32                       w = d·q + m   (Q4_0: m = -8d)
    q8  qs [N, K] i8, d [N, K/32] f32            w = d·q

(as tiles, :mod:`.tiles`). A format name may end in "0" (q4 only: m = -8·d, formed in
registers, not read) and "h" (d and m float16, widened by ``vcvtph2ps``, or by integer
moves and one exact multiply by 2¹¹² on the portable path, which may lack F16C).

and the activations (:mod:`.quantize`): xq [R, K] i8, xd [R, K/32] f32 (w = xd·xq),
xs [R, K/32] f32 = xd·Σ xq of the block (what the minimum multiplies).

``isum`` in each instruction set (products and pair sums stay below 2¹⁵, so the 16-bit
step of avx2 never saturates and all three give the same integers)::

    vnni      vpdpbusd(0, w, x)                     (avx512: the same on 512-bit vectors)
    avx2      vpmaddwd(vpmaddubsw(w, x), 1)
    portable  (zext w · sext x) as i16, neighbours added twice -> <8 x i32>

q8's weights are signed: the unsigned operand is |w| and x takes w's sign (ggml's trick).
On avx2, K-quants against x's two digits a scale per super-block (prefill: ``whole``) put
the integer sub-block scales where the 1 is in ``vpmaddwd`` and sum a super-block in int32
(:func:`_whole`).

``avx512`` takes two tiles a step, 16 output rows in the 16 lanes of 512-bit vectors (each
tile's 256-bit loads joined, so the tiles' layout is the same): one broadcast of x and one
``vpdpbusd`` serve 16 rows, half the instructions per weight of 8 lanes. An odd last tile
is paired with itself and its second half stored nowhere.
"""

from __future__ import annotations

from .blocks import k_int_scales, k_scales, parse, q4_quants, q6_quants, scales
from .build import UNLIKELY, Body, bcast, chain, idx, load, offset_at, per_tile, splat
from .frame import any_outlier, frame

DECLARE = """
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32>, <32 x i8>, <32 x i8>)
declare <8 x float> @llvm.fmuladd.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fmuladd.f32(float, float, float)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)
declare <16 x float> @llvm.fmuladd.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare <64 x i8> @llvm.abs.v64i8(<64 x i8>, i1)
"""


def _isum(e: Body, isa: str, u: str, s: str) -> str:
    """<8 x i32>: lane i = Σ_{j<4} u[4i+j]·s[4i+j] (u unsigned, s signed bytes)."""
    if isa == "avx2":
        p = e(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u}, <32 x i8> {s})")
        return e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p}, <16 x i16> {splat('i16', 16, 1)})")
    return _pairs(e, u, s, "zext")


def _pairs(e: Body, u: str, s: str, uext: str) -> str:
    """Portable: products as i16 (``uext`` widens the first operand), neighbours added twice."""
    uw = e(f"{uext} <32 x i8> {u} to <32 x i16>")
    sw = e(f"sext <32 x i8> {s} to <32 x i16>")
    p = e(f"mul <32 x i16> {uw}, {sw}")
    ev = e(f"shufflevector <32 x i16> {p}, <32 x i16> poison, {idx(range(0, 32, 2))}")
    od = e(f"shufflevector <32 x i16> {p}, <32 x i16> poison, {idx(range(1, 32, 2))}")
    p2 = e(f"add <16 x i16> {ev}, {od}")
    q = e(f"sext <16 x i16> {p2} to <16 x i32>")
    ev2 = e(f"shufflevector <16 x i32> {q}, <16 x i32> poison, {idx(range(0, 16, 2))}")
    od2 = e(f"shufflevector <16 x i32> {q}, <16 x i32> poison, {idx(range(1, 16, 2))}")
    return e(f"add <8 x i32> {ev2}, {od2}")


def _xgroups(e: Body, row: str) -> list[str]:
    """A row of xq, this block: 8 groups of 4 bytes, each broadcast to every lane."""
    out = []
    for g in range(8):
        xo = e(f"add i64 {row}, %xo{g}", "xo")
        p = e(f"getelementptr i8, ptr %xq, i64 {xo}", "p")
        xi = e(f"load i32, ptr {p}, align 1")
        v = e(f"insertelement {e.I} poison, i32 {xi}, i64 0")
        sp = e(f"shufflevector {e.I} {v}, {e.I} poison, <{e.V} x i32> zeroinitializer")
        out.append(e(f"bitcast {e.I} {sp} to {e.B}"))
    return out


# Software prefetch of the weights' stream in the kernels for up to PREFETCH_ROWS rows of
# x: each cache line of each tile's block PREFETCH bytes ahead into L1 (prefetcht0), and FAR
# bytes ahead into L2 (prefetcht1): on an Intel Xeon the hardware prefetchers alone left a
# core at ~8.5 GB/s, and the two took a batch-1 step of the 1B Q4_K_M 28% faster
# (docs/measurements.md). int8o's decode kernels (``sparse``) prefetch at 8 and 16 rows too:
# there the multiply-adds wait on the weights as well (Zen 5, 128 experts' 8-row matmuls:
# Q4_K 23.6 -> 15.6 ms, Q6_K 20.8 -> 9.8 ms, Q4_K on avx2 39.0 -> 26.8 ms). Prefill's
# kernels (8 or 16 rows, dense digits) reread a span of weights from the cache: none there.
PREFETCH, FAR, PREFETCH_ROWS = 2048, 6144, 4
# int8o's kernels for up to this many rows of x loop over the blocks in segments (frame()),
# with more a branch per block: the same sums in the same order either way
SEGMENT_ROWS = 1
BLOCK_BYTES = {"q4": 128, "q4k": 128, "q8": 256, "q6k": 192}  # qs bytes of one (tile, block)


def prefetch(e: Body, fmt: str, far: bool = True) -> None:
    """``llvm.prefetch`` of each cache line of this block's quants in each tile of the
    step: PREFETCH bytes on into every level, then FAR bytes on into L2 (``far``)."""
    size = BLOCK_BYTES[fmt]
    for tb, _ in e.tiles:
        at = e(f"mul i64 {tb}, {size}", "pf")
        for ahead, level in ((PREFETCH, 3), (FAR, 2))[: 2 if far else 1]:
            for line in range(0, size, 64):
                o = e(f"add i64 {at}, {ahead + line}", "pf")
                p = e(f"getelementptr i8, ptr %qs, i64 {o}", "pf")  # past the end too: a hint never faults
                e.do(f"call void @llvm.prefetch.p0(ptr {p}, i32 0, i32 {level}, i32 1)")


def kernel(
    fmt: str, isa: str, R: int, D: int = 1, G: int = 32, sparse: bool = False, whole: bool = False
) -> tuple[str, str]:
    """(name, IR text) of the kernel for R rows of x over whole tiles of 8 output rows,
    each row of x held as D int8 digits (xq rows D·r + j; xs in row D·r), the weights
    with a scale per G = 32 weights (or 16: q8 only, d [T, K/16, 8]). ``sparse``: the
    second digit holds x's outliers (:func:`.quantize.quantize_rows_outliers`), zero in most
    blocks, and is multiplied only in blocks where some row's is not (a branch per block;
    up to SEGMENT_ROWS rows, after a loop over each run of blocks without one: frame()).
    ``whole``: avx2's K-quant kernel for x two digits a scale per super-block (:func:`_whole`)."""
    name = f"{fmt}_{isa}_r{R}_d{D}_g{G}" + ("_o" if sparse else "") + ("_s" if whole else "")
    if whole:
        if isa != "avx2" or sparse or G != 32:
            raise ValueError(f"no int8 kernel for {name}")
        return name, _whole(name, fmt, R, D)
    fmt, implied, half = parse(fmt)
    known = fmt in ("q4", "q8", "q4k", "q6k") and isa in ("avx512", "vnni", "avx2", "portable") and D in (1, 2)
    if (
        not known
        or (sparse and D != 2)
        or G not in (16, 32)
        or (G == 16 and fmt != "q8")
        or (fmt in ("q4k", "q6k") and G != 32)
    ):
        raise ValueError(f"no int8 kernel for {name}")
    e = Body(16 if isa == "avx512" else 8)
    F = e.F
    segments = sparse and R <= SEGMENT_ROWS
    for r in range(R):  # (a segmented kernel's loop is the frame's: its phis are there)
        if not segments:
            e.do(f"%acc{r} = phi {F} [zeroinitializer, %tile], [%acc{r}_n, %{'join' if sparse else 'blk'}]")
    _block_indices(e)
    if R <= PREFETCH_ROWS or sparse:
        prefetch(e, fmt)
    mins: list[tuple[str, int]] = []  # (minimum vector, which per-16 sum of x: 0/1; -1 per 32)
    if fmt in ("q4k", "q6k"):
        dvs, mins = k_scales(e, fmt, isa, half)
    elif G == 32:  # 8 rows' scales per (tile, block)
        dvs = [scales(e, isa, "%d", offset_at(e, 3), half)]
    else:  # two scales a block: d[t, 2b] and d[t, 2b + 1], 8 rows each
        dvs = [scales(e, isa, "%d", offset_at(e, 4, h * 8), half) for h in (0, 1)]
    if fmt == "q4" and implied:
        mins = [(e(f"fmul {F} {dvs[0]}, {splat('float', e.V, '-8.0')}"), -1)]
    elif fmt == "q4":
        mins = [(scales(e, isa, "%m", offset_at(e, 3), half), -1)]
    u, w = [], []
    B = e.B
    if fmt in ("q4", "q4k"):
        u = q4_quants(e)
    elif fmt == "q6k":
        u = q6_quants(e)
    else:
        for g in range(8):
            w.append(per_tile(e, "<32 x i8>", "%qs", offset_at(e, 8, 32 * g)))
            if isa != "portable":
                u.append(e(f"call {B} @llvm.abs.v{4 * e.V}i8({B} {w[g]}, i1 false)"))
    main = 1 if sparse else D  # digits every block multiplies; the sparse one only where x has one
    for r in range(R):
        terms = [t for j in range(main) for t in _digit_terms(e, fmt, isa, u, w, dvs, r, j)]
        chain(e, f"%acc{r}", terms + _min_terms(e, mins, r), f"%acc{r}_a" if sparse else f"%acc{r}_n")
    if segments:  # the outliers' digit, zero (d = +0.0) in the blocks where no row has one:
        # multiplied after the loop over the blocks before it (the frame's segments)
        o = Body(e.V)
        o.n, o.tiles = e.n, e.tiles
        for r in range(R):
            chain(o, f"%acc{r}_a", _digit_terms(o, fmt, isa, u, w, dvs, r, 1), f"%acc{r}_s")
        return name, frame(name, e, R, D, "blk", outliers=o)
    latch = "blk"
    if sparse:  # with more rows of x more blocks have an outlier in some row: a branch per
        # block (a segment's loop exit is a mispredicted branch, where the block's own is
        # learnt: TP=2 1B Q4_K_M batch 4, 39.0 ms a step with the branch, 41.6-42.4 segmented).
        # The rows' scales' bits OR-ed as integers, one test and one branch
        any_outlier(e, R, "%b", "%some")
        e.do("br i1 %some, label %sparse, label %join, !prof !0")  # rare: kept a branch, not if-converted
        e.lines.append("sparse:")
        for r in range(R):
            chain(e, f"%acc{r}_a", _digit_terms(e, fmt, isa, u, w, dvs, r, 1), f"%acc{r}_s")
        e.do("br label %join")
        e.lines.append("join:")
        for r in range(R):
            e.do(f"%acc{r}_n = phi {F} [%acc{r}_a, %blk], [%acc{r}_s, %sparse]")
        latch = "join"
    return name, frame(name, e, R, D, latch)


def _block_indices(e: Body) -> None:
    """This block's offsets: x's (%xb, and its 8 groups of 4 %xo0-7), x's sums per 16 (%b20,
    %b21), and each tile's (tile, block) and (tile, super-block) index."""
    e.do("%xb = shl i64 %b, 5")
    e.do("%b20 = shl i64 %b, 1")  # x's sums per 16 of this block: 2b, 2b + 1
    e.do("%b21 = add i64 %b20, 1")
    e.do("%bs = lshr i64 %b, 3")  # its super-block (K-quants)
    for j, (tb, ts) in enumerate(e.tiles):
        sfx = f"_{j}" if j else ""
        e.do(f"{ts} = add i64 %tS{sfx}, %bs")
        e.do(f"{tb} = add i64 %tnb{sfx}, %b")  # (tile, block) index
    for g in range(8):
        e.do(f"%xo{g} = add i64 %xb, {4 * g}" if g else "%xo0 = add i64 %xb, 0")


def _min_terms(e: Body, mins: list[tuple[str, int]], r: int) -> list[tuple[str, str]]:
    """(minimum vector, x's sum for it) of row r this block: per 32 (xs [R·D, nb]) or per 16
    (xs [R·D, 2·nb])."""
    terms = []
    for mv, h in mins:
        if h < 0:
            xsum = load(e, "float", "%xs", e(f"add i64 %xdrow{r}_0, %b", "xb"), "float")
        else:
            at = e(f"add i64 %xsrow{r}, %b2{h}", "xb")
            xsum = load(e, "float", "%xs", at, "float")
        terms.append((mv, bcast(e, xsum)))
    return terms


def _whole(name: str, fmt: str, R: int, D: int) -> str:
    """avx2's K-quant kernel for x with one scale per super-block and digit (``whole``:
    :func:`.quantize.quantize_rows2` with ``whole``): each block's sums scaled by the
    weights' integer sub-block scales in ``vpmaddwd`` (where the others multiply by 1) and
    added as integers over the super-block; one conversion and multiply-add a row and digit
    per super-block, where the others take one a block::

        ia[r, j] += vpmaddwd(Σ vpmaddubsw(w, xq[r, j]), sc)        every block (int32)
        acc[r]   += mins(r)                                        every block (float)
        acc[r]   += float(ia[r, j]) · (d · xd[r, j]); ia = 0        each super-block's last block
    """
    fmt, _, half = parse(fmt)
    if fmt not in ("q4k", "q6k") or D != 2:
        raise ValueError(f"no int8 kernel for {name}")
    e = Body(8)
    F, I = e.F, e.I
    for r in range(R):
        e.do(f"%acc{r} = phi {F} [zeroinitializer, %tile], [%acc{r}_n, %kjoin]")
        for j in range(D):
            e.do(f"%ia{r}_{j} = phi {I} [zeroinitializer, %tile], [%ia{r}_{j}_n, %kjoin]")
    _block_indices(e)
    _, mins = k_scales(e, fmt, "avx2", half)
    dd, sc16 = k_int_scales(e, fmt, half)
    u = q4_quants(e) if fmt == "q4k" else q6_quants(e)
    for r in range(R):
        for j in range(D):
            xs = _xgroups(e, f"%xrow{r}_{j}")
            isum = None
            per = 8 if fmt == "q4k" else 2  # groups summed in int16 before vpmaddwd (< 2^15)
            for g0 in range(0, 8, per):
                p16 = None
                for g in range(g0, g0 + per):
                    p = e(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u[g]}, <32 x i8> {xs[g]})")
                    p16 = p if p16 is None else e(f"add <16 x i16> {p16}, {p}")
                sc = sc16[g0 // 4] if fmt == "q6k" else sc16[0]
                part = e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p16}, <16 x i16> {sc})")
                isum = part if isum is None else e(f"add <8 x i32> {isum}, {part}")
            e.do(f"%ia{r}_{j}_a = add {I} %ia{r}_{j}, {isum}")
        chain(e, f"%acc{r}", _min_terms(e, mins, r), f"%acc{r}_a")
    e.do("%b7 = and i64 %b, 7")
    e.do("%sbend = icmp eq i64 %b7, 7")
    e.do("br i1 %sbend, label %kflush, label %kjoin")
    e.lines.append("kflush:")
    for r in range(R):
        terms = []
        for j in range(D):
            xd = bcast(e, load(e, "float", "%xd", e(f"add i64 %xdrow{r}_{j}, %b", "xb"), "float"))
            terms.append((e(f"sitofp {I} %ia{r}_{j}_a to {F}"), e(f"fmul {F} {dd}, {xd}")))
        chain(e, f"%acc{r}_a", terms, f"%acc{r}_f")
    e.do("br label %kjoin")
    e.lines.append("kjoin:")
    for r in range(R):
        e.do(f"%acc{r}_n = phi {F} [%acc{r}_a, %blk], [%acc{r}_f, %kflush]")
        for j in range(D):
            e.do(f"%ia{r}_{j}_n = phi {I} [%ia{r}_{j}_a, %blk], [zeroinitializer, %kflush]")
    return frame(name, e, R, D, "kjoin")


def _block_isum(e: Body, fmt: str, isa: str, u: list[str], w: list[str], xs: list[str], groups=range(8)) -> str:
    """I: each lane's row of this block of weights · one row of x (the groups of 4 k asked
    for: all 8, or a half for a scale per 16)."""
    isum: str | None = None
    p16: str | None = None
    pending: str | None = None  # q6k on avx2: one group's int16 pair sums, awaiting the next
    B, I = e.B, e.I
    for g in groups:
        s = xs[g]
        if fmt == "q8" and isa == "avx2":  # x takes the sign of w, which became |w|: vpsignb
            s = e(f"call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {s}, <32 x i8> {w[g]})")
        elif fmt == "q8" and isa != "portable":
            nx = e(f"sub {B} zeroinitializer, {s}")
            neg = e(f"icmp slt {B} {w[g]}, zeroinitializer")
            s = e(f"select <{4 * e.V} x i1> {neg}, {B} {nx}, {B} {s}")
        if isa in ("vnni", "avx512"):
            acc = isum or "zeroinitializer"
            isum = e(f"call {I} @llvm.x86.avx512.vpdpbusd.{32 * e.V}({I} {acc}, {B} {u[g]}, {B} {s})")
        elif isa == "avx2" and fmt in ("q4", "q4k"):  # 8 pair sums of ≤ 2·15·127 fit int16: one widening
            p = e(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u[g]}, <32 x i8> {s})")
            p16 = p if p16 is None else e(f"add <16 x i16> {p16}, {p}")
        elif isa == "avx2" and fmt == "q6k":  # 2 pair sums of ≤ 2·63·127 fit int16: a widening per two groups
            p = e(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u[g]}, <32 x i8> {s})")
            if pending is None:
                pending = p
                continue
            both = e(f"add <16 x i16> {pending}, {p}")
            pending = None
            part = e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {both}, <16 x i16> {splat('i16', 16, 1)})")
            isum = part if isum is None else e(f"add <8 x i32> {isum}, {part}")
        else:
            if isa == "avx2":
                part = _isum(e, isa, u[g], s)
            else:
                signed = fmt == "q8"
                part = _pairs(e, w[g] if signed else u[g], s, "sext" if signed else "zext")
            isum = part if isum is None else e(f"add <8 x i32> {isum}, {part}")
    if pending is not None:  # an odd group left
        part = e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {pending}, <16 x i16> {splat('i16', 16, 1)})")
        isum = part if isum is None else e(f"add <8 x i32> {isum}, {part}")
    if p16 is not None:
        isum = e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p16}, <16 x i16> {splat('i16', 16, 1)})")
    assert isum is not None
    return isum


def _digit_terms(e: Body, fmt: str, isa: str, u, w, dvs, r: int, j: int) -> list[tuple[str, str]]:
    """(integer sums as floats, their scale) of digit j of row r against this block."""
    xs = _xgroups(e, f"%xrow{r}_{j}")
    xd = bcast(e, load(e, "float", "%xd", e(f"add i64 %xdrow{r}_{j}, %b", "xb"), "float"))
    halves = [range(8)] if len(dvs) == 1 else [range(4), range(4, 8)]  # k 0-15, 16-31
    out = []
    for dv, gs in zip(dvs, halves):
        f = e(f"sitofp {e.I} {_block_isum(e, fmt, isa, u, w, xs, gs)} to {e.F}")
        out.append((f, e(f"fmul {e.F} {dv}, {xd}")))
    return out


def module(fmt_isa_rc: list[tuple], build=None, declare: str = DECLARE) -> tuple[list[str], str]:
    """(names, one module's IR) for several kernels (``build``: the generator of one,
    :func:`kernel` unless given; ``declare``: the intrinsics they call)."""
    names, bodies = [], []
    for spec in fmt_isa_rc:
        n, t = (build or kernel)(*spec)
        names.append(n)
        bodies.append(t)
    return names, declare + "\n".join(bodies) + UNLIKELY
