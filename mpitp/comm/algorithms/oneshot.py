"""One-shot all-reduce of small messages between the ranks of one node, compiled.

A decode step of a tensor-parallel model makes two all-reduces a layer of a few KiB
each (the default model: 60 of 2.3 KiB a token). MPI's own call costs ~4-5 µs each
there, most of it the library's and mpi4py's way in and out; the ring costs a
handshake per step. Here every rank publishes its whole buffer once and sums everyone's
(the ``one-shot'' all-reduce of NCCL and TensorRT-LLM for small messages)::

    shared window (allocated by rank 0, mapped by all), one row per rank:
    row r | flag: call number | count 0 | count 1 | ... | done: call number | slot 0 | slot 1 |
            r's buffer of that call is in slot (call % 2),        r has read every slot
            its length in count (call % 2)                        of that call

    call s on rank r:  wait every peer's done >= s - 2   (slot s % 2 is free again)
                       copy x into r's slot s % 2, store flag = s
                       wait every peer's flag >= s, then
                       out = slot_0 + slot_1 + ... + slot_{N-1}   (rank order, so every rank
                       store done = s                              gets the same bits)

Flags are read with acquire loads and written with release stores (LLVM atomics), so
the data a flag announces is visible before the flag is. The waits spin in compiled
code for a bounded number of polls, then come back to Python, which pokes MPI's
progress engine (a rank waiting here makes no MPI call; see
:mod:`mpitp.comm.transport.shm`), yields the core where ranks outnumber cores, and
checks the watchdog; then it spins again. Each rank writes its element count beside
its flag: a peer with another count is an error on every rank, not a wrong sum.
"""

from __future__ import annotations

import os
import time

import numba
import numpy as np
from mpi4py import MPI
from numba import njit, types
from numba.extending import intrinsic

from ...errors import MpitpError

HEADER = 256  # bytes of a row before its slots: flag (0), counts (8, 16), done (128)
_FLAG, _COUNT, _DONE = 0, 1, 16  # int64 words of the row (counts: _COUNT + parity)
POLLS = 4096  # compiled polls of a wait before Python looks at the watchdog (~10-20 µs)
DTYPES = (np.float32, np.float64, np.int32, np.int64)
OPS = ("sum", "prod", "max", "min")
DTYPE_NAMES = "float32, float64, int32 or int64"
_CODE = {op: i for i, op in enumerate(OPS)}


class CountMismatch(MpitpError, ValueError):
    """Ranks passed buffers of different lengths to one all-reduce."""


@intrinsic
def _load_acquire(typingctx, addr):
    """The int64 at address ``addr``, an acquire load."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(addr), codegen


@intrinsic
def _store_release(typingctx, addr, value):
    """Store int64 ``value`` at address ``addr``, a release store."""
    if not isinstance(addr, types.Integer) or not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        v = args[1]
        if v.type.width != 64:
            v = builder.sext(v, ir.IntType(64))
        builder.store_atomic(v, ptr, "release", 8)
        return context.get_dummy_value()

    return types.void(addr, value), codegen


@njit(nogil=True, cache=True)
def _waited(base, row, size, word, target, polls):
    """Whether every row's int64 ``word`` reached ``target`` within ``polls`` polls."""
    for q in range(size):
        addr = base + q * row + word * 8
        n = 0
        while _load_acquire(addr) < target:
            n += 1
            if n >= polls:
                return False
    return True


@njit(nogil=True, cache=True)
def _published(x, flat, base, row, at, rank, size, seq, phase, polls):
    """A call's first part, from ``phase`` on: once slot ``seq % 2`` is free again, ``x``
    copied into this rank's, its count and flag stored; then every rank's flag awaited.
    Returns 0 or 1 (the phase reached, polls spent) or 2 (every rank's slot is in)."""
    n, e = x.size, flat.itemsize
    if phase == 0:
        if not _waited(base, row, size, _DONE, seq - 2, polls):
            return 0
        mine = flat[at + rank * row // e : at + rank * row // e + n]
        for i in range(n):
            mine[i] = x[i]
        _store_release(base + rank * row + (_COUNT + (seq & 1)) * 8, n)
        _store_release(base + rank * row + _FLAG * 8, seq)
    if not _waited(base, row, size, _FLAG, seq, polls):
        return 1
    return 2


@njit(nogil=True, cache=True)
def _step(x, out, flat, base, row, cap, rank, size, seq, op, phase, polls):
    """Call ``seq`` from ``phase`` on (0: not published, 1: published, waiting for peers);
    returns the phase reached: 2 when ``out`` holds the result, -1 on a count mismatch
    (``done`` not yet stored).
    ``flat``: the whole window as x's type (rows of ``row`` bytes, slots of ``cap``);
    ``op`` indexes OPS."""
    n = x.size
    p = seq & 1
    e = flat.itemsize
    at = (HEADER + p * cap) // e  # slot p of row 0, in elements
    phase = _published(x, flat, base, row, at, rank, size, seq, phase, polls)
    if phase < 2:
        return phase
    for q in range(size):
        if _load_acquire(base + q * row + (_COUNT + p) * 8) != n:
            return -1  # done is stored by the caller, once it has read the counts
    a = flat[at : at + n]
    for i in range(n):
        out[i] = a[i]
    for q in range(1, size):
        b = flat[at + q * row // e : at + q * row // e + n]
        if op == 0:
            for i in range(n):
                out[i] += b[i]
        elif op == 1:
            for i in range(n):
                out[i] *= b[i]
        elif op == 2:
            for i in range(n):
                out[i] = max(out[i], b[i])
        else:
            for i in range(n):
                out[i] = min(out[i], b[i])
    _store_release(base + rank * row + _DONE * 8, seq)
    return 2


@njit(nogil=True, cache=True)
def _gather_step(x, out, flat, base, row, cap, rank, size, seq, phase, polls, offs):
    """:func:`_step` of an all-gather along the last axis: ``x`` [B·n_rank] (this rank's
    [B, n_rank] flat) published, then every rank's slot copied straight into its columns
    [offs[q], offs[q + 1]) of ``out`` [B, offs[size]] (no concatenation after). -1: some
    rank's count is not B times its width."""
    p = seq & 1
    e = flat.itemsize
    at = (HEADER + p * cap) // e
    phase = _published(x, flat, base, row, at, rank, size, seq, phase, polls)
    if phase < 2:
        return phase
    B = out.shape[0]
    for q in range(size):
        if _load_acquire(base + q * row + (_COUNT + p) * 8) != B * (offs[q + 1] - offs[q]):
            return -1
    for q in range(size):
        w = offs[q + 1] - offs[q]
        src = flat[at + q * row // e : at + q * row // e + B * w]
        for b in range(B):
            o = out[b, offs[q] : offs[q] + w]
            for i in range(w):
                o[i] = src[b * w + i]
    _store_release(base + rank * row + _DONE * 8, seq)
    return 2


class OneShot:
    """The window and call counter of one-shot all-reduces over ``comm`` (one node).
    ``capacity``: the largest buffer in bytes. Collective to make (:func:`open_oneshot`)."""

    def __init__(self, comm: MPI.Comm, capacity: int, oversubscribed: bool, watchdog, gather: bool = False):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.capacity = -(-capacity // 64) * 64
        self.row = HEADER + 2 * self.capacity
        mine = self.row * self.size if self.rank == 0 else 0
        self.win = MPI.Win.Allocate_shared(mine, 1, comm=comm)  # type: ignore[arg-type]
        buf, _ = self.win.Shared_query(0)
        raw = np.frombuffer(buf, np.uint8)  # type: ignore[call-overload]  # mpi4py.buffer, unstubbed
        self.mem = raw.reshape(self.size, self.row)
        if self.rank == 0:
            self.mem[:, :HEADER] = 0
        comm.Barrier()
        self.base = self.mem.ctypes.data
        self._flat = {np.dtype(t): raw[: self.row * self.size].view(t) for t in DTYPES}
        self._where = (self.base, self.row, self.capacity, self.rank, self.size)  # _step's fixed arguments
        self.seq = 0
        self.oversubscribed, self.watchdog = oversubscribed, watchdog
        self.label = "one-shot all-reduce"  # the call in progress, for the watchdog (set by the caller)
        # compiled (or loaded from numba's cache) now for float32, a decode step's type, not
        # in its first small all-reduce (~0.5 s on a fresh install); other types on first use
        v = self._flat[np.dtype(np.float32)]
        if gather:  # all-gathers along the last axis (logits)
            o, offs = np.zeros((1, 1), np.float32), np.zeros(2, np.int64)
            _gather_step.compile(tuple(numba.typeof(a) for a in (v, o, v, *self._where, 0, 0, 0, offs)))
        else:
            _step.compile(tuple(numba.typeof(a) for a in (v, v, v, *self._where, 0, 0, 0, 0)))

    def allreduce(self, x: np.ndarray, out: np.ndarray, op: str = "sum") -> np.ndarray:
        """``out`` = the reduction of every rank's ``x`` (C-contiguous, the same dtype, at
        most ``capacity`` bytes; ``out`` may be ``x``)."""
        self.seq += 1
        seq, code = self.seq, _CODE[op]
        xf = x if x.ndim == 1 else x.reshape(-1)
        of = out if out.ndim == 1 else out.reshape(-1)
        flat = self._flat[x.dtype]
        phase = _step(xf, of, flat, *self._where, seq, code, 0, POLLS)
        if phase != 2:  # a longer wait: the closure is made only here, off the common path
            phase = self._spin(lambda ph, polls: _step(xf, of, flat, *self._where, seq, code, ph, polls), phase)
        if phase < 0:
            counts = self._counts_released(seq)
            raise CountMismatch(
                f"all-reduce #{seq}: ranks passed different element counts {counts} (rank {self.rank}: {xf.size})"
            )
        return out

    def allgather_columns(self, x: np.ndarray, out: np.ndarray, offs: np.ndarray) -> np.ndarray:
        """``out`` [B, offs[-1]] (C-contiguous, x's dtype) = every rank's ``x`` [B, n_rank]
        (C-contiguous, at most ``capacity`` bytes) side by side, rank q's in columns
        [offs[q], offs[q + 1])."""
        self.seq += 1
        seq = self.seq
        xf = x.reshape(-1)
        flat = self._flat[x.dtype]
        step = lambda phase, polls: _gather_step(xf, out, flat, *self._where, seq, phase, polls, offs)  # noqa: E731
        phase = step(0, POLLS)
        if phase != 2:
            phase = self._spin(step, phase)
        if phase < 0:
            counts = self._counts_released(seq)
            raise CountMismatch(
                f"all-gather #{seq}: ranks passed {counts} elements, not {out.shape[0]} rows of "
                f"{np.diff(offs).tolist()} columns"
            )
        return out

    def _counts_released(self, seq: int) -> list[int]:
        """Every rank's element count of call ``seq`` (a mismatch found); this rank's done
        stored, so that the peers may go on."""
        at = 8 * (_COUNT + (seq & 1))
        counts = [int(c) for c in self.mem[:, at : at + 8].view(np.int64)[:, 0]]
        self.mem[self.rank, 8 * _DONE : 8 * _DONE + 8].view(np.int64)[0] = seq
        return counts

    def _spin(self, step, phase: int) -> int:
        """A wait longer than the compiled polls: MPI's progress, the core, the watchdog;
        ``step(phase, polls)`` goes on with the call."""
        timeout, since, rounds = self.watchdog.timeout, time.monotonic(), 0
        while phase >= 0 and phase != 2:
            rounds += 1
            if self.oversubscribed:
                os.sched_yield()
            if rounds % 16 == 0:
                self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # MPI's progress (module docstring)
            if timeout is not None and time.monotonic() - since > timeout:
                self.watchdog.abort(self.label)
            phase = step(phase, 64 if self.oversubscribed else POLLS)
        return phase

    def free(self) -> None:
        self.win.Free()
        self.comm.Free()


def supports(dtype, op: str) -> bool:
    return np.dtype(dtype) in {np.dtype(t) for t in DTYPES} and op in OPS


def open_oneshot(comm: MPI.Comm, capacity: int, watchdog, gather: bool = False) -> OneShot | None:
    """A :class:`OneShot` when every rank of ``comm`` shares memory with the others, else
    None. Collective over ``comm``; every rank gets the same answer. Ranks that outnumber
    the cores they may run on (the union of their CPU sets) wait by yielding."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    if comm.allreduce(shared.size, op=MPI.MIN) != comm.size:
        shared.Free()
        return None
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set().union(*shared.allgather(mine))
    return OneShot(shared, capacity, shared.size > len(cores), watchdog, gather)
