"""Helpers of the per-rank suites: collective assertions and the references results are
checked against. These tests run on every rank at once under mpiexec, so every assertion
is collective: :func:`agree` fails on all ranks together, which keeps the ranks in step
(and hypothesis shrinking in step) instead of leaving some blocked."""

import os
import shutil
import tempfile
import time
import traceback
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI


def agree(cond: bool, msg: str = "") -> None:
    """Fail on every rank if ``cond`` is false on any rank, naming those ranks. The flags
    travel by a nonblocking all-gather polled against MPITP_TIMEOUT: ranks out of step (one
    raised before an earlier agree and went on to the next test) abort the launch with
    where each waits, instead of blocking it until the launcher's own limit."""
    world = MPI.COMM_WORLD
    flags = np.empty(world.size, np.int8)
    req = world.Iallgather(np.array([bool(cond)], np.int8), flags)
    limit = float(os.environ.get("MPITP_TIMEOUT") or 0)
    deadline = time.monotonic() + limit
    while not req.Test():
        if limit and time.monotonic() > deadline:
            text = (
                f"rank {world.rank}: waited more than {limit:g} s in agree({msg!r}) at\n"
                + "".join(traceback.format_stack(limit=6)[:-1])
                + "the ranks are out of step (one failed before an earlier agree?): aborting the launch\n"
            )
            os.write(2, text.encode())  # fd 2: the launcher's (pytest captures sys.stderr)
            world.Abort(1)
        time.sleep(0)
    if flags.all():
        return
    msgs = world.allgather(msg if not cond else "")
    pytest.fail("; ".join(f"rank {r}: {msgs[r]}" for r in np.flatnonzero(flags == 0)), pytrace=False)


def rank_inputs(shape, dtype, op, size, seed):
    """Every rank's input, generated identically on every rank (so each rank can compute
    the NumPy reference locally)."""
    dtype = np.dtype(dtype)
    out = []
    for r in range(size):
        rng = np.random.default_rng(seed * 1000 + r)
        if dtype == np.bool_:
            a = rng.integers(0, 2, shape).astype(bool)
        elif dtype.kind in "iu":
            lo, hi = (
                ((-3, 4) if op == "prod" else (-100, 101))
                if dtype.kind == "i"
                else ((0, 4) if op == "prod" else (0, 101))
            )
            a = rng.integers(lo, hi, shape).astype(dtype)
        elif dtype.kind == "c":
            a = (rng.uniform(0.5, 1.5, shape) + 1j * rng.uniform(-0.5, 0.5, shape)).astype(dtype)
        elif op == "prod":
            a = rng.uniform(0.5, 1.5, shape).astype(dtype)
        else:
            a = rng.standard_normal(shape).astype(dtype)
        out.append(a)
    return out


def bound(inputs, op, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind not in "fc" or op in ("max", "min") or MPI.COMM_WORLD.size == 1:
        return 0.0
    u = np.finfo(dtype).eps / 2
    g = (MPI.COMM_WORLD.size - 1) * u / (1 - (MPI.COMM_WORLD.size - 1) * u)
    stack = np.stack([np.abs(a.astype(np.complex128 if dtype.kind == "c" else np.float64)) for a in inputs])
    if op == "sum":
        return 2 * g * stack.sum(axis=0)
    return 2 * g * (4 if dtype.kind == "c" else 1) * stack.prod(axis=0)


MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "prod": MPI.LAND, "min": MPI.LAND}  # NumPy: + is or, * is and


def mpi_reference(x, op):
    """MPI's own all-reduce of ``x`` over the world, through mpi4py alone — no mpitp table:
    mpi4py's dtype map (``MPI._typedict``) and MPI's built-in operations (on bools, the
    logical ones NumPy's arithmetic amounts to). None where this MPI library computes the
    operation wrongly (:func:`mpi_wraps`): then NumPy's result is the only reference.
    Collective: every rank calls it with the same dtype and op."""
    if op == "sum" and x.dtype.kind in "iu" and not mpi_wraps(x.dtype):
        return None
    dt = MPI._typedict[x.dtype.char]
    y = np.empty_like(x)
    MPI.COMM_WORLD.Allreduce([x, dt], [y, dt], op=(BOOL_OPS if x.dtype == np.bool_ else MPI_OPS)[op])
    return y


_WRAPS: dict = {}


def mpi_wraps(dtype) -> bool:
    """Whether MPI's built-in SUM of ``dtype`` wraps around on overflow, as C and NumPy do
    (Open MPI 5.0's AVX op component saturates 8- and 16-bit sums of long enough arrays).
    Probed here with MPI alone, once per dtype; collective."""
    dtype = np.dtype(dtype)
    if dtype not in _WRAPS:
        top = np.full(4096, np.iinfo(dtype).max, dtype)
        got = np.empty_like(top)
        dt = MPI._typedict[dtype.char]
        MPI.COMM_WORLD.Allreduce([top, dt], [got, dt], op=MPI.SUM)
        want = np.full(4096, np.iinfo(dtype).max, dtype)
        for _ in range(MPI.COMM_WORLD.size - 1):
            want = np.add(want, top, dtype=dtype)  # wraps
        _WRAPS[dtype] = bool(MPI.COMM_WORLD.allreduce(int(np.array_equal(got, want)), op=MPI.MIN))
    return _WRAPS[dtype]


def split_sizes(n: int, parts: int) -> list[int]:
    """Chunk sizes of ``numpy.array_split`` — the cut mpitp promises, computed by NumPy."""
    return [len(c) for c in np.array_split(np.empty(n, np.uint8), parts)]


def ring_sends(n: int, parts: int, idx: int, phase: str) -> int:
    """Elements member ``idx`` of a ring of ``parts`` sends for ``n`` elements: the
    reduce-scatter sends every chunk but its own, the all-gather every chunk but its right
    neighbour's, the all-reduce both."""
    if parts == 1:
        return 0
    c = split_sizes(n, parts)
    rs, ag = n - c[idx], n - c[(idx + 1) % parts]
    return {"rs": rs, "ag": ag, "ar": rs + ag}[phase]


def two_level_sends(alg: str, node_sizes: list[int], n: int, itemsize: int) -> list[tuple[int, int]]:
    """(intra, inter) elements every rank sends in a two-level all-reduce, from the
    algorithm's description alone (DESIGN.md §3): rings inside each node, then across nodes
    on shards (``hierarchical``, in pipelined pieces of >= 1 MiB, at most 16) or on whole
    buffers between the node leaders (``hierarchical_leader``, the fallback for uneven nodes)."""
    from mpitp.comm.algorithms.hierarchical import MAX_PIECES, PIECE_BYTES  # the two constants only

    if alg == "hierarchical" and len(set(node_sizes)) > 1:
        alg = "hierarchical_leader"
    M, out = len(node_sizes), []
    for m, L in enumerate(node_sizes):
        for lr in range(L):
            if alg == "hierarchical":
                pieces = split_sizes(n, max(1, min(MAX_PIECES, n * itemsize // PIECE_BYTES)))
                intra = sum(ring_sends(p, L, lr, "rs") + ring_sends(p, L, lr, "ag") for p in pieces)
                inter = sum(ring_sends(split_sizes(p, L)[lr], M, m, "ar") for p in pieces)
            else:
                intra = ring_sends(n, L, lr, "rs") + ring_sends(n, L, lr, "ag")
                shard = split_sizes(n, L)
                intra += n - shard[0] if lr == 0 else shard[lr]  # shards to the leader and back
                inter = ring_sends(n, M, m, "ar") if lr == 0 else 0
            out.append((intra, inter))
    return out


def numpy_reference(inputs, op):
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    acc = inputs[0].copy()
    for a in inputs[1:]:
        acc = fn(acc, a)
    return acc


def close(a, b, tol):
    if np.dtype(a.dtype).kind in "fc":
        diff = np.abs(a.astype(np.complex128) - b.astype(np.complex128))
        return bool(np.all(diff <= tol * (1 + 1e-6) + np.finfo(a.dtype).tiny))
    return bool(np.array_equal(a, b))


def same_on_all_ranks(y) -> bool:
    digests = MPI.COMM_WORLD.allgather(zlib.crc32(np.ascontiguousarray(y).tobytes()))
    return len(set(digests)) == 1


def cma_permitted() -> bool:
    """Whether this node lets a rank read its neighbour's memory (the CMA transport's
    own probe: ptrace permission, no seccomp filter in the way). Collective."""
    from mpitp.comm.transport import cma

    world = MPI.COMM_WORLD
    return world.size == 1 or cma.works(world)[0]


def decode_both_ways(model, prompts: list[list[int]]):
    """One decode step after a left-padded prefill of ``prompts``, run twice from the same
    cache: through the model's bound decode loop (:mod:`mpitp.models.decode_step`) and
    through its generic layers. Returns (loop logits, generic logits, whether the loop ran)."""
    import copy

    B, T = len(prompts), max(len(p) for p in prompts)
    ids = np.zeros((B, T), np.int64)
    cache = model.new_cache(B, T + 1)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = p
        cache.valid[b, T - len(p) : T + 1] = True
    positions = np.maximum(np.cumsum(cache.valid[:, :T], axis=1) - 1, 0)
    first = model.forward(ids, positions, cache, last_only=True)[:, -1]
    nxt = first.argmax(-1)[:, None]
    pos = positions[:, -1:] + 1
    generic_cache = copy.deepcopy(cache)
    loop = model._decode_layers()
    ran = loop is not None and loop.fits(B, _decode_step_of(model, pos, cache), cache)
    fast = model.forward(nxt, pos, cache, last_only=True)
    model._decode, model._decode_built = None, True  # the generic layers, for this one call
    try:
        generic = model.forward(nxt, pos, generic_cache, last_only=True)
    finally:
        model._decode_built = False
    return fast, generic, ran


def _decode_step_of(model, positions, cache):
    from mpitp.models.layers import Step

    return Step(model.rotary, positions, cache, 1, model.xp)


@contextmanager
def shared_dir(prefix: str, write):
    """A directory every rank sees (one machine): rank 0 makes it and runs ``write(path)``
    into it, the others wait; removed when all are done."""
    world = MPI.COMM_WORLD
    root = Path(world.bcast(tempfile.mkdtemp(prefix=prefix) if world.rank == 0 else None))
    if world.rank == 0:
        write(root)
    world.Barrier()
    try:
        yield root
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
