"""One allocation for the weights a forward pass streams, in the order it reads them.

Decoding one token reads every weight once (GEMV), so it is bound by memory bandwidth.
Separate small arrays (a 512x512 fp32 shard is 1 MiB) each start cold in the TLB and
the hardware prefetcher; one big buffer on transparent huge pages reads as one long stream:

    arena: | L0.qkv | L0.o | L0.gate_up | L0.down | L1.qkv | ... | lm_head |
            ^ each a view; the layer's ``_wt`` (and ``weight`` = ``_wt.T``) point here

Pack before loading: the layers' own zero-filled arrays are untouched calloc pages, so
packing costs no extra memory, and the loader then writes straight into the arena.
"""

from __future__ import annotations

import mmap

import numpy as np

ALIGN = 64  # bytes: every view starts on a cache line
HUGE = 2 << 20  # bytes of a transparent huge page (x86-64, and arm64 with 4 KiB pages)


def host_buffer(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer of ``nbytes``, cache-line aligned, on transparent huge pages
    where the kernel gives them: its own anonymous mapping, 2 MiB aligned, advised
    (MADV_HUGEPAGE) before the first write. NumPy advises its allocations of 4 MiB and more too, but malloc may place
    them in the heap, where the advice does not take: the default model's 45-51 MB arenas at
    TP=2 came back on 4 KiB pages (read at 13.5-14.7 GB/s a rank where the same bytes on
    2 MiB pages read at 16.5). Freed with the array."""
    if nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = np.zeros(nbytes + ALIGN, np.uint8)
        skip = -raw.ctypes.data % ALIGN
        return raw[skip : skip + nbytes]
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, np.uint8)  # holds the mapping while any view of it lives
    skip = -whole.ctypes.data % HUGE
    region.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
    return whole[skip : skip + nbytes]


def pack(modules, xp=np) -> object:
    """Move ``_wt`` of each module (in order; a module listed twice is packed once) into
    one buffer and return it. Values are kept, so packing after loading is also correct."""
    seen, mods = set(), []
    for m in modules:
        if id(m._wt) not in seen:
            seen.add(id(m._wt))
            mods.append(m)
    if not mods:
        return None
    dtype = mods[0]._wt.dtype
    if any(m._wt.dtype != dtype for m in mods):
        raise ValueError("pack: all weights must share one dtype")
    step = max(ALIGN // dtype.itemsize, 1)
    offsets, off = [], 0
    for m in mods:
        offsets.append(off)
        off += -(-m._wt.size // step) * step
    arena = host_buffer(off * dtype.itemsize).view(dtype) if xp is np else xp.zeros(off, dtype)
    shared = {}
    for m, o in zip(mods, offsets):
        old = m._wt
        view = arena[o : o + old.size].reshape(old.shape)
        view[...] = old
        shared[id(old)] = (old, view)  # old kept alive while ids are compared
    for m in modules:
        old_view = shared.get(id(m._wt))
        view = old_view[1] if old_view is not None else m._wt
        m._wt, m.weight = view, view.T
    return arena


def pack_blocks(modules) -> np.ndarray | None:
    """The same for block weights (``qweight``: quants, scales, minimums), after loading:
    one buffer, each array a cache-line aligned view, in the order given."""
    seen, mods = set(), []
    for m in modules:
        w = getattr(m, "qweight", None)
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            mods.append(m)
    from ..kernels.weights.formats import leaves

    held = [w for m in mods for w in leaves(m.qweight)]  # a merged weight's pieces each
    fields = [(w, f) for w in held for f in ("qs", "d", "m") if getattr(w, f) is not None]
    if not fields:
        return None
    step = lambda n: -(-n // ALIGN) * ALIGN
    total = sum(step(getattr(w, f).nbytes) for w, f in fields)
    raw = host_buffer(total)
    off = 0
    for w, f in fields:
        old = getattr(w, f)
        view = raw[off : off + old.nbytes].view(old.dtype).reshape(old.shape)
        view[...] = old
        setattr(w, f, view)
        off += step(old.nbytes)
    for w in held:  # kernels bound to the old arrays
        getattr(w, "bound", {}).clear()
    return raw
