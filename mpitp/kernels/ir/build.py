"""The toolkit every LLVM IR kernel generator here writes with (:mod:`.vector`,
:mod:`.amx`, :mod:`.quantize`, :mod:`.attend`): numbered SSA names and their lines
(:class:`Body`), vector constants and shuffle masks, loads at element offsets, a tile's
rows of a value loaded per step, broadcasts and chains of multiply-adds."""

from __future__ import annotations

UNLIKELY = '\n!0 = !{!"branch_weights", i32 1, i32 64}\n'  # taken once in 64


def splat(t: str, n: int, v) -> str:
    return "<" + ", ".join(f"{t} {v}" for _ in range(n)) + ">"


def idx(ix) -> str:
    """A shufflevector mask."""
    ix = list(ix)
    return f"<{len(ix)} x i32> <" + ", ".join(f"i32 {i}" for i in ix) + ">"


class Body:
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


def load(e: Body, ty: str, base: str, offset: str, elem: str = "i8") -> str:
    p = e(f"getelementptr {elem}, ptr {base}, i64 {offset}", "p")
    return e(f"load {ty}, ptr {p}, align 1")


def lanes_of(ty: str) -> int:
    return int(ty[1:].split(" x ")[0])


def per_tile(e: Body, ty: str, base: str, offset, elem: str = "i8") -> str:
    """``ty`` (one tile's 8 rows of something) loaded at ``offset(tb, ts)`` of each tile of
    this step, joined: [tile t's, tile t+1's] where a step takes two."""
    parts = [load(e, ty, base, offset(tb, ts), elem) for tb, ts in e.tiles]
    if len(parts) == 1:
        return parts[0]
    return e(f"shufflevector {ty} {parts[0]}, {ty} {parts[1]}, {idx(range(2 * lanes_of(ty)))}")


def offset_at(e: Body, shift: int, plus: int = 0, which: int = 0, name: str = "o"):
    """offset(tb, ts) = (tb or ts) << shift (+ plus): an element offset in a tile's arrays."""

    def offset(tb: str, ts: str) -> str:
        o = e(f"shl i64 {(tb, ts)[which]}, {shift}", name)
        return e(f"add i64 {o}, {plus}", name) if plus else o

    return offset


def bcast(e: Body, s: str) -> str:
    v = e(f"insertelement {e.F} poison, float {s}, i64 0")
    return e(f"shufflevector {e.F} {v}, {e.F} poison, <{e.V} x i32> zeroinitializer")


def chain(e: Body, acc: str, terms: list[tuple[str, str]], last: str) -> None:
    """``last = acc + Σ vector·scale``, the products added in order."""
    a, F = acc, e.F
    for i, (v, sc) in enumerate(terms):
        op = f"call {F} @llvm.fmuladd.v{e.V}f32({F} {v}, {F} {sc}, {F} {a})"
        if i + 1 < len(terms):
            a = e(op)
        else:
            e.do(f"{last} = {op}")


def tree(e: Body, v: str, n: int, ty: str, op: str) -> str:
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


def loop_top(label: str, i: str, start, pred: str, back: str, step_name: str = "") -> str:
    """A counted loop's head: block ``label`` and the phi of its counter ``%i``: ``start``
    on entry from ``pred``, the next value (``%i1``, or ``%step_name``) from ``back``."""
    return f"{label}:\n  %{i} = phi i64 [{start}, %{pred}], [%{step_name or i + '1'}, %{back}]"


def loop_end(i: str, end, label: str, exit: str, more: str = "more", step=1, step_name: str = "") -> str:
    """A counted loop's latch: the next value of ``%i`` (``step`` on), back to ``label``
    while it is below ``end`` (unsigned), else on to ``exit``."""
    n = step_name or i + "1"
    return (
        f"  %{n} = add i64 %{i}, {step}\n  %{more} = icmp ult i64 %{n}, {end}\n"
        f"  br i1 %{more}, label %{label}, label %{exit}"
    )
