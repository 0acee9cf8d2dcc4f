"""The function every int8 kernel's body sits in (:mod:`.vector`'s vector kernels and
:mod:`.amx`'s tile kernels): its signature, the loop over tiles of output rows, the loop
over blocks of K (for int8o, in segments between the blocks where some row of x has an
outlier), the accumulators' phis and the stores of y's rows."""

from __future__ import annotations

from .build import Body, idx, load, loop_end, loop_top

SIGNATURE = "ptr %qs, ptr %d, ptr %m, ptr %xq, ptr %xd, ptr %xs, ptr %y, i64 %T, i64 %nb, i64 %M, i64 %ldy"


def any_outlier(e: Body, R: int, b: str, name: str) -> None:
    """``name`` = whether some row of x has an outlier in block ``b``: the rows' outlier
    scales (row 2r + 1 of xd) OR-ed as integers, one test."""
    bits = [load(e, "i32", "%xd", e(f"add i64 %xdrow{r}_1, {b}", "xb"), "float") for r in range(R)]
    some = bits[0]
    for c in bits[1:]:
        some = e(f"or i32 {some}, {c}", "c")
    e.do(f"{name} = icmp ne i32 {some}, 0")


def frame(
    name: str, e: Body, R: int, D: int, latch: str, entry: str = "", leave: str = "", outliers: Body | None = None
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
{loop_top("tile", "t", 0, "entry", "tileend")}
{pair}
{loop}
tileend:
{ends}  %y0 = shl i64 %t, 3
{stores}
{loop_end("t", "%T", "tile", "exit", "again", step)}
exit:
{leave}  ret void
}}
"""


def _block_loop(block: str, latch: str) -> str:
    """A tile's loop over its blocks, the step ``block`` (ending in label ``latch``) each."""
    return f"""  br label %blk
{loop_top("blk", "b", 0, "tile", latch)}
{block}
{loop_end("b", "%nb", "blk", "tileend")}"""


def _segments(e: Body, o: Body, R: int) -> str:
    """A tile's blocks in segments [b0, stop], stop the next block where some row has an
    outlier (or the last): the step ``e`` in a loop, then the outliers' digit ``o``."""
    F = e.F
    scan = Body(e.V)
    scan.n = o.n
    any_outlier(scan, R, "%q", "%hit")

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
{loop_top("blk", "b", "%b0", "scandone", "blk")}
{each(f"  %acc{{r}} = phi {F} [%accin{{r}}, %scandone], [%acc{{r}}_a, %blk]")}
{chr(10).join(e.lines)}
{loop_end("b", "%end", "blk", "blkexit")}
blkexit:
  br i1 %isout, label %outl, label %tileend
outl:
{chr(10).join(o.lines)}
  %bn = add i64 %b, 1
  %tmore = icmp ult i64 %bn, %nb
  br i1 %tmore, label %seg, label %tileend"""
