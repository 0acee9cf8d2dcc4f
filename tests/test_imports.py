"""The house's import graph, drawn from every import statement in mpitp/ (those inside
functions too): no circle, and arrows only point down the floors::

    cli, the package's own __init__                         (what users call)
    serve, train, bench, plan                               (what the commands run)
    models                                                  (LLaMA/Qwen2 on the layers below)
    tp                                                      (Megatron's parallel layers)
    kernels, comm                                           (beside each other: comm is injected)
    settings, errors, log, backend, threads, ...            (the ground floor)

A circle closed by an import inside a function still couples its modules: it counts."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "mpitp"
FLOORS = {
    "cli": 5,
    "mpitp": 5,
    "serve": 4,
    "train": 4,
    "bench": 4,
    "plan": 4,
    "models": 3,
    "tp": 2,
    "kernels": 1,
    "comm": 1,
}  # every other module of mpitp/: floor 0


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def edges() -> dict[str, set[str]]:
    """module -> the mpitp modules it imports (``from pkg import mod`` is an import of mod)."""
    mods = modules()
    out: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        here = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = here.split(".")
                base = (
                    ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]) if node.level else node.module
                )
                base = (base or "").rstrip(".")
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [s for s in subs if s in mods] + ([base] if any(s not in mods for s in subs) else [])
            else:
                continue
            out[m] |= {n for n in names if n in mods and n != m}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.get(parts[1] if len(parts) > 1 else "mpitp", 0)


def test_no_import_circles():
    graph = edges()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk saw the package
    assert circles(graph) == []


def test_imports_point_down_the_floors():
    up = [f"{a} -> {b}" for a, bs in edges().items() for b in bs if floor(b) > floor(a)]
    assert up == [], "imports back up a floor:\n" + "\n".join(sorted(up))


def test_the_check_sees_a_circle_closed_inside_a_function():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [["a", "b", "c"]]


def test_modules_stay_small_and_keep_their_private_names():
    """No module over 400 lines; no ``_name`` imported from another module of mpitp (a name
    two modules share is public: give it a name without the underscore)."""
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
    private = []
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mpitp")):
                private += [f"{m}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert private == []
