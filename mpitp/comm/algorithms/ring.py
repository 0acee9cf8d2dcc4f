"""Hand-written ring reduce-scatter, all-gather and all-reduce.

The flat buffer of ``n`` elements is cut into ``N`` chunks whose sizes differ by at most
one (``numpy.array_split``); rank ``r`` ends the reduce-scatter owning chunk ``r``::

    N = 3, chunks c0 c1 c2        step 0                  step 1
    rank 0 sends c2, gets c1      c1 += from rank 2       c0 += from rank 2   -> owns c0
    rank 1 sends c0, gets c2      c2 += from rank 0       c1 += from rank 0   -> owns c1
    rank 2 sends c1, gets c0      c0 += from rank 1       c2 += from rank 1   -> owns c2

At step ``s`` rank ``r`` sends chunk ``(r-s-1) mod N`` to ``r+1`` and reduces chunk
``(r-s-2) mod N`` received from ``r-1``. The all-gather then circulates each owned chunk
unchanged for N-1 steps, so every rank ends with bit-identical results. All-reduce is
the two together: 2(N-1) steps, and each rank sends ``2n - |c_r| - |c_{r+1}|`` elements.

Receives are posted before the data they wait for is sent, and each chunk travels in
segments so that reducing segment k overlaps the transfer of segment k+1; a reduced
segment is forwarded at once, while still in cache (:func:`_pipeline`). The functions are generators of MPI
requests (see :mod:`mpitp.comm.handle`); they only need arrays that slice like NumPy's,
so CuPy device buffers work the same way when MPI is CUDA-aware. ``comm`` may instead be
a :class:`~mpitp.comm.transport.shm.Channel` (ranks of one node, host arrays; shared
memory or CMA): the same segments, in the same order, then go through it
(:func:`_channel_pipeline`), with the same result to the bit. Each public function picks
one of the two pipelines; :mod:`mpitp.comm.transport` picks the link.

What stays the same through one call (the element's MPI type and size, the segment
length, the tag, the byte counter and the step marker) travels as one :class:`Wire`,
built once by the collective that starts the ring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from ...split import chunk_counts, offsets
from ..handle import Steps

Reduce = Callable[[Any, Any, Any], Any]  # reduce(a, b, out)
OnSend = Callable[[int, int], None]  # on_send(nbytes, peer)
OnStep = Callable[[int], None]  # on_step(step): the step's last segment has arrived (timeline)


@dataclass(frozen=True)
class Wire:
    """How one collective call's segments travel: ``dtype`` (MPI's type of an element) and
    ``itemsize``, ``seg`` elements per message, the MPI ``tag``, ``on_send(nbytes, peer)``
    counting what leaves, and ``on_step(step)`` marking finished steps for the timeline."""

    dtype: MPI.Datatype
    itemsize: int
    seg: int
    tag: int
    on_send: OnSend
    on_step: OnStep | None = None

    def but(self, **changes) -> Wire:
        """The same wire with some fields changed (another tag, another byte counter)."""
        return dataclasses.replace(self, **changes)


def _segments(count: int, seg: int):
    for lo in range(0, count, seg):
        yield lo, min(count, lo + seg)


def recv_chunk(N: int, r: int, s: int) -> int:
    """The chunk rank ``r`` receives at step ``s`` (reduce-scatter: steps 0..N-2)."""
    return (r - s - 2) % N if s < N - 1 else (r - (s - N + 1) - 1) % N


def send_chunk(N: int, r: int, s: int) -> int:
    """The chunk rank ``r`` sends at step ``s``; ``send_chunk(s + 1) == recv_chunk(s)``."""
    return (r - s - 1) % N if s < N - 1 else (r - (s - N + 1)) % N


def _channel_pipeline(ch, src, dst, counts: list[int], reduce: Reduce | None, steps: range, wire: Wire) -> None:
    """The same steps over a shared-memory :class:`~mpitp.comm.transport.shm.Channel`: every
    segment, in the order the MPI pipeline sends and receives it, as buffer slices."""
    N, r = ch.size, ch.rank
    seg = ch.segment(wire.itemsize, wire.seg)
    right, offs = (r + 1) % N, offsets(counts)
    c0 = send_chunk(N, r, steps.start)
    first_src = src if steps.start == 0 else dst
    outgoing = [first_src[offs[c0] + lo : offs[c0] + hi] for lo, hi in _segments(counts[c0], seg)]
    first = len(outgoing)
    incoming = []
    for s in steps:
        c = recv_chunk(N, r, s)
        o = offs[c]
        for lo, hi in _segments(counts[c], seg):
            part = dst[o + lo : o + hi]
            incoming.append((part, src[o + lo : o + hi] if s < N - 1 and reduce is not None else None))
            if s + 1 < steps.stop:
                outgoing.append(part)  # forwarded once taken: send_chunk(s + 1) == c
    for part in outgoing:
        wire.on_send(part.size * wire.itemsize, right)
    ch.run(src, dst, incoming, outgoing, first, reduce)


def _pipeline(
    comm: MPI.Comm, src, dst, counts: list[int], reduce: Reduce | None, tmp, steps: range, wire: Wire
) -> Steps:
    """Steps ``steps`` of the 2(N-1)-step ring, pipelined segment by segment.

    Steps 0..N-2 are the reduce-scatter, N-1..2N-3 the all-gather. Each segment is
    forwarded to the right neighbour as soon as it has been reduced (or has arrived), while
    it is still in cache, so there is no barrier between steps or between the two phases'
    data. Receives are posted in the order the left neighbour sends (MPI matches one
    (source, tag) pair in posting order); at most ``depth`` are in flight, reduce-scatter
    segments landing in ``tmp`` slots that are reused and stay cache-resident. An
    all-gather receive into a segment is posted only after every pending send that reads
    that same segment has completed. (Waiting per chunk instead would deadlock: each rank
    would wait for its forward of segment 0 while the neighbour waits for its own before
    posting the receive for it.)
    """
    N, r = comm.size, comm.rank
    dtype, seg, tag = wire.dtype, wire.seg, wire.tag
    right, left = (r + 1) % N, (r - 1) % N
    offs = offsets(counts)
    rs = N - 1

    def rchunk(s):
        return recv_chunk(N, r, s)

    def schunk(s):
        return send_chunk(N, r, s)

    incoming = [(s, lo, hi) for s in steps for lo, hi in _segments(counts[rchunk(s)], seg)]
    first_ag = next((j for j, (s, _, _) in enumerate(incoming) if s >= rs), len(incoming))
    depth = max(1, tmp.size // seg) if tmp is not None else 1
    sends_of: dict[tuple[int, int], list] = {}  # (chunk, segment start) -> sends reading it
    all_sends: list = []

    def send(s, lo, hi, buf):
        c = schunk(s)
        o = offs[c]
        req = comm.Isend([buf[o + lo : o + hi], dtype], dest=right, tag=tag)
        wire.on_send((hi - lo) * wire.itemsize, right)
        sends_of.setdefault((c, lo), []).append(req)
        all_sends.append(req)

    first = steps.start
    for lo, hi in _segments(counts[schunk(first)], seg):
        send(first, lo, hi, src if first == 0 else dst)

    reqs: list = []
    for j, (s, lo, hi) in enumerate(incoming):
        while len(reqs) < len(incoming) and len(reqs) < j + depth and (len(reqs) < first_ag or j >= first_ag):
            ps, plo, phi = incoming[len(reqs)]
            c = rchunk(ps)
            if ps < rs:
                k = (len(reqs) % depth) * seg
                buf = tmp[k : k + phi - plo]
            else:
                if (c, plo) in sends_of:
                    yield sends_of.pop((c, plo))  # this segment is still being sent from
                buf = dst[offs[c] + plo : offs[c] + phi]
            reqs.append(comm.Irecv([buf, dtype], source=left, tag=tag))
        yield reqs[j]
        c = rchunk(s)
        o = offs[c]
        if s < rs:
            k = (j % depth) * seg
            # reduce-scatter steps (s < rs) always come with a reduce
            reduce(src[o + lo : o + hi], tmp[k : k + hi - lo], dst[o + lo : o + hi])  # type: ignore[misc]
        if s + 1 < steps.stop:
            send(s + 1, lo, hi, dst)  # schunk(s + 1) == c
        if wire.on_step is not None and (j + 1 == len(incoming) or incoming[j + 1][0] != s):
            wire.on_step(s)
    yield all_sends


def _over(link, src, dst, counts: list[int], reduce: Reduce | None, tmp, steps: range, wire: Wire) -> Steps:
    """Steps ``steps`` of the ring over ``link``: MPI point-to-point (an ``MPI.Comm``), or
    a shared-memory / CMA channel of one node (:mod:`mpitp.comm.transport`), which moves
    the same segments in the same order without MPI requests."""
    if isinstance(link, MPI.Comm):
        yield from _pipeline(link, src, dst, counts, reduce, tmp, steps, wire)
    else:
        _channel_pipeline(link, src, dst, counts, reduce, steps, wire)


def reduce_scatter(link, src, dst, counts: list[int], reduce: Reduce, tmp, wire: Wire) -> Steps:
    """Ring reduce-scatter of flat ``src`` into flat ``dst`` (may be the same buffer).

    Afterwards ``dst[chunk rank]`` holds the reduction over all ranks; the other chunks of
    ``dst`` hold partial sums. ``tmp`` holds a few receive slots of ``seg`` elements (or
    the largest chunk, when that is smaller).
    """
    if link.size == 1:
        if dst is not src:
            dst[:] = src
        return dst
    yield from _over(link, src, dst, counts, reduce, tmp, range(0, link.size - 1), wire)
    return dst


def all_gather(link, buf, counts: list[int], wire: Wire) -> Steps:
    """Ring all-gather, in place: on entry ``buf[chunk rank]`` is this rank's piece.

    Chunks travel in segments: one huge message is several times slower than the same
    bytes in cache-sized pieces on shared-memory transports."""
    N = link.size
    if N > 1:
        yield from _over(link, buf, buf, counts, None, None, range(N - 1, 2 * N - 2), wire)
    return buf


def all_reduce(link, src, dst, reduce: Reduce, tmp, wire: Wire) -> Steps:
    """Ring all-reduce of flat ``src`` into flat ``dst`` (``dst is src`` for in place).
    ``wire.on_step(s)`` (MPI transport) follows its 2(N-1) steps, for the timeline."""
    N = link.size
    counts = chunk_counts(dst.size, N)
    if N == 1:
        if dst is not src:
            dst[:] = src
        return dst
    yield from _over(link, src, dst, counts, reduce, tmp, range(0, 2 * N - 2), wire)
    return dst
