"""LLVM IR of the two-row quantizers, int8o's (:func:`.quantize.quantize_rows_outliers`)
and int8x2's (:func:`.quantize.quantize_rows2`), one block of 32 values a step in vector
registers, compiled by :mod:`.jit` like the kernels.

numba compiled the same rules as scalar loops with a call per block (~4-5 ns a value
against ~1 for one digit); here each block is a handful of vector instructions. int8o::

    v = x[i, 32b : 32b+32]                         <32 x float>
    amax = max |v|,  ss = Σ v² (float64)           halving trees: the same order on any CPU
    cut = 4 · sqrt(max(ss - amax², 0) / 31)        the rest of the block's rms, times LIMIT
    big = |v| > cut (and cut > 0)
    main = big ? 0 : v  -> xq row 2i,   d  = max|main| / 127
    rest = big ? v : 0  -> xq row 2i+1, d2 = max|rest| / 127   (0 where no outlier)
    xs[2i] = d·Σq + d2·Σq2        (or per 16: ``halves``)

int8x2 (``TWO_DIGITS``)::

    d, q = Q8_0 of v                     -> xq row 2i
    d2, q2 = Q8_0 of v - d·q             -> xq row 2i+1   (x - d·q: a multiply, then a subtract)
    xs[2i] as above

and ``WHOLE``, int8x2 with each digit's scale shared by a super-block of 256 values (8
blocks; ggml's Q8_K groups x so for its K-quants), for the avx2 K-quant kernels that add a
super-block's sums as integers (:func:`.vector.kernel` with ``whole``): d = the 8 blocks'
largest amax / 127, and the same for what the first digit leaves; xd still holds a scale a
block (8 equal ones), so every other kernel reads it as it reads int8x2's. K a multiple of 256.

q = round(v / d) as ggml rounds it (half away from zero), bit for bit the one-digit
quantizer's: trunc(2t) - trunc(t) for t = v·(1/d) (:func:`_round`).

Both take GROUP = 8 blocks a step: their per-block scalars (amax, Σv², the cut, d, 1/d,
Σq) come 8 to a vector from one reduction across the blocks (:func:`_across`), not a tree
and scalar divides per block, whose chains left the vector units idle (int8o: about
0.7 ns a value where it took 1.2; docs/measurements.md). :func:`_across` pairs the lanes
as :func:`tree` does, so int8o's float64 Σv², and with it the cut, are the block loop's
bits. A row's last K/32 mod 8 blocks go one block a
step. Where a row of x is [M, K] float32 C-contiguous; xq [2M, K] int8, xd [2M,
K/32] and xs [2M, K/32 or K/16] float32 as :mod:`.quantize` lays them out.
"""

from __future__ import annotations

from .build import Body, idx, loop_end, loop_top, splat, tree

LIMIT = 4.0  # an outlier: |x| above LIMIT times the root mean square of the rest of its block
OUTLIERS, TWO_DIGITS = "quantize_rows_outliers", "quantize_rows2"  # the rules, by function name
WHOLE = "quantize_rows2_whole"
SIGNATURE = "ptr %x, ptr %xq, ptr %xd, ptr %xs, i64 %M, i64 %K, i64 %halves"
F32, F64, I32 = "<32 x float>", "<32 x double>", "<32 x i32>"

DECLARE = """
declare <32 x float> @llvm.fabs.v32f32(<32 x float>)
declare <32 x float> @llvm.floor.v32f32(<32 x float>)
declare double @llvm.sqrt.f64(double)
declare <8 x double> @llvm.sqrt.v8f64(<8 x double>)
declare i32 @llvm.vector.reduce.add.v32i32(<32 x i32>)
declare i32 @llvm.vector.reduce.add.v16i32(<16 x i32>)
"""


def _digit(e: Body, v: str, row: str) -> tuple[str, str, str]:
    """``v`` quantized into xq at ``row`` (a pointer): (d, q as <32 x i32>, Σq as i32)."""
    amax = tree(e, e(f"call {F32} @llvm.fabs.v32f32({F32} {v})"), 32, "float", "max")
    d = e(f"fdiv float {amax}, 127.0")
    nz = e(f"fcmp une float {d}, 0.0")
    inv = e(f"select i1 {nz}, float {e(f'fdiv float 1.0, {d}')}, float 0.0")
    q = _round(e, e(f"fmul {F32} {v}, {_splat32(e, 'float', inv)}"))
    e.do(f"store <32 x i8> {e(f'trunc {I32} {q} to <32 x i8>')}, ptr {row}, align 1")
    return d, q, e(f"call i32 @llvm.vector.reduce.add.v32i32({I32} {q})")


def _round(e: Body, t: str) -> str:
    """<32 x i32>: t rounded half away from zero, as gguf's np_roundf: for a = |t|,
    floor(a) + floor(2(a - floor(a))) = floor(2a) - floor(a) (2a and both floors exact
    below 2²³), and truncation toward zero keeps t's sign: q = trunc(2t) - trunc(t). Two
    conversions and a subtract, not two floors, a compare and a select."""
    t2 = e(f"fadd {F32} {t}, {t}")
    return e(f"sub {I32} {e(f'fptosi {F32} {t2} to {I32}')}, {e(f'fptosi {F32} {t} to {I32}')}")


def _splat32(e: Body, ty: str, s: str) -> str:
    one = e(f"insertelement <32 x {ty}> poison, {ty} {s}, i64 0")
    return e(f"shufflevector <32 x {ty}> {one}, <32 x {ty}> poison, <32 x i32> zeroinitializer")


def _half_sum(e: Body, q: str, h: int) -> str:
    part = e(f"shufflevector {I32} {q}, {I32} poison, {idx(range(16 * h, 16 * h + 16))}")
    return e(f"sitofp i32 {e(f'call i32 @llvm.vector.reduce.add.v16i32(<16 x i32> {part})')} to float")


def _split(e: Body, v: str) -> tuple[str, str]:
    """int8o's rule: (v without its outliers, the outliers alone)."""
    a = e(f"call {F32} @llvm.fabs.v32f32({F32} {v})")
    amax = e(f"fpext float {tree(e, a, 32, 'float', 'max')} to double")
    v64 = e(f"fpext {F32} {v} to {F64}")
    ss = tree(e, e(f"fmul {F64} {v64}, {v64}"), 32, "double", "fadd")
    rest = e(f"fsub double {ss}, {e(f'fmul double {amax}, {amax}')}")
    rest = e(f"select i1 {e(f'fcmp ogt double {rest}, 0.0')}, double {rest}, double 0.0")
    rms = e(f"call double @llvm.sqrt.f64(double {e(f'fdiv double {rest}, 31.0')})")
    cut = e(f"fmul double {LIMIT!r}, {rms}")
    big = e(f"fcmp ogt {F64} {e(f'fpext {F32} {a} to {F64}')}, {_splat32(e, 'double', cut)}")
    big = e(f"and <32 x i1> {big}, {_splat32(e, 'i1', e(f'fcmp ogt double {cut}, 0.0'))}")
    main = e(f"select <32 x i1> {big}, {F32} zeroinitializer, {F32} {v}")
    return main, e(f"select <32 x i1> {big}, {F32} {v}, {F32} zeroinitializer")


GROUP = 8  # blocks a step (a row's last K/32 mod 8 go one at a time)


def _across(e: Body, vs: list[str], ty: str, op: str) -> str:
    """<G x ty>: lane j = ``op`` over block j's 32 lanes, for G = len(vs) blocks (each
    <32 x ty>): the blocks reduced side by side, halving the lanes each holds (a transpose
    as it goes), not one tree per block. Each level pairs lane i of a block with lane i + h,
    as :func:`tree` does, so a float sum has the tree's bits."""

    def combine(a: str, b: str, n: int) -> str:
        if op == "max":
            gt = e(f"fcmp ogt <{n} x {ty}> {b}, {a}")
            return e(f"select <{n} x i1> {gt}, <{n} x {ty}> {b}, <{n} x {ty}> {a}")
        return e(f"{op} <{n} x {ty}> {a}, {b}")

    per = 16  # lanes per block in each vector, after the first halving
    level = [
        combine(
            e(f"shufflevector <32 x {ty}> {v}, <32 x {ty}> poison, {idx(range(16))}"),
            e(f"shufflevector <32 x {ty}> {v}, <32 x {ty}> poison, {idx(range(16, 32))}"),
            16,
        )
        for v in vs
    ]
    while len(level) > 1 or per > 1:
        h = per // 2
        pairs = [(level[i], level[i + 1]) for i in range(0, len(level), 2)] if len(level) > 1 else [(level[0], None)]
        nxt = []
        for a, b in pairs:
            n = 16 if b is not None else 16 // 2  # lanes out: both inputs' blocks, half the lanes each
            lo = [k for blk in range(0, 16 * (2 if b is not None else 1), per) for k in range(blk, blk + h)]
            hi = [k + h for k in lo]
            other = b if b is not None else "poison"
            x = e(f"shufflevector <16 x {ty}> {a}, <16 x {ty}> {other}, {idx(lo)}")
            y = e(f"shufflevector <16 x {ty}> {a}, <16 x {ty}> {other}, {idx(hi)}")
            nxt.append(combine(x, y, n))
        level, per = nxt, h
    return level[0]


def _split_across(e: Body, vs: list[str]) -> tuple[list[str], list[str]]:
    """int8o's rule (:func:`_split`) for G blocks at once: (each without its outliers, the
    outliers alone), the cut of every block from one vector of G."""
    G = len(vs)
    GD = f"<{G} x double>"
    a = [e(f"call {F32} @llvm.fabs.v32f32({F32} {v})") for v in vs]
    amax = e(f"fpext <{G} x float> {_across(e, a, 'float', 'max')} to {GD}")
    squares = []
    for v in vs:
        v64 = e(f"fpext {F32} {v} to {F64}")
        squares.append(e(f"fmul {F64} {v64}, {v64}"))
    ss = _across(e, squares, "double", "fadd")
    rest = e(f"fsub {GD} {ss}, {e(f'fmul {GD} {amax}, {amax}')}")
    rest = e(f"select <{G} x i1> {e(f'fcmp ogt {GD} {rest}, zeroinitializer')}, {GD} {rest}, {GD} zeroinitializer")
    mean = e(f"fdiv {GD} {rest}, {splat('double', G, '31.0')}")
    rms = e(f"call {GD} @llvm.sqrt.v{G}f64({GD} {mean})")
    cut = e(f"fmul {GD} {splat('double', G, repr(LIMIT))}, {rms}")
    pos = e(f"fcmp ogt {GD} {cut}, zeroinitializer")
    mains, outs = [], []
    for j, v in enumerate(vs):
        cj = e(f"shufflevector {GD} {cut}, {GD} poison, <32 x i32> {splat('i32', 32, j)}")
        pj = e(f"shufflevector <{G} x i1> {pos}, <{G} x i1> poison, <32 x i32> {splat('i32', 32, j)}")
        aj = e(f"fpext {F32} {a[j]} to {F64}")
        big = e(f"and <32 x i1> {e(f'fcmp ogt {F64} {aj}, {cj}')}, {pj}")
        mains.append(e(f"select <32 x i1> {big}, {F32} zeroinitializer, {F32} {v}"))
        outs.append(e(f"select <32 x i1> {big}, {F32} {v}, {F32} zeroinitializer"))
    return mains, outs


def _grouped(name: str, G: int = GROUP) -> str:
    """IR of one step of the quantizer ``name`` over G consecutive blocks of row %i from
    block %gb: the same values as G steps of the block loop, its per-block scalars computed
    G blocks to a vector instead of one at a time."""
    e = Body()
    e.n = 10_000  # names apart from the block loop's
    e.do("%gxrow = mul i64 %i, %K")
    e.do("%glo = shl i64 %gb, 5")
    e.do("%gat = add i64 %gxrow, %glo")
    e.do("%gr1 = mul i64 %i, 2")
    e.do("%gq1at = mul i64 %gr1, %K")
    e.do("%gq1o = add i64 %gq1at, %glo")
    vs = []
    for j in range(G):
        px = e(f"getelementptr float, ptr %x, i64 {e(f'add i64 %gat, {32 * j}')}")
        vs.append(e(f"load {F32}, ptr {px}, align 4"))
    outs: list[str] = []
    if name == OUTLIERS:
        vs, outs = _split_across(e, vs)
    digits = []
    for which in (0, 1):
        absv = [e(f"call {F32} @llvm.fabs.v32f32({F32} {v})") for v in vs]
        amax = _across(e, absv, "float", "max")
        GF = f"<{G} x float>"
        if name == WHOLE:  # one scale for the G = 8 blocks: their largest amax in every lane
            top = e(f"insertelement {GF} poison, float {tree(e, amax, G, 'float', 'max')}, i64 0")
            amax = e(f"shufflevector {GF} {top}, {GF} poison, <{G} x i32> zeroinitializer")
        d = e(f"fdiv {GF} {amax}, {splat('float', G, '127.0')}")
        nz = e(f"fcmp une {GF} {d}, zeroinitializer")
        ones = splat("float", G, "1.0")
        recip = e(f"fdiv {GF} {ones}, {d}")
        inv = e(f"select <{G} x i1> {nz}, {GF} {recip}, {GF} zeroinitializer")
        qs, rest = [], []
        for j, v in enumerate(vs):
            ij = e(f"shufflevector {GF} {inv}, {GF} poison, <32 x i32> {splat('i32', 32, j)}")
            q = _round(e, e(f"fmul {F32} {v}, {ij}"))
            o = e(f"add i64 %gq1o, {32 * j}")
            if which:  # digit 2: xq row 2i + 1
                o = e(f"add i64 {o}, %K")
            q8, pq = e(f"trunc {I32} {q} to <32 x i8>"), e(f"getelementptr i8, ptr %xq, i64 {o}")
            e.do(f"store <32 x i8> {q8}, ptr {pq}, align 1")
            qs.append(q)
            if not which and name != OUTLIERS:  # what the digit leaves: x - d·q, a multiply then a subtract (no fma)
                dj = e(f"shufflevector {GF} {d}, {GF} poison, <32 x i32> {splat('i32', 32, j)}")
                dq = e(f"fmul {F32} {dj}, {e(f'sitofp {I32} {q} to {F32}')}")
                rest.append(e(f"fsub {F32} {v}, {dq}"))
        digits.append((d, qs))
        vs = outs if name == OUTLIERS else rest
    e.do("%gd1o = mul i64 %gr1, %nb")
    e.do("%gd1o_b = add i64 %gd1o, %gb")
    e.do("%gd2o_b = add i64 %gd1o_b, %nb")
    for (d, _), at in zip(digits, ("%gd1o_b", "%gd2o_b")):
        e.do(f"store <{G} x float> {d}, ptr {e(f'getelementptr float, ptr %xd, i64 {at}')}, align 4")
    body = "\n".join(e.lines)
    # xs per 32: d·Σq + d2·Σq2, G blocks a vector; per 16 (halves): block by block as the loop
    w = Body()
    w.n = e.n
    GF = f"<{G} x float>"
    (d1, q1s), (d2, q2s) = digits
    s1 = w(f"sitofp <{G} x i32> {_across(w, q1s, 'i32', 'add')} to {GF}")
    s2 = w(f"sitofp <{G} x i32> {_across(w, q2s, 'i32', 'add')} to {GF}")
    one = w(f"fadd {GF} {w(f'fmul {GF} {d1}, {s1}')}, {w(f'fmul {GF} {d2}, {s2}')}")
    w.do("%gxso = mul i64 %gr1, %ns")
    w.do("%gxsb = add i64 %gxso, %gb")
    w.do(f"store {GF} {one}, ptr {w('getelementptr float, ptr %xs, i64 %gxsb')}, align 4")
    per32 = "\n".join(w.lines)
    h = Body()
    h.n = w.n
    h.do("%gxso_h = mul i64 %gr1, %ns")
    for j in range(G):
        dj1 = h(f"extractelement {GF} {d1}, i64 {j}")
        dj2 = h(f"extractelement {GF} {d2}, i64 {j}")
        for k in (0, 1):
            first = h(f"fadd float 0.0, {h(f'fmul float {dj1}, {_half_sum(h, q1s[j], k)}')}")
            val = h(f"fadd float {first}, {h(f'fmul float {dj2}, {_half_sum(h, q2s[j], k)}')}")
            b2 = h("shl i64 %gb, 1")
            at = h(f"add i64 %gxso_h, {h(f'add i64 {b2}, {2 * j + k}')}")
            h.do(f"store float {val}, ptr {h(f'getelementptr float, ptr %xs, i64 {at}')}, align 4")
    per16 = "\n".join(h.lines)
    return f"""
{loop_top("grp", "g", 0, "row", "gnext")}
  %gb = shl i64 %g, 3
{body}
  br i1 %hv, label %gsums16, label %gsums32
gsums32:
{per32}
  br label %gnext
gsums16:
{per16}
  br label %gnext
gnext:
{loop_end("g", "%ng", "grp", "tail", "gmore")}
"""


def module(name: str = OUTLIERS) -> tuple[str, str]:
    """(name, IR text) of the quantizer ``name``: OUTLIERS (int8o), TWO_DIGITS (int8x2) or
    WHOLE (int8x2 a scale per 256; its block-at-a-time tail, for K/32 mod 8 blocks, never
    runs: :func:`.quantize.quantize_rows2` asks for it only where K is a multiple of 256)."""
    if name not in (OUTLIERS, TWO_DIGITS, WHOLE):
        raise ValueError(f"no quantizer {name!r}")
    e = Body()
    e.do("%xrow = mul i64 %i, %K")
    e.do("%lo = shl i64 %b, 5")
    e.do("%at = add i64 %xrow, %lo")
    e.do("%px = getelementptr float, ptr %x, i64 %at")
    v = e(f"load {F32}, ptr %px, align 4")
    e.do("%r1 = mul i64 %i, 2")  # xq rows 2i (one digit) and 2i + 1 (the outliers, or what it leaves)
    e.do("%r2 = add i64 %r1, 1")
    e.do("%q1at = mul i64 %r1, %K")
    e.do("%q1o = add i64 %q1at, %lo")
    e.do("%q2o = add i64 %q1o, %K")
    e.do("%pq1 = getelementptr i8, ptr %xq, i64 %q1o")
    e.do("%pq2 = getelementptr i8, ptr %xq, i64 %q2o")
    if name == OUTLIERS:
        main, out = _split(e, v)
        d1, q1, t1 = _digit(e, main, "%pq1")
    else:
        d1, q1, t1 = _digit(e, v, "%pq1")
        dq = e(f"fmul {F32} {_splat32(e, 'float', d1)}, {e(f'sitofp {I32} {q1} to {F32}')}")
        out = e(f"fsub {F32} {v}, {dq}")  # no contraction into an fma: numba's x - d·q, rounded twice
    d2, q2, t2 = _digit(e, out, "%pq2")
    e.do("%d1o = mul i64 %r1, %nb")
    e.do("%d1o_b = add i64 %d1o, %b")
    e.do("%d2o_b = add i64 %d1o_b, %nb")
    e.do("%pd1 = getelementptr float, ptr %xd, i64 %d1o_b")
    e.do("%pd2 = getelementptr float, ptr %xd, i64 %d2o_b")
    e.do(f"store float {d1}, ptr %pd1, align 4")
    e.do(f"store float {d2}, ptr %pd2, align 4")
    body = "\n".join(e.lines)
    # xs, per 32: d·Σq + d2·Σq2; per 16 (halves): (0 + d·Σ of the half) + d2·Σ of the half
    w = Body()
    w.n = e.n
    w.do("%xso = mul i64 %r1, %ns")
    w.do("%pxs0 = getelementptr float, ptr %xs, i64 %xso")
    s1, s2 = w(f"sitofp i32 {t1} to float"), w(f"sitofp i32 {t2} to float")
    one = w(f"fadd float {w(f'fmul float {d1}, {s1}')}, {w(f'fmul float {d2}, {s2}')}")
    w.do("%pxs = getelementptr float, ptr %pxs0, i64 %b")
    w.do(f"store float {one}, ptr %pxs, align 4")
    per32 = "\n".join(w.lines)
    h = Body()
    h.n = w.n
    h.do("%xso_h = mul i64 %r1, %ns")
    h.do("%b2 = shl i64 %b, 1")
    for k in (0, 1):
        first = h(f"fadd float 0.0, {h(f'fmul float {d1}, {_half_sum(h, q1, k)}')}")
        val = h(f"fadd float {first}, {h(f'fmul float {d2}, {_half_sum(h, q2, k)}')}")
        h.do(f"%xsi{k} = add i64 %xso_h, %b2" if k == 0 else "%xsi1 = add i64 %xsi0, 1")
        h.do(f"%pxh{k} = getelementptr float, ptr %xs, i64 %xsi{k}")
        h.do(f"store float {val}, ptr %pxh{k}, align 4")
    per16 = "\n".join(h.lines)
    groups, ngroups, enter = _grouped(name), "lshr i64 %nb, 3", "br i1 %grouped, label %grp, label %tail"
    text = f"""
define void @{name}({SIGNATURE}) {{
entry:
  %nb = lshr i64 %K, 5
  %hv = icmp ne i64 %halves, 0
  %nb2 = shl i64 %nb, 1
  %ns = select i1 %hv, i64 %nb2, i64 %nb
  %none = icmp eq i64 %M, 0
  %empty = icmp eq i64 %nb, 0
  %skip = or i1 %none, %empty
  %ng = {ngroups}
  %grouped = icmp ne i64 %ng, 0
  br i1 %skip, label %exit, label %row
{loop_top("row", "i", 0, "entry", "rowend")}
  {enter}
{groups}
tail:
  %bt = shl i64 %ng, 3
  %anyb = icmp ult i64 %bt, %nb
  br i1 %anyb, label %blk, label %rowend
{loop_top("blk", "b", "%bt", "tail", "next")}
{body}
  br i1 %hv, label %sums16, label %sums32
sums32:
{per32}
  br label %next
sums16:
{per16}
  br label %next
next:
{loop_end("b", "%nb", "blk", "rowend")}
rowend:
{loop_end("i", "%M", "row", "exit", "again")}
exit:
  ret void
}}
"""
    return name, DECLARE + text
