"""LLVM IR of the int8 kernels for 8 rows of x and more (batches, prefill) on Intel AMX
(the ``amx`` instruction set): the same
function as :mod:`.vector`'s kernels (same weights in tiles, same quantized x, same
signature), its integer dot products done by tile instructions.

AMX holds 8 two-dimensional registers (tiles) of up to 16 rows × 64 bytes and multiplies
them in one instruction: ``tdpbsud C, A, B``: C[m, n] += Σ_k A[m, k]·B[k/4, 4n + k%4]
(A signed bytes, B unsigned; ``tdpbssd`` both signed: q8's weights). The weights' tiles
already hold B's layout: a step's two tiles side by side (16 output rows), vector g of a
block is 16 rows × 4 consecutive k, i.e. row g of B. x needs no repacking: A is 16 rows
of xq, 32 bytes (one block) each, loaded with a stride of K::

    per step of 16 output rows, per block b of 32 k:
        B      = the block's 8 weight vectors (nibbles split, as the vector kernels do),
                 stored to the stack and loaded as one 8 × 64-byte tile
        for each 16 rows of x (A tiles a):
            C_a = 0;  C_a += A_a · B           16 rows of x × 16 output rows, int32
        C stored; for every row r of x:  acc[r] += float(C[r]) · (d_w · d_x[r, b])
                                         (+ the weights' minimum · x's sum, as the others)

The scales are per block (and per row), so the int32 sums go to float every block, as in
the vector kernels. Weights with a scale per 16 (q8 with G = 16, Q6_K) split the block:
two A loads of 16 bytes, two B tiles of 4 rows, a C tile per half.

Each call loads its tile configuration (``ldtilecfg``) and releases the tiles at the end.
Linux hands AMX's 8 KB of register state to a process only on request
(:func:`.cpu.amx_permitted`).
"""

from __future__ import annotations

from . import vector
from .blocks import k_scales, parse, q6_quants, scales
from .build import Body, bcast, chain, load, loop_end, loop_top, offset_at, per_tile, splat
from .frame import SIGNATURE, frame

DECLARE = """
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8 immarg)
declare void @llvm.x86.tileloadd64(i8 immarg, ptr, i64)
declare void @llvm.x86.tilestored64(i8 immarg, ptr, i64)
declare void @llvm.x86.tdpbsud(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tdpbssd(i8 immarg, i8 immarg, i8 immarg)
declare <16 x float> @llvm.fmuladd.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
"""

A_TILE, B_TILE = 0, 1  # tmm0: 16 rows of x; tmm1 (tmm2): the weights (of each half)
ROWS_A = 16  # rows of x an A tile holds
# the vector kernels' software prefetch of the weights' stream, here too (FAR: its L2 prefetch
# as well): at 8 rows the tiles' kernels, unlike the vector ones, wait on memory (rank 0's
# matmuls at batch 8: 15% faster; docs/measurements.md)
PREFETCH, FAR = True, True


def config(rows: int, a_tiles: int, halves: int) -> list[int]:
    """The 64-byte tile configuration: palette 1; each tile's bytes per row (16-bit, from
    byte 16) and rows (from byte 48): A (``rows`` of x), B (each half), a C per A and half."""
    cfg = [0] * 64
    cfg[0] = 1
    kb = 32 // halves  # bytes of x (k) per A row, per half

    def tile(i: int, n: int, colsb: int) -> None:
        cfg[16 + 2 * i], cfg[17 + 2 * i], cfg[48 + i] = colsb & 255, colsb >> 8, n

    tile(A_TILE, rows, kb)
    for h in range(halves):
        tile(B_TILE + h, kb // 4, 64)
    for c in range(a_tiles * halves):
        tile(3 + c, rows, 64)
    return cfg


def _a_tiles(x_rows: int) -> int:
    return -(-x_rows // ROWS_A)


# int8o at 8 rows: the share of blocks with some row's outlier from which both digits go
# through one tile product (below it, the outliers' digit on a branch); weights with two
# halves a block (Q6_K, q8 by 16) store two C tiles a product, so later. Measured (one
# layer's kernel, 16 layers rotating, outliers placed in a share f of the blocks): the
# branch costs ~linearly in f, dense not at all; they cross near f = 0.5 for q4 and
# Q4_K (default model gate_up 120 against 108 + 40f us), 0.7 for Q6_K. At 16 rows dense
# is two tile products a block, the branch's worst case: the branch alone.
DENSE_FROM = {1: (1, 2), 2: (3, 4)}  # halves -> (numerator, denominator)


def kernel(fmt: str, isa: str, R: int, D: int = 1, G: int = 32, sparse: bool = False) -> tuple[str, str]:
    """(name, IR) of the AMX kernel for R rows of x (each D digits: R·D a multiple of 8, at
    most 32) over pairs of weight tiles. ``sparse``: int8o's second digit (x's outliers),
    added after the weights' minimum term, in the order of :mod:`.vector`'s ``_o``
    kernels, so the bits are theirs. Up to 8 rows of x, two bodies, one chosen per call by
    a scan of the rows' outlier scales (:func:`_choose`); at 16, ``_s``'s alone:

    - ``_s``: the outliers' digit multiplied only in blocks where some row has one (a
      branch, as the vector kernels do): its own A tile (stride 2K), product and C store;
    - ``_d``: both digits in one tile product, as int8x2's: the rows of xq alternate
      digits, so 8 rows of x and their outliers are one A tile of 16 rows. Where a block
      has no outlier its digit is zeros and its scale 0, and the term adds +0.

    Real activations put some row's outlier in most blocks at 8 rows (the default model:
    60% at K = 576, 97% at K = 1536), where ``_s`` took two products and two C stores a
    block and mispredicted its branch; the 1B benchmark's random weights in 6% at
    K = 2048, where ``_d``'s wider tiles and second digit's float work are the waste."""
    name = f"{fmt}_amx_r{R}_d{D}_g{G}" + ("_o" if sparse else "")
    core, _, _ = parse(fmt)
    if (
        isa != "amx"
        or core not in ("q4", "q8", "q4k", "q6k")
        or D not in (1, 2)
        or (R * D) % 8
        or R * D > 2 * ROWS_A
        or G not in (16, 32)
        or (G == 16 and core != "q8")
        or (core in ("q4k", "q6k") and G != 32)
        or (sparse and (D != 2 or R > ROWS_A))
    ):
        raise ValueError(f"no AMX kernel for {name}")
    if not sparse:
        return name, _body(name, fmt, R, D, G, "plain")
    if R * D > ROWS_A:
        return name, _body(name, fmt, R, D, G, "sparse")
    halves = 2 if core == "q6k" or G == 16 else 1
    bodies = [
        _body(f"{name}_{m[0]}", fmt, R, D, G, m).replace("define void", "define internal void", 1)
        for m in ("dense", "sparse")
    ]
    return name, "".join(bodies) + _choose(name, R, D, DENSE_FROM[halves])


def _choose(name: str, R: int, D: int, dense_from: tuple[int, int]) -> str:
    """The int8o kernel itself: counts the blocks where some live row of x has an
    outlier (its outlier scale, row D·r + 1 of xd, nonzero) and calls ``_d`` from
    ``dense_from`` of them on, else ``_s``."""
    num, den = dense_from
    rows = "\n".join(f"  %or{r} = mul i64 %nb, {D * r + 1}\n  %live{r} = icmp slt i64 {r}, %M" for r in range(R))
    scan = "\n".join(
        f"  %a{r} = add i64 %or{r}, %b\n  %p{r} = getelementptr i32, ptr %xd, i64 %a{r}\n"
        f"  %v{r} = load i32, ptr %p{r}, align 4\n  %w{r} = select i1 %live{r}, i32 %v{r}, i32 0"
        for r in range(R)
    )
    ors = "%w0"
    for r in range(1, R):
        scan += f"\n  %o{r} = or i32 {ors}, %w{r}"
        ors = f"%o{r}"
    return f"""
define void @{name}({SIGNATURE}) {{
entry:
{rows}
  br label %scan
{loop_top("scan", "b", 0, "entry", "scan")}
  %n = phi i64 [0, %entry], [%n1, %scan]
{scan}
  %hit = icmp ne i32 {ors}, 0
  %inc = zext i1 %hit to i64
  %n1 = add i64 %n, %inc
{loop_end("b", "%nb", "scan", "done")}
done:
  %lhs = mul i64 %n1, {den}
  %rhs = mul i64 %nb, {num}
  %dense = icmp uge i64 %lhs, %rhs
  br i1 %dense, label %dense_body, label %sparse_body
dense_body:
  call void @{name}_d({_ARGS})
  ret void
sparse_body:
  call void @{name}_s({_ARGS})
  ret void
}}
"""


_ARGS = ", ".join(a.strip() for a in SIGNATURE.split(","))


def _body(name: str, fmt: str, R: int, D: int, G: int, mode: str) -> str:
    """One kernel's function: ``plain`` (every digit every block), ``dense`` or ``sparse``
    (int8o, :func:`kernel`)."""
    core, implied, half = parse(fmt)
    x_rows = R * D
    branch = mode == "sparse"
    e = Body(16)
    F = e.F
    latch = "join" if branch else "main"
    for r in range(R):
        e.do(f"%acc{r} = phi {F} [zeroinitializer, %tile], [%acc{r}_n, %{latch}]")
    e.do("%b20 = shl i64 %b, 1")  # x's sums per 16 of this block: 2b, 2b + 1
    e.do("%b21 = add i64 %b20, 1")
    e.do("%bs = lshr i64 %b, 3")  # its super-block (K-quants)
    e.do(f"%bxd = mul i64 %b, {x_rows}")  # the block's row of xdt (and of xst, below)
    for j, (tb, ts) in enumerate(e.tiles):
        sfx = f"_{j}" if j else ""
        e.do(f"{ts} = add i64 %tS{sfx}, %bs")
        e.do(f"{tb} = add i64 %tnb{sfx}, %b")
    if PREFETCH:
        vector.prefetch(e, core, far=FAR)
    mins: list[tuple[str, int]] = []
    if core in ("q4k", "q6k"):
        dvs, mins = k_scales(e, core, "avx512", half)
    elif G == 32:
        dvs = [scales(e, "avx512", "%d", offset_at(e, 3), half)]
    else:
        dvs = [scales(e, "avx512", "%d", offset_at(e, 4, h * 8), half) for h in (0, 1)]
    if core == "q4" and implied:
        mins = [(e(f"fmul {F} {dvs[0]}, {splat('float', 16, '-8.0')}"), -1)]
    elif core == "q4":
        mins = [(scales(e, "avx512", "%m", offset_at(e, 3), half), -1)]
    # B one block ahead: this block's weights were stored to the stack a block ago (the
    # first block of a step: now, on a branch), and the next block's are stored now, so
    # that no tile load waits on the vector stores just made (measured: 1.3-1.5x the speed)
    e.do("%first = icmp eq i64 %b, 0")
    e.do("br i1 %first, label %pro, label %main")
    e.lines.append("pro:")
    _store_weights(e, core, "%buf0")
    e.do("br label %main")
    e.lines.append("main:")
    e.do("%bnext = add i64 %b, 1")
    e.do("%more1 = icmp ult i64 %bnext, %nb")
    e.do("%bn = select i1 %more1, i64 %bnext, i64 %b")  # the last block: itself again, harmless
    here = e.tiles
    e.tiles = [(f"{tb}n", f"{ts}n") for tb, ts in here]
    for j, (tb, _) in enumerate(e.tiles):
        e.do(f"{tb} = add i64 %tnb{f'_{j}' if j else ''}, %bn")
    e.do("%par = and i64 %b, 1")
    e.do("%odd = icmp eq i64 %par, 1")
    e.do("%bufnext = select i1 %odd, ptr %buf0, ptr %buf1")
    e.do("%bufnow = select i1 %odd, ptr %buf1, ptr %buf0")
    _store_weights(e, core, "%bufnext")
    e.tiles = here
    halves = len(dvs)
    for h in range(halves):
        e.do(f"%bh{h} = getelementptr i8, ptr %bufnow, i64 {256 * h}")
        e.do(f"call void @llvm.x86.tileloadd64(i8 {B_TILE + h}, ptr %bh{h}, i64 64)")
    # A tiles: 16 rows of xq each (stride K): row i of x's digit j is row D·i + j of xq;
    # ``sparse``: one per digit, the digit's row of each of the R rows of x (stride 2K),
    # the second multiplied only in the blocks where some row has an outlier
    n_a, a_rows = (2, R) if branch else (_a_tiles(x_rows), min(ROWS_A, x_rows))
    stride = "%xstride" if branch else "%K"
    xk = e("shl i64 %b, 5", "xb")  # the block's first byte in a row of xq

    def where(r: int, j: int) -> tuple[int, int]:  # (A tile, its row) of digit j of row r
        return (j, r) if branch else divmod(D * r + j, ROWS_A)

    def multiply(a: int) -> None:  # C tiles of A tile a (one per half), stored
        e.do(f"%xa{a} = add i64 %xarow{a}, {xk}")
        for h in range(halves):
            c = 3 + a * halves + h
            e.do(f"call void @llvm.x86.tilezero(i8 {c})")
            at = e(f"add i64 %xa{a}, {16 * h}", "xa") if h else f"%xa{a}"
            p = e(f"getelementptr i8, ptr %xq, i64 {at}", "p")
            e.do(f"call void @llvm.x86.tileloadd64(i8 {A_TILE}, ptr {p}, i64 {stride})")
            e.do(f"call void @llvm.x86.{dot}(i8 {c}, i8 {A_TILE}, i8 {B_TILE + h})")
        for h in range(halves):
            c = a * halves + h
            e.do(f"%cp{c} = getelementptr i8, ptr %cbuf, i64 {1024 * c}")
            e.do(f"call void @llvm.x86.tilestored64(i8 {3 + c}, ptr %cp{c}, i64 64)")

    def digit_terms(r: int, j: int) -> list[tuple[str, str]]:
        a, i = where(r, j)
        xd = bcast(e, load(e, "float", "%xdt", e(f"add i64 %bxd, {D * r + j}", "xb"), "float"))
        out = []
        for h, dv in enumerate(dvs):
            cp = e(f"getelementptr i8, ptr %cbuf, i64 {1024 * (a * halves + h) + 64 * i}", "cp")  # row i of C
            isum = e(f"load {e.I}, ptr {cp}, align 64", "v")  # its alignment known: 12-13% faster (measured)
            out.append((e(f"sitofp {e.I} {isum} to {F}"), e(f"fmul {F} {dv}, {xd}")))
        return out

    def least(r: int) -> list[tuple[str, str]]:  # the weights' minimum times x's sums
        out = []
        for mv, h in mins:
            at = e(f"add i64 %bxs, {S * r + max(h, 0)}", "xb")
            out.append((mv, bcast(e, load(e, "float", "%xst", at, "float"))))
        return out

    S = 2 if any(h >= 0 for _, h in mins) else 1  # x's sums a block: per 16 (Q6_K) or 32
    e.do(f"%bxs = mul i64 %b, {R * S}")
    dot = "tdpbssd" if core == "q8" else "tdpbsud"
    for a in range(1 if branch else n_a):
        multiply(a)
    for r in range(R):
        if mode == "plain":
            chain(e, f"%acc{r}", [t for j in range(D) for t in digit_terms(r, j)] + least(r), f"%acc{r}_n")
        elif mode == "dense":  # the vector kernels' order: the first digit, the minimum, the outliers
            chain(e, f"%acc{r}", digit_terms(r, 0) + least(r) + digit_terms(r, 1), f"%acc{r}_n")
        else:
            chain(e, f"%acc{r}", digit_terms(r, 0) + least(r), f"%acc{r}_a")
    if branch:  # as vector's: the rows' outlier scales OR-ed as integers, one branch
        bits = [load(e, "i32", "%xdt", e(f"add i64 %bxd, {D * r + 1}", "xb"), "float") for r in range(R)]
        some = bits[0]
        for c in bits[1:]:
            some = e(f"or i32 {some}, {c}", "c")
        e.do(f"%some = icmp ne i32 {some}, 0")
        e.do("br i1 %some, label %sparse, label %join, !prof !0")
        e.lines.append("sparse:")
        multiply(1)
        for r in range(R):
            chain(e, f"%acc{r}_a", digit_terms(r, 1), f"%acc{r}_s")
        e.do("br label %join")
        e.lines.append("join:")
        for r in range(R):
            e.do(f"%acc{r}_n = phi {F} [%acc{r}_a, %main], [%acc{r}_s, %sparse]")
    ctiles = n_a * halves
    cfg = ", ".join(f"i8 {v}" for v in config(a_rows, n_a, halves))
    entry = (
        f"  %cfg = alloca <64 x i8>, align 64\n  store <64 x i8> <{cfg}>, ptr %cfg, align 64\n"
        "  call void @llvm.x86.ldtilecfg(ptr %cfg)\n"
        "  %buf0 = alloca [512 x i8], align 64\n  %buf1 = alloca [512 x i8], align 64\n"
        f"  %cbuf = alloca [{1024 * ctiles} x i8], align 64\n"
        + "".join(f"  %xarow{a} = mul i64 %nb, {32 * (1 if branch else ROWS_A) * a}\n" for a in range(n_a))
        + "  %xstride = shl i64 %nb, 6\n"  # 2K: int8o's rows of one digit
        + f"  %nxd = mul i64 %nb, {x_rows}\n  %xdt = alloca float, i64 %nxd, align 64\n"
        + f"  %nxs = mul i64 %nb, {R * S}\n  %xst = alloca float, i64 %nxs, align 64\n"
        + f"  call void @{name}_tr(ptr %xd, ptr %xs, ptr %xdt, ptr %xst, i64 %nb)\n"
    )
    body = frame(name, e, R, D, latch, entry, "  call void @llvm.x86.tilerelease()\n")
    return _transposer(f"{name}_tr", R, D, S if mins else 0) + body


def _transposer(name: str, R: int, D: int, S: int) -> str:
    """x's scales block-major for a kernel's call: ``xdt[b, D·r + j] = xd[D·r + j, b]``
    and (``S`` sums a block, 0: none) ``xst[b, S·r + h] = xs[D·r, S·b + h]`` (the first
    digit's). Row-major, each row of x's scales was a pointer of its own in the block
    loop: 24 at 8 rows of int8o, more than the registers, reloaded from the stack every
    block; block-major they are one pointer and offsets. nb·(R·D + R·S) floats copied."""
    rows = R * D
    lines = [f"  %bo = mul i64 %b, {rows}", f"  %so = mul i64 %b, {R * S}", f"  %sb = mul i64 %b, {S}"]
    head = []

    def move(tag: str, src: str, row: int, at: str, dst: str, to: str) -> None:
        """One float: ``src``'s row ``row`` (of nb, or S·nb, floats), element ``at`` on
        from the block's start, to ``dst`` at ``to``."""
        head.append(f"  %{tag}r = mul i64 %nb, {row}")
        lines.extend([
            f"  %{tag}a = add i64 %{tag}r, {at}",
            f"  %{tag}p = getelementptr float, ptr {src}, i64 %{tag}a",
            f"  %{tag}v = load float, ptr %{tag}p, align 4",
            f"  %{tag}q = getelementptr float, ptr {dst}, i64 {to}",
            f"  store float %{tag}v, ptr %{tag}q, align 4",
        ])  # fmt: skip

    for i in range(rows):
        lines.append(f"  %xt{i} = add i64 %bo, {i}")
        move(f"x{i}_", "%xd", i, "%b", "%xdt", f"%xt{i}")
    for r in range(R if S else 0):
        for h in range(S):
            lines += [f"  %sf{r}_{h} = add i64 %sb, {h}", f"  %st{r}_{h} = add i64 %so, {S * r + h}"]
            move(f"s{r}_{h}_", "%xs", D * r * S, f"%sf{r}_{h}", "%xst", f"%st{r}_{h}")
    head_text = "\n".join(head)
    body = "\n".join(lines)
    return f"""
define internal void @{name}(ptr noalias %xd, ptr noalias %xs, ptr noalias %xdt, ptr noalias %xst, i64 %nb) {{
entry:
{head_text}
  br label %blk
{loop_top("blk", "b", 0, "entry", "blk")}
{body}
{loop_end("b", "%nb", "blk", "done")}
done:
  ret void
}}
"""


def _store_weights(e: Body, core: str, buf: str) -> None:
    """B of the block at ``e.tiles``' indices, row g = the block's vector g (16 output rows
    × 4 consecutive k, unsigned but q8's), stored to ``buf``."""
    B = e.B
    if core in ("q4", "q4k"):
        raw = [per_tile(e, "<32 x i8>", "%qs", offset_at(e, 7, 32 * g)) for g in range(4)]
        rows = [e(f"and {B} {v}, {splat('i8', 64, 15)}") for v in raw] + [
            e(f"lshr {B} {v}, {splat('i8', 64, 4)}") for v in raw
        ]
    elif core == "q6k":
        rows = q6_quants(e)
    else:  # q8: signed weights as they are (tdpbssd)
        rows = [per_tile(e, "<32 x i8>", "%qs", offset_at(e, 8, 32 * g)) for g in range(8)]
    for g, v in enumerate(rows):
        p = e(f"getelementptr i8, ptr {buf}, i64 {64 * g}", "bp")
        e.do(f"store {B} {v}, ptr {p}, align 64")


def module(specs: list[tuple]) -> tuple[list[str], str]:
    """(names, one module's IR) for several AMX kernels."""
    return vector.module(specs, kernel, DECLARE)
