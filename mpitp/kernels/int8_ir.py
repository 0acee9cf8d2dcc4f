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

``avx512`` takes two tiles a step, 16 output rows in the 16 lanes of 512-bit vectors (each
tile's 256-bit loads joined, so the tiles' layout is the same): one broadcast of x and one
``vpdpbusd`` serve 16 rows, half the instructions per weight of 8 lanes. An odd last tile
is paired with itself and its second half stored nowhere.
"""

from __future__ import annotations

SIGNATURE = "ptr %qs, ptr %d, ptr %m, ptr %xq, ptr %xd, ptr %xs, ptr %y, i64 %T, i64 %nb, i64 %M, i64 %ldy"

UNLIKELY = '\n!0 = !{!"branch_weights", i32 1, i32 64}\n'  # taken once in 64

DECLARE = """
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
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


def splat(t: str, n: int, v) -> str:
    return "<" + ", ".join(f"{t} {v}" for _ in range(n)) + ">"


def idx(ix) -> str:
    """A shufflevector mask."""
    ix = list(ix)
    return f"<{len(ix)} x i32> <" + ", ".join(f"i32 {i}" for i in ix) + ">"


class _Body:
    """Numbered SSA names and the lines that define them, for kernels of V lanes (output
    rows a step: 8, or 16 = two tiles): F, I, B are the float, int32 and byte vector types."""

    def __init__(self, V: int = 8):
        self.lines: list[str] = []
        self.n = 0
        self.V = V
        self.F, self.I, self.B = f"<{V} x float>", f"<{V} x i32>", f"<{4 * V} x i8>"
        # the (tile·nb + b, tile·S + super-block) index names of each tile this step
        self.tiles = [("%tb", "%ts")] + ([("%tb_1", "%ts_1")] if V == 16 else [])

    def __call__(self, expr: str, name: str = "v") -> str:
        self.n += 1
        ssa = f"%{name}{self.n}"
        self.lines.append(f"  {ssa} = {expr}")
        return ssa

    def do(self, line: str) -> None:
        self.lines.append("  " + line)


def _isum(e: _Body, isa: str, u: str, s: str) -> str:
    """<8 x i32>: lane i = Σ_{j<4} u[4i+j]·s[4i+j] (u unsigned, s signed bytes)."""
    if isa == "avx2":
        p = e(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u}, <32 x i8> {s})")
        return e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p}, <16 x i16> {splat('i16', 16, 1)})")
    return _pairs(e, u, s, "zext")


def _pairs(e: _Body, u: str, s: str, uext: str) -> str:
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


def _load(e: _Body, ty: str, base: str, offset: str, elem: str = "i8") -> str:
    p = e(f"getelementptr {elem}, ptr {base}, i64 {offset}", "p")
    return e(f"load {ty}, ptr {p}, align 1")


def _lanes_of(ty: str) -> int:
    return int(ty[1:].split(" x ")[0])


def _per_tile(e: _Body, ty: str, base: str, offset, elem: str = "i8") -> str:
    """``ty`` (one tile's 8 rows of something) loaded at ``offset(tb, ts)`` of each tile of
    this step, joined: [tile t's, tile t+1's] where a step takes two."""
    parts = [_load(e, ty, base, offset(tb, ts), elem) for tb, ts in e.tiles]
    if len(parts) == 1:
        return parts[0]
    return e(f"shufflevector {ty} {parts[0]}, {ty} {parts[1]}, {idx(range(2 * _lanes_of(ty)))}")


def _xgroups(e: _Body, row: str) -> list[str]:
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


def _parse(fmt: str) -> tuple[str, bool, bool]:
    """ "q40h" -> ("q4", Q4_0's implied minimum, float16 scales)."""
    half = fmt.endswith("h") and fmt[:-1] in ("q4", "q40", "q8", "q4k", "q6k")
    core = fmt[:-1] if half else fmt
    return ("q4" if core == "q40" else core), core == "q40", half


def _scales(e: _Body, isa: str, ptr: str, offset, half: bool) -> str:
    """F: each row's scale at element ``offset(tb, ts)`` of ``ptr`` (float32, or float16)."""
    if not half:
        return _per_tile(e, "<8 x float>", ptr, offset, "float")
    if isa != "portable":  # F16C: vcvtph2ps
        return e(f"fpext <{e.V} x half> {_per_tile(e, '<8 x half>', ptr, offset, 'half')} to {e.F}")
    h = e(f"zext <8 x i16> {_per_tile(e, '<8 x i16>', ptr, offset, 'i16')} to <8 x i32>")
    low15, top = splat("i32", 8, 0x7FFF), splat("i32", 8, 0x8000)
    mag = e(f"shl <8 x i32> {e(f'and <8 x i32> {h}, {low15}')}, {splat('i32', 8, 13)}")
    sign = e(f"shl <8 x i32> {e(f'and <8 x i32> {h}, {top}')}, {splat('i32', 8, 16)}")
    f = e(f"bitcast <8 x i32> {e(f'or <8 x i32> {mag}, {sign}')} to <8 x float>")
    return e(f"fmul <8 x float> {f}, {splat('float', 8, '0x46F0000000000000')}")  # × 2^112: exact


def _at(e: _Body, shift: int, plus: int = 0, which: int = 0, name: str = "o"):
    """offset(tb, ts) = (tb or ts) << shift (+ plus): an element offset in a tile's arrays."""

    def offset(tb: str, ts: str) -> str:
        o = e(f"shl i64 {(tb, ts)[which]}, {shift}", name)
        return e(f"add i64 {o}, {plus}", name) if plus else o

    return offset


# Software prefetch of the weights' stream in the kernels for up to PREFETCH_ROWS rows of
# x, where a step is bound by reading the weights: each cache line of each tile's block
# PREFETCH bytes ahead into L1 (prefetcht0), and FAR bytes ahead into L2 (prefetcht1). On
# an Intel Xeon the hardware prefetchers alone left each core at ~8.5 GB/s (TP=2 decode at
# batch 1: 1B Q4_K_M 41.5-42.5 ms a step, 30.2-30.6 with the L1 prefetch; the default model
# 7.9-8.0 ms, 5.7-6.2); the L2 prefetch 6 KiB ahead took the 1B from 26.4-27.1 to 24.4-25.2
# ms (one line a block, or the scales' stream too, was slower; docs/measurements.md). With
# 8 rows and more the kernels are bound by the multiply-adds and the extra instructions
# cost (batch 8: +8%, measured). On a Zen 4 a prefetch changed nothing measurable.
PREFETCH, FAR, PREFETCH_ROWS = 2048, 6144, 4
# int8o's kernels for up to this many rows of x loop over the blocks in segments (frame()),
# with more a branch per block: the same sums in the same order either way
SEGMENT_ROWS = 1
BLOCK_BYTES = {"q4": 128, "q4k": 128, "q8": 256, "q6k": 192}  # qs bytes of one (tile, block)


def _prefetch(e: _Body, fmt: str, far: bool = True) -> None:
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


def kernel(fmt: str, isa: str, R: int, D: int = 1, G: int = 32, sparse: bool = False) -> tuple[str, str]:
    """(name, IR text) of the kernel for R rows of x over whole tiles of 8 output rows,
    each row of x held as D int8 digits (xq rows D·r + j; xs in row D·r), the weights
    with a scale per G = 32 weights (or 16: q8 only, d [T, K/16, 8]). ``sparse``: the
    second digit holds x's outliers (:func:`.quantize.quantize_rows_outliers`), zero in most
    blocks, and is multiplied only in blocks where some row's is not (a branch per block;
    up to SEGMENT_ROWS rows, after a loop over each run of blocks without one: frame())."""
    name = f"{fmt}_{isa}_r{R}_d{D}_g{G}" + ("_o" if sparse else "")
    fmt, implied, half = _parse(fmt)
    known = fmt in ("q4", "q8", "q4k", "q6k") and isa in ("avx512", "vnni", "avx2", "portable") and D in (1, 2)
    if (
        not known
        or (sparse and D != 2)
        or G not in (16, 32)
        or (G == 16 and fmt != "q8")
        or (fmt in ("q4k", "q6k") and G != 32)
    ):
        raise ValueError(f"no int8 kernel for {name}")
    e = _Body(16 if isa == "avx512" else 8)
    F = e.F
    segments = sparse and R <= SEGMENT_ROWS
    for r in range(R):  # (a segmented kernel's loop is the frame's: its phis are there)
        if not segments:
            e.do(f"%acc{r} = phi {F} [zeroinitializer, %tile], [%acc{r}_n, %{'join' if sparse else 'blk'}]")
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
    if R <= PREFETCH_ROWS:
        _prefetch(e, fmt)
    mins: list[tuple[str, int]] = []  # (minimum vector, which per-16 sum of x: 0/1; -1 per 32)
    if fmt in ("q4k", "q6k"):
        dvs, mins = _k_scales(e, fmt, isa, half)
    elif G == 32:  # 8 rows' scales per (tile, block)
        dvs = [_scales(e, isa, "%d", _at(e, 3), half)]
    else:  # two scales a block: d[t, 2b] and d[t, 2b + 1], 8 rows each
        dvs = [_scales(e, isa, "%d", _at(e, 4, h * 8), half) for h in (0, 1)]
    if fmt == "q4" and implied:
        mins = [(e(f"fmul {F} {dvs[0]}, {splat('float', e.V, '-8.0')}"), -1)]
    elif fmt == "q4":
        mins = [(_scales(e, isa, "%m", _at(e, 3), half), -1)]
    u, w = [], []
    B = e.B
    if fmt in ("q4", "q4k"):
        hi = []
        for g in range(4):
            v = _per_tile(e, "<32 x i8>", "%qs", _at(e, 7, 32 * g))
            u.append(e(f"and {B} {v}, {splat('i8', 4 * e.V, 15)}"))
            hi.append(e(f"lshr {B} {v}, {splat('i8', 4 * e.V, 4)}"))
        u += hi
    elif fmt == "q6k":
        u = _q6_quants(e)
    else:
        for g in range(8):
            w.append(_per_tile(e, "<32 x i8>", "%qs", _at(e, 8, 32 * g)))
            if isa != "portable":
                u.append(e(f"call {B} @llvm.abs.v{4 * e.V}i8({B} {w[g]}, i1 false)"))
    main = 1 if sparse else D  # digits every block multiplies; the sparse one only where x has one
    for r in range(R):
        terms = [t for j in range(main) for t in _digit_terms(e, fmt, isa, u, w, dvs, r, j)]
        for mv, h in mins:
            if h < 0:  # x's sum per 32: xs [R·D, nb]
                xsum = _load(e, "float", "%xs", e(f"add i64 %xdrow{r}_0, %b", "xb"), "float")
            else:  # per 16: xs [R·D, 2·nb]
                at = e(f"add i64 %xsrow{r}, %b2{h}", "xb")
                xsum = _load(e, "float", "%xs", at, "float")
            terms.append((mv, _bcast(e, xsum)))
        _chain(e, f"%acc{r}", terms, f"%acc{r}_a" if sparse else f"%acc{r}_n")
    if segments:  # the outliers' digit, zero (d = +0.0) in the blocks where no row has one:
        # multiplied after the loop over the blocks before it (the frame's segments)
        o = _Body(e.V)
        o.n, o.tiles = e.n, e.tiles
        for r in range(R):
            _chain(o, f"%acc{r}_a", _digit_terms(o, fmt, isa, u, w, dvs, r, 1), f"%acc{r}_s")
        return name, frame(name, e, R, D, "blk", outliers=o)
    latch = "blk"
    if sparse:  # with more rows of x more blocks have an outlier in some row: a branch per
        # block (a segment's loop exit is a mispredicted branch, where the block's own is
        # learnt: TP=2 1B Q4_K_M batch 4, 39.0 ms a step with the branch, 41.6-42.4 segmented).
        # The rows' scales' bits OR-ed as integers, one test and one branch
        _any_outlier(e, R, "%b", "%some")
        e.do("br i1 %some, label %sparse, label %join, !prof !0")  # rare: kept a branch, not if-converted
        e.lines.append("sparse:")
        for r in range(R):
            _chain(e, f"%acc{r}_a", _digit_terms(e, fmt, isa, u, w, dvs, r, 1), f"%acc{r}_s")
        e.do("br label %join")
        e.lines.append("join:")
        for r in range(R):
            e.do(f"%acc{r}_n = phi {F} [%acc{r}_a, %blk], [%acc{r}_s, %sparse]")
        latch = "join"
    return name, frame(name, e, R, D, latch)


def _any_outlier(e: _Body, R: int, b: str, name: str) -> None:
    """``name`` = whether some row of x has an outlier in block ``b``: the rows' outlier
    scales (row 2r + 1 of xd) OR-ed as integers, one test."""
    bits = [_load(e, "i32", "%xd", e(f"add i64 %xdrow{r}_1, {b}", "xb"), "float") for r in range(R)]
    some = bits[0]
    for c in bits[1:]:
        some = e(f"or i32 {some}, {c}", "c")
    e.do(f"{name} = icmp ne i32 {some}, 0")


def frame(
    name: str, e: _Body, R: int, D: int, latch: str, entry: str = "", leave: str = "", outliers: _Body | None = None
) -> str:
    """A kernel's function around its block step ``e`` (ending in label ``latch``): the
    loops over tiles (one or two a step) and blocks, each row's offsets, and the stores of
    y (rows ≥ M, and an odd last tile's second half, stored nowhere); ``entry`` and
    ``leave``: lines to run first and last (each ending in a newline).

    ``outliers``: int8o's second digit (``%acc{r}_a`` -> ``%acc{r}_s``), multiplied only
    in the blocks where some row of x has an outlier. The blocks go in segments, each a
    run of blocks up to and including the next such block (found by a scan of the rows'
    outlier scales), the step alone in a loop with no branch in it, the outliers' digit
    after it for the run's last block: each block's sums in the order of one step, and a
    loop as tight as one digit's (a branch in the loop body cost 20% of the weights'
    stream at one row, measured: 10.0 against 12.6 GB/s, Q4_0 on a Xeon)."""
    block = "\n".join(e.lines)
    F = e.F
    rowvars = "\n".join(
        f"  %xrow{r}_{j} = mul i64 %K, {D * r + j}\n  %xdrow{r}_{j} = mul i64 %nb, {D * r + j}"
        for r in range(R)
        for j in range(D)
    )
    rowvars += "\n" + "\n".join(f"  %live{r} = icmp slt i64 {r}, %M\n  %yrow{r} = mul i64 %ldy, {r}" for r in range(R))
    rowvars += "\n  %nb2 = shl i64 %nb, 1\n  %S = lshr i64 %nb, 3\n"
    rowvars += "\n".join(f"  %xsrow{r} = mul i64 %nb2, {D * r}" for r in range(R))
    if e.V == 8:
        step, pair = 1, "  %tnb = mul i64 %t, %nb\n  %tS = mul i64 %t, %S"
        stores = "\n".join(
            f"  %yo{r} = add i64 %yrow{r}, %y0\n  %yp{r} = getelementptr float, ptr %y, i64 %yo{r}\n"
            f"  %dst{r} = select i1 %live{r}, ptr %yp{r}, ptr %scratch\n"  # rows ≥ M: padding, stored nowhere
            f"  store <8 x float> %acc{r}_n, ptr %dst{r}, align 4"
            for r in range(R)
        )
    else:  # two tiles a step; an odd last tile paired with itself, its second half not stored
        step = 2
        pair = (
            "  %tn = add i64 %t, 1\n  %has2 = icmp ult i64 %tn, %T\n  %t2 = select i1 %has2, i64 %tn, i64 %t\n"
            "  %tnb = mul i64 %t, %nb\n  %tS = mul i64 %t, %S\n  %tnb_1 = mul i64 %t2, %nb\n  %tS_1 = mul i64 %t2, %S"
        )
        stores = "\n".join(
            f"  %yo{r} = add i64 %yrow{r}, %y0\n  %yp{r} = getelementptr float, ptr %y, i64 %yo{r}\n"
            f"  %dst{r} = select i1 %live{r}, ptr %yp{r}, ptr %scratch\n"
            f"  %lo{r} = shufflevector {F} %acc{r}_n, {F} poison, {idx(range(8))}\n"
            f"  store <8 x float> %lo{r}, ptr %dst{r}, align 4\n"
            f"  %yh{r} = getelementptr float, ptr %yp{r}, i64 8\n  %liveh{r} = and i1 %live{r}, %has2\n"
            f"  %dsth{r} = select i1 %liveh{r}, ptr %yh{r}, ptr %scratch\n"
            f"  %hi{r} = shufflevector {F} %acc{r}_n, {F} poison, {idx(range(8, 16))}\n"
            f"  store <8 x float> %hi{r}, ptr %dsth{r}, align 4"
            for r in range(R)
        )
    if outliers is None:
        loop, ends = _block_loop(block, latch), ""
    else:
        loop, ends = (
            _segments(e, outliers, R),
            "".join(f"  %acc{r}_n = phi {F} [%acc{r}_a, %blkexit], [%acc{r}_s, %outl]\n" for r in range(R)),
        )
    return f"""
define void @{name}({SIGNATURE}) {{
entry:
  %scratch = alloca <8 x float>
{entry}  %K = shl i64 %nb, 5
{rowvars}
  br label %tile
tile:
  %t = phi i64 [0, %entry], [%t1, %tileend]
{pair}
{loop}
tileend:
{ends}  %y0 = shl i64 %t, 3
{stores}
  %t1 = add i64 %t, {step}
  %again = icmp ult i64 %t1, %T
  br i1 %again, label %tile, label %exit
exit:
{leave}  ret void
}}
"""


def _block_loop(block: str, latch: str) -> str:
    """A tile's loop over its blocks, the step ``block`` (ending in label ``latch``) each."""
    return f"""  br label %blk
blk:
  %b = phi i64 [0, %tile], [%b1, %{latch}]
{block}
  %b1 = add i64 %b, 1
  %more = icmp ult i64 %b1, %nb
  br i1 %more, label %blk, label %tileend"""


def _segments(e: _Body, o: _Body, R: int) -> str:
    """A tile's blocks in segments [b0, stop], stop the next block where some row has an
    outlier (or the last): the step ``e`` in a loop, then the outliers' digit ``o``."""
    F = e.F
    scan = _Body(e.V)
    scan.n = o.n
    _any_outlier(scan, R, "%q", "%hit")

    def each(fmt: str) -> str:
        return "\n".join(fmt.format(r=r) for r in range(R))

    return f"""  br label %seg
seg:
  %b0 = phi i64 [0, %tile], [%bn, %outl]
{each(f"  %accin{{r}} = phi {F} [zeroinitializer, %tile], [%acc{{r}}_s, %outl]")}
  br label %scan
scan:
  %q = phi i64 [%b0, %seg], [%q1, %scannext]
{chr(10).join(scan.lines)}
  %q1 = add i64 %q, 1
  br i1 %hit, label %scandone, label %scannext
scannext:
  %qmore = icmp ult i64 %q1, %nb
  br i1 %qmore, label %scan, label %scandone
scandone:
  %end = phi i64 [%q1, %scan], [%nb, %scannext]
  %isout = phi i1 [true, %scan], [false, %scannext]
  br label %blk
blk:
  %b = phi i64 [%b0, %scandone], [%b1, %blk]
{each(f"  %acc{{r}} = phi {F} [%accin{{r}}, %scandone], [%acc{{r}}_a, %blk]")}
{chr(10).join(e.lines)}
  %b1 = add i64 %b, 1
  %more = icmp ult i64 %b1, %end
  br i1 %more, label %blk, label %blkexit
blkexit:
  br i1 %isout, label %outl, label %tileend
outl:
{chr(10).join(o.lines)}
  %bn = add i64 %b, 1
  %tmore = icmp ult i64 %bn, %nb
  br i1 %tmore, label %seg, label %tileend"""


def _k_scales(e: _Body, fmt: str, isa: str, half: bool) -> tuple[list[str], list[tuple[str, int]]]:
    """The K-quants' float scales of this step's rows, formed from the integer ones as
    the planar weight forms them (:mod:`.tiles`): (scale vectors, minimum vectors)."""
    raws = [_load(e, "<16 x i8>", "%d", e(f"shl i64 {tb}, 4", "ko")) for tb, _ in e.tiles]  # 16 bytes a (tile, block)
    b, V = raws[-1], e.V  # each tile's first 8 bytes, then its last 8
    lo = e(f"shufflevector <16 x i8> {raws[0]}, <16 x i8> {b}, {idx([*range(8), *range(16, 16 + V - 8)])}")
    hi = e(f"shufflevector <16 x i8> {raws[0]}, <16 x i8> {b}, {idx([*range(8, 16), *range(24, 24 + V - 8)])}")
    F = e.F
    if fmt == "q4k":  # sc | mn (unsigned 6 bits); m: d | dmin per super-block
        dd = _scales(e, isa, "%m", _at(e, 4, 0, 1), half)
        dmin = _scales(e, isa, "%m", _at(e, 4, 8, 1), half)
        sc = e(f"uitofp <{V} x i8> {lo} to {F}")
        mn = e(f"uitofp <{V} x i8> {hi} to {F}")
        ndmin = e(f"fneg {F} {dmin}")
        return [e(f"fmul {F} {dd}, {sc}")], [(e(f"fmul {F} {ndmin}, {mn}"), -1)]
    dd = _scales(e, isa, "%m", _at(e, 3, 0, 1), half)  # q6k: signed scales of k 0-15 | 16-31; m: d per super-block
    dvs = [e(f"fmul {F} {dd}, {e(f'sitofp <{V} x i8> {v} to {F}')}") for v in (lo, hi)]
    m32 = splat("float", V, "-32.0")
    return dvs, [(e(f"fmul {F} {dv}, {m32}"), h) for h, dv in enumerate(dvs)]


def _q6_quants(e: _Body) -> list[str]:
    """q6k: the 8 vectors of this block's unsigned 6-bit quants (0..63), low 4 bits from
    the nibble vectors 0-3, high 2 bits from vectors 4-5."""
    B, n = e.B, 4 * e.V
    nib: list[str] = []
    high: list[str] = []

    def at(g: int):
        return lambda tb, ts: e(f"add i64 {e(f'mul i64 {tb}, 192', 'qo')}, {32 * g}", "qo")

    for g in range(6):
        (nib if g < 4 else high).append(_per_tile(e, "<32 x i8>", "%qs", at(g)))
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


def _block_isum(e: _Body, fmt: str, isa: str, u: list[str], w: list[str], xs: list[str], groups=range(8)) -> str:
    """I: each lane's row of this block of weights · one row of x (the groups of 4 k asked
    for: all 8, or a half for a scale per 16)."""
    isum: str | None = None
    p16: str | None = None
    B, I = e.B, e.I
    for g in groups:
        s = xs[g]
        if fmt == "q8" and isa != "portable":  # x takes the sign of w, which became |w|
            nx = e(f"sub {B} zeroinitializer, {s}")
            neg = e(f"icmp slt {B} {w[g]}, zeroinitializer")
            s = e(f"select <{4 * e.V} x i1> {neg}, {B} {nx}, {B} {s}")
        if isa in ("vnni", "avx512"):
            acc = isum or "zeroinitializer"
            isum = e(f"call {I} @llvm.x86.avx512.vpdpbusd.{32 * e.V}({I} {acc}, {B} {u[g]}, {B} {s})")
        elif isa == "avx2" and fmt in ("q4", "q4k"):  # 8 pair sums of ≤ 2·15·127 fit int16: one widening
            p = e(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u[g]}, <32 x i8> {s})")
            p16 = p if p16 is None else e(f"add <16 x i16> {p16}, {p}")
        else:
            if isa == "avx2":
                part = _isum(e, isa, u[g], s)
            else:
                signed = fmt == "q8"
                part = _pairs(e, w[g] if signed else u[g], s, "sext" if signed else "zext")
            isum = part if isum is None else e(f"add <8 x i32> {isum}, {part}")
    if p16 is not None:
        isum = e(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p16}, <16 x i16> {splat('i16', 16, 1)})")
    assert isum is not None
    return isum


def _digit_terms(e: _Body, fmt: str, isa: str, u, w, dvs, r: int, j: int) -> list[tuple[str, str]]:
    """(integer sums as floats, their scale) of digit j of row r against this block."""
    xs = _xgroups(e, f"%xrow{r}_{j}")
    xd = _bcast(e, _load(e, "float", "%xd", e(f"add i64 %xdrow{r}_{j}, %b", "xb"), "float"))
    halves = [range(8)] if len(dvs) == 1 else [range(4), range(4, 8)]  # k 0-15, 16-31
    out = []
    for dv, gs in zip(dvs, halves):
        f = e(f"sitofp {e.I} {_block_isum(e, fmt, isa, u, w, xs, gs)} to {e.F}")
        out.append((f, e(f"fmul {e.F} {dv}, {xd}")))
    return out


def _chain(e: _Body, acc: str, terms: list[tuple[str, str]], last: str) -> None:
    """``last = acc + Σ vector·scale``, the products added in order."""
    a, F = acc, e.F
    for i, (v, sc) in enumerate(terms):
        op = f"call {F} @llvm.fmuladd.v{e.V}f32({F} {v}, {F} {sc}, {F} {a})"
        if i + 1 < len(terms):
            a = e(op)
        else:
            e.do(f"{last} = {op}")


def _bcast(e: _Body, s: str) -> str:
    v = e(f"insertelement {e.F} poison, float {s}, i64 0")
    return e(f"shufflevector {e.F} {v}, {e.F} poison, <{e.V} x i32> zeroinitializer")


def module(fmt_isa_rc: list[tuple], build=None, declare: str = DECLARE) -> tuple[list[str], str]:
    """(names, one module's IR) for several kernels (``build``: the generator of one,
    :func:`kernel` unless given; ``declare``: the intrinsics they call)."""
    names, bodies = [], []
    for spec in fmt_isa_rc:
        n, t = (build or kernel)(*spec)
        names.append(n)
        bodies.append(t)
    return names, declare + "\n".join(bodies) + UNLIKELY
