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

q = round(v / d) as ggml rounds it (half away from zero), bit for bit the one-digit
quantizer's. Where a row of x is [M, K] float32 C-contiguous; xq [2M, K] int8, xd [2M,
K/32] and xs [2M, K/32 or K/16] float32 as :mod:`.quantize` lays them out.
"""

from __future__ import annotations

from .int8_ir import _Body, idx, splat

LIMIT = 4.0  # an outlier: |x| above LIMIT times the root mean square of the rest of its block
OUTLIERS, TWO_DIGITS = "quantize_rows_outliers", "quantize_rows2"  # the two rules, by function name
SIGNATURE = "ptr %x, ptr %xq, ptr %xd, ptr %xs, i64 %M, i64 %K, i64 %halves"
F32, F64, I32 = "<32 x float>", "<32 x double>", "<32 x i32>"

DECLARE = """
declare <32 x float> @llvm.fabs.v32f32(<32 x float>)
declare <32 x float> @llvm.floor.v32f32(<32 x float>)
declare double @llvm.sqrt.f64(double)
declare i32 @llvm.vector.reduce.add.v32i32(<32 x i32>)
declare i32 @llvm.vector.reduce.add.v16i32(<16 x i32>)
"""


def _tree(e: _Body, v: str, n: int, ty: str, op: str) -> str:
    """One value of <n x ty> ``v`` by halving: lanes [0, n/2) op [n/2, n), and again (the
    order fixed here, not left to the target, so every CPU gets the same bits)."""
    while n > 1:
        h = n // 2
        lo = e(f"shufflevector <{n} x {ty}> {v}, <{n} x {ty}> poison, {idx(range(h))}")
        hi = e(f"shufflevector <{n} x {ty}> {v}, <{n} x {ty}> poison, {idx(range(h, n))}")
        if op == "max":  # exact in any order for numbers; |x| is never -0.0 here
            gt = e(f"fcmp ogt <{h} x {ty}> {hi}, {lo}")
            v = e(f"select <{h} x i1> {gt}, <{h} x {ty}> {hi}, <{h} x {ty}> {lo}")
        else:
            v = e(f"{op} <{h} x {ty}> {lo}, {hi}")
        n = h
    return e(f"extractelement <1 x {ty}> {v}, i64 0")


def _digit(e: _Body, v: str, row: str) -> tuple[str, str, str]:
    """``v`` quantized into xq at ``row`` (a pointer): (d, q as <32 x i32>, Σq as i32)."""
    amax = _tree(e, e(f"call {F32} @llvm.fabs.v32f32({F32} {v})"), 32, "float", "max")
    d = e(f"fdiv float {amax}, 127.0")
    nz = e(f"fcmp une float {d}, 0.0")
    inv = e(f"select i1 {nz}, float {e(f'fdiv float 1.0, {d}')}, float 0.0")
    t = e(f"fmul {F32} {v}, {_splat32(e, 'float', inv)}")
    a = e(f"call {F32} @llvm.fabs.v32f32({F32} {t})")
    f = e(f"call {F32} @llvm.floor.v32f32({F32} {a})")
    frac2 = e(f"fmul {F32} {e(f'fsub {F32} {a}, {f}')}, {splat('float', 32, '2.0')}")
    r = e(f"fadd {F32} {f}, {e(f'call {F32} @llvm.floor.v32f32({F32} {frac2})')}")  # half away from 0
    ri = e(f"fptosi {F32} {r} to {I32}")
    pos = e(f"fcmp oge {F32} {t}, zeroinitializer")
    q = e(f"select <32 x i1> {pos}, {I32} {ri}, {I32} {e(f'sub {I32} zeroinitializer, {ri}')}")
    e.do(f"store <32 x i8> {e(f'trunc {I32} {q} to <32 x i8>')}, ptr {row}, align 1")
    return d, q, e(f"call i32 @llvm.vector.reduce.add.v32i32({I32} {q})")


def _splat32(e: _Body, ty: str, s: str) -> str:
    one = e(f"insertelement <32 x {ty}> poison, {ty} {s}, i64 0")
    return e(f"shufflevector <32 x {ty}> {one}, <32 x {ty}> poison, <32 x i32> zeroinitializer")


def _half_sum(e: _Body, q: str, h: int) -> str:
    part = e(f"shufflevector {I32} {q}, {I32} poison, {idx(range(16 * h, 16 * h + 16))}")
    return e(f"sitofp i32 {e(f'call i32 @llvm.vector.reduce.add.v16i32(<16 x i32> {part})')} to float")


def _split(e: _Body, v: str) -> tuple[str, str]:
    """int8o's rule: (v without its outliers, the outliers alone)."""
    a = e(f"call {F32} @llvm.fabs.v32f32({F32} {v})")
    amax = e(f"fpext float {_tree(e, a, 32, 'float', 'max')} to double")
    v64 = e(f"fpext {F32} {v} to {F64}")
    ss = _tree(e, e(f"fmul {F64} {v64}, {v64}"), 32, "double", "fadd")
    rest = e(f"fsub double {ss}, {e(f'fmul double {amax}, {amax}')}")
    rest = e(f"select i1 {e(f'fcmp ogt double {rest}, 0.0')}, double {rest}, double 0.0")
    rms = e(f"call double @llvm.sqrt.f64(double {e(f'fdiv double {rest}, 31.0')})")
    cut = e(f"fmul double {LIMIT!r}, {rms}")
    big = e(f"fcmp ogt {F64} {e(f'fpext {F32} {a} to {F64}')}, {_splat32(e, 'double', cut)}")
    big = e(f"and <32 x i1> {big}, {_splat32(e, 'i1', e(f'fcmp ogt double {cut}, 0.0'))}")
    main = e(f"select <32 x i1> {big}, {F32} zeroinitializer, {F32} {v}")
    return main, e(f"select <32 x i1> {big}, {F32} {v}, {F32} zeroinitializer")


def module(name: str = OUTLIERS) -> tuple[str, str]:
    """(name, IR text) of the quantizer ``name``: OUTLIERS (int8o) or TWO_DIGITS (int8x2)."""
    if name not in (OUTLIERS, TWO_DIGITS):
        raise ValueError(f"no quantizer {name!r}")
    e = _Body()
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
    w = _Body()
    w.n = e.n
    w.do("%xso = mul i64 %r1, %ns")
    w.do("%pxs0 = getelementptr float, ptr %xs, i64 %xso")
    s1, s2 = w(f"sitofp i32 {t1} to float"), w(f"sitofp i32 {t2} to float")
    one = w(f"fadd float {w(f'fmul float {d1}, {s1}')}, {w(f'fmul float {d2}, {s2}')}")
    w.do("%pxs = getelementptr float, ptr %pxs0, i64 %b")
    w.do(f"store float {one}, ptr %pxs, align 4")
    per32 = "\n".join(w.lines)
    h = _Body()
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
  br i1 %skip, label %exit, label %row
row:
  %i = phi i64 [0, %entry], [%i1, %rowend]
  br label %blk
blk:
  %b = phi i64 [0, %row], [%b1, %next]
{body}
  br i1 %hv, label %sums16, label %sums32
sums32:
{per32}
  br label %next
sums16:
{per16}
  br label %next
next:
  %b1 = add i64 %b, 1
  %more = icmp ult i64 %b1, %nb
  br i1 %more, label %blk, label %rowend
rowend:
  %i1 = add i64 %i, 1
  %again = icmp ult i64 %i1, %M
  br i1 %again, label %row, label %exit
exit:
  ret void
}}
"""
    return name, DECLARE + text
