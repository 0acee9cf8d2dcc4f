"""LLVM IR of decode attention's core: one row's query heads of one KV head against its
cached keys and values, in vector registers, compiled by :mod:`.jit` like the int8 kernels.

numba's loops over the head dimension (:func:`.decode._attend_group`) pay a loop's setup
and a horizontal sum for every (column, head) pair and keep the accumulators in memory:
~7 G multiply-adds/s. Here the G query heads of a KV head (GQA's group) sit in registers
(G·D/16 vectors of 16 floats) while the columns stream past once::

    q [G, D] (rotated, times the softmax scale)      k, v: column t at k + t·stride
    column S-1:  the new key and value (float32) stored, as the cache holds them
    for t < S:   s[h, t] = Σ_i q[h, i]·k[t, i]  (a halving tree per head), MASKED where
                 ``masked`` and not valid[t]; top[h] = max_t s[h, t]
    for 16 t:    e = exp(s - top[h])             (Cephes' polynomial, 0 below -87), Σ e
    for t < S:   acc[h] += e[h, t]·v[t]          (columns not valid skipped: their e is 0)
    out[h] = acc[h] / Σ e

The cache holds float32, or float16 (``half``: rows converted as they are loaded, and
the new column rounded to nearest even, as NumPy's astype rounds it: prefill's writes
and these agree bit for bit). ``sc`` is the scratch of the scores: G rows of S rounded
up to 16. Exp is Cephes' expf (relative error ~2e-7, like libm's float exp); a softmax's
sums run in another order than :func:`.decode._attend_group`'s, so results agree with it
to float32 rounding, not bits.
"""

from __future__ import annotations

import struct

from .build import Body, loop_end, loop_top, splat, tree

MASKED = -3.4028234663852886e38  # float32's lowest, as decode.MASKED
LANES = 16
F = f"<{LANES} x float>"
SIGNATURE = (
    "ptr %q, ptr %k, ptr %v, ptr %valid, ptr %out, ptr %sc, ptr %knew, ptr %vnew, i64 %S, i64 %stride, i64 %masked"
)
DECLARE = f"""
declare {F} @llvm.floor.v16f32({F})
declare {F} @llvm.fmuladd.v16f32({F}, {F}, {F})
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
"""
AHEAD = 8  # columns of keys prefetched ahead of the scores' step
# columns of keys prefetched into L2 ahead of it (0: none): attention at ~420 cached tokens
# 6% faster, no change at ~40 (docs/measurements.md)
FAR = 48


def _f(x: float) -> str:
    """A float32 constant as LLVM writes one: the double of the same value, in hex."""
    return "0x" + struct.pack(">d", struct.unpack("f", struct.pack("f", x))[0]).hex().upper()


# Cephes' expf: exp(x) = 2^k · p(r), k = round(x·log2 e), r = x - k·ln 2 (ln 2 in two parts);
# decode.swiglu evaluates the same polynomial in numba
EXP_LOG2E, EXP_LN2 = 1.44269504088896341, (0.693359375, -2.12194440e-4)
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5)
LOG2E, LN2HI, LN2LO = _f(EXP_LOG2E), _f(EXP_LN2[0]), _f(EXP_LN2[1])
POLY = [_f(c) for c in EXP_POLY]
LOWEST = _f(-87.0)  # exp below this is taken as 0 (2^-126, float32's smallest normal, is e^-87.3)


def name(D: int, G: int, half: bool = False) -> str:
    return f"attend_d{D}_g{G}" + ("_h" if half else "")


def _vsplat(v) -> str:
    return splat("float", LANES, v)


def _exp(e: Body, x: str) -> str:
    """exp of 16 floats at most 0 (a score less the row's top)."""
    low = e(f"fcmp olt {F} {x}, {_vsplat(LOWEST)}")
    xc = e(f"select <{LANES} x i1> {low}, {F} {_vsplat(LOWEST)}, {F} {x}")
    xl = e(f"fmul {F} {xc}, {_vsplat(LOG2E)}")
    k = e(f"call {F} @llvm.floor.v16f32({F} {e(f'fadd {F} {xl}, {_vsplat(_f(0.5))}')})")
    r = e(f"fsub {F} {xc}, {e(f'fmul {F} {k}, {_vsplat(LN2HI)}')}")
    r = e(f"fsub {F} {r}, {e(f'fmul {F} {k}, {_vsplat(LN2LO)}')}")
    p = _vsplat(POLY[0])
    for c in POLY[1:]:
        p = e(f"call {F} @llvm.fmuladd.v16f32({F} {p}, {F} {r}, {F} {_vsplat(c)})")
    rr = e(f"fmul {F} {r}, {r}")
    p = e(f"fadd {F} {e(f'call {F} @llvm.fmuladd.v16f32({F} {p}, {F} {rr}, {F} {r})')}, {_vsplat(_f(1.0))}")
    ki = e(f"fptosi {F} {k} to <{LANES} x i32>")
    I = f"<{LANES} x i32>"
    biased = e(f"add {I} {ki}, {splat('i32', LANES, 127)}")
    bits = e(f"shl {I} {biased}, {splat('i32', LANES, 23)}")
    y = e(f"fmul {F} {p}, {e(f'bitcast <{LANES} x i32> {bits} to {F}')}")
    return e(f"select <{LANES} x i1> {low}, {F} zeroinitializer, {F} {y}")


def kernel(D: int, G: int, half: bool = False) -> str:
    """The IR of one core for head dimension D (a multiple of 16) and G query heads a KV
    head, over a float32 cache (or float16: ``half``)."""
    if D % LANES or D <= 0 or G <= 0:
        raise ValueError(f"attention's IR core takes a head dimension that is a multiple of {LANES}, not {D}")
    C, H, m = D // LANES, range(G), _f(MASKED)
    KT = "half" if half else "float"  # the cache's type
    KV = f"<{LANES} x {KT}>"
    blocks: dict[str, Body] = {}

    def block(label: str) -> Body:  # the blocks' SSA names numbered in one sequence
        b = Body()
        b.n = max((x.n for x in blocks.values()), default=0)
        blocks[label] = b
        return b

    def ptr(b: Body, ty: str, base: str, off) -> str:
        return b(f"getelementptr {ty}, ptr {base}, i64 {off}", "p")

    def bcast(b: Body, s: str) -> str:
        ins = b(f"insertelement {F} poison, float {s}, i64 0")
        return b(f"shufflevector {F} {ins}, {F} poison, <{LANES} x i32> zeroinitializer")

    e = block("entry")  # the group's queries into registers
    for h in H:
        e.do(f"%row{h} = mul i64 %S16, {h}")
    q = [[e(f"load {F}, ptr {ptr(e, 'float', '%q', h * D + LANES * c)}, align 4") for c in range(C)] for h in H]
    for new, cache in (("%knew", "%k"), ("%vnew", "%v")):  # this step's column, S - 1
        at = e("mul i64 %last, %stride")
        for c in range(C):
            x = e(f"load {F}, ptr {ptr(e, 'float', new, LANES * c)}, align 4")
            x = e(f"fptrunc {F} {x} to {KV}") if half else x
            e.do(f"store {KV} {x}, ptr {ptr(e, KT, cache, e(f'add i64 {at}, {LANES * c}'))}, align 2")

    def row(b: Body, base: str) -> list[str]:  # one column's D values, as float32
        loads = [b(f"load {KV}, ptr {ptr(b, KT, base, LANES * c)}, align 2") for c in range(C)]
        return [b(f"fpext {KV} {x} to {F}") for x in loads] if half else loads

    e = block("qk")  # scores: one column a step, every head of the group
    kp = e(f"getelementptr {KT}, ptr %k, i64 %ko")
    kv = row(e, kp)
    # the cache is read by rows of D values at a stride: ahead of the hardware's prefetcher,
    # keys AHEAD columns on, and this column's values for the second pass
    ka = ptr(e, KT, kp, "%kahead")
    vp = ptr(e, KT, "%v", "%ko")
    kf = ptr(e, KT, kp, "%kfar") if FAR else None
    for line in range(0, D, 32 if half else 16):
        e.do(f"call void @llvm.prefetch.p0(ptr {ptr(e, KT, ka, line)}, i32 0, i32 3, i32 1)")
        e.do(f"call void @llvm.prefetch.p0(ptr {ptr(e, KT, vp, line)}, i32 0, i32 3, i32 1)")
        if kf is not None:
            e.do(f"call void @llvm.prefetch.p0(ptr {ptr(e, KT, kf, line)}, i32 0, i32 2, i32 1)")
    vb = e(f"load i8, ptr {ptr(e, 'i8', '%valid', '%t')}")
    ok = e(f"icmp ne i8 {vb}, 0")
    keep = e(f"or i1 {ok}, %open")
    tops = []
    for h in H:
        acc = e(f"fmul {F} {q[h][0]}, {kv[0]}")
        for c in range(1, C):
            acc = e(f"call {F} @llvm.fmuladd.v16f32({F} {q[h][c]}, {F} {kv[c]}, {F} {acc})")
        s = e(f"select i1 {keep}, float {tree(e, acc, LANES, 'float', 'fadd')}, float {m}")
        at = e(f"add i64 %t, %row{h}")
        e.do(f"store float {s}, ptr {ptr(e, 'float', '%sc', at)}, align 4")
        gt = e(f"fcmp ogt float {s}, %top{h}")
        tops.append(e(f"select i1 {gt}, float {s}, float %top{h}"))

    e = block("pad")  # each row of scores S .. S16: MASKED, which exp turns to 0
    for h in H:
        at = e(f"add i64 %tp, %row{h}")
        e.do(f"store float {m}, ptr {ptr(e, 'float', '%sc', at)}, align 4")

    e = block("soft")  # exp and its sums, 16 columns a step
    sums = []
    for h in H:
        p = ptr(e, "float", "%sc", e(f"add i64 %c16, %row{h}"))
        x = e(f"fsub {F} {e(f'load {F}, ptr {p}, align 4')}, %topv{h}")
        ex = _exp(e, x)
        e.do(f"store {F} {ex}, ptr {p}, align 4")
        sums.append(e(f"fadd {F} %sum{h}, {ex}"))

    e = block("softend")
    for h in H:
        e.do(f"%total{h} = fadd float -0.0, {tree(e, sums[h], LANES, 'float', 'fadd')}")

    e = block("do")  # probabilities times values: the columns in order
    vv = row(e, e(f"getelementptr {KT}, ptr %v, i64 %vo"))
    accs = []
    for h in H:
        at = e(f"add i64 %u, %row{h}")
        w = bcast(e, e(f"load float, ptr {ptr(e, 'float', '%sc', at)}, align 4"))
        accs.append([e(f"call {F} @llvm.fmuladd.v16f32({F} {w}, {F} {vv[c]}, {F} %acc{h}_{c})") for c in range(C)])

    e = block("fin")
    for h in H:
        inv = bcast(e, e(f"fdiv float 1.0, %total{h}"))
        for c in range(C):
            y = e(f"fmul {F} %accL{h}_{c}, {inv}")
            e.do(f"store {F} {y}, ptr {ptr(e, 'float', '%out', h * D + LANES * c)}, align 4")

    def lines(label: str) -> str:
        return "\n".join(blocks[label].lines)

    def each(fmt: str) -> str:
        return "\n".join(fmt.format(h=h, c=c) for h in H for c in range(C if "{c}" in fmt else 1))

    tops_phi = "\n".join(f"  %top{h} = phi float [{m}, %entry], [{tops[h]}, %qk]" for h in H)
    tops_out = "\n".join(
        f"  %topi{h} = insertelement {F} poison, float {tops[h]}, i64 0\n"
        f"  %topv{h} = shufflevector {F} %topi{h}, {F} poison, <{LANES} x i32> zeroinitializer"
        for h in H
    )
    sum_phi = "\n".join(f"  %sum{h} = phi {F} [zeroinitializer, %padend], [{sums[h]}, %soft]" for h in H)
    acc_phi = each(f"  %acc{{h}}_{{c}} = phi {F} [zeroinitializer, %softend], [%accL{{h}}_{{c}}, %latch]")
    acc_latch = "\n".join(
        f"  %accL{h}_{c} = phi {F} [%acc{h}_{c}, %pv], [{accs[h][c]}, %do]" for h in H for c in range(C)
    )
    return f"""
define void @{name(D, G, half)}({SIGNATURE}) {{
entry:
  %last = sub i64 %S, 1
  %S16a = add i64 %S, 15
  %S16 = and i64 %S16a, -16
  %open = icmp eq i64 %masked, 0
  %kahead = mul i64 %stride, {AHEAD}
  %kfar = mul i64 %stride, {FAR}
{lines("entry")}
  br label %qk
{loop_top("qk", "t", 0, "entry", "qk")}
{tops_phi}
  %ko = mul i64 %t, %stride
{lines("qk")}
{loop_end("t", "%S", "qk", "padhead", "qmore")}
padhead:
{tops_out}
  %padany = icmp ult i64 %S, %S16
  br i1 %padany, label %pad, label %padend
{loop_top("pad", "tp", "%S", "padhead", "pad")}
{lines("pad")}
{loop_end("tp", "%S16", "pad", "padend", "pmore")}
padend:
  br label %soft
{loop_top("soft", "c16", 0, "padend", "soft", "c16n")}
{sum_phi}
{lines("soft")}
{loop_end("c16", "%S16", "soft", "softend", "smore", LANES, "c16n")}
softend:
{lines("softend")}
  br label %pv
{loop_top("pv", "u", 0, "softend", "latch")}
{acc_phi}
  %vo = mul i64 %u, %stride
  %vbp = getelementptr i8, ptr %valid, i64 %u
  %vbu = load i8, ptr %vbp
  %vok = icmp ne i8 %vbu, 0
  %use = or i1 %vok, %open
  br i1 %use, label %do, label %latch
do:
{lines("do")}
  br label %latch
latch:
{acc_latch}
{loop_end("u", "%S", "pv", "fin", "vmore")}
fin:
{lines("fin")}
  ret void
}}
"""


def module(shapes: list[tuple[int, int, bool]]) -> tuple[list[str], str]:
    """(names, IR) of the cores for (D, G, half) triples."""
    return [name(*s) for s in shapes], DECLARE + "\n".join(kernel(*s) for s in shapes)
