"""A loaded model's block weights made ready for its kernels, once, at load: repacked into
the int8 kernels' tiles for the activations chosen (:mod:`.tiles`; a tied head's weight
once, shared), the K-quants' integer scales dropped where no tile reads them, and every
kernel those weights will meet compiled or loaded from the cache (not inside the first
forward). ``mods``: the model's modules that hold a ``qweight``, in reading order."""

from __future__ import annotations

from . import int8
from .cpu import Activations
from .planar import warm as warm_planar
from .weights.formats import Pieces, leaves
from .weights.tiles import repack


def tile(mods: list, activations: Activations) -> None:
    """q4/q8 weights into tiles where ``activations`` is an int8 scheme; K-quant scales dropped."""
    if activations.int8:
        digits, outliers = activations.digits, activations.outliers

        def tiled(w):  # planar q4/q8 blocks into tiles; tiles (a module tiled as it loaded) stay
            return repack(w, digits, outliers) if w.layout == "planar" and w.kind in ("q4", "q8") else w

        done: dict[int, object] = {}
        for m in mods:
            w = m.qweight
            if id(w) not in done:
                done[id(w)] = Pieces([tiled(p) for p in w.parts]) if w.layout == "pieces" else tiled(w)
            m.qweight = done[id(w)]
    for w in (w for m in mods for w in leaves(m.qweight)):  # the K-quants' integer scales serve the tiles only
        if getattr(w, "ks", None) is not None:
            w.ks = None


def warm(mods: list, activations: Activations) -> None:
    """Compile (or load) the kernels of every layout these weights are held in."""
    if not mods:
        return
    held = [w for m in mods for w in leaves(m.qweight)]
    for kind in sorted({w.kind for w in held if w.layout == "planar"}):
        warm_planar(kind)
    if activations.int8:
        for kind, group in sorted({(w.fmt, w.group) for w in held if w.layout == "tiles"}):
            int8.warm(kind, activations.digits, group, activations.outliers)
