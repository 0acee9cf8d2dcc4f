"""Which integer dot-product instructions this CPU has, decided once per process.

The int8 kernels (:mod:`.int8`) come in five instruction sets, as ggml's CPU backend::

    amx       avx512's kernels up to 4 rows of x; from 8 rows (batches, prefill) Intel's
              tile matrix unit (AMX-INT8: :mod:`.ir.amx`)
    avx512    vnni's instruction on 512-bit vectors, 16 output rows at once (AVX512-VNNI
              with AVX512-BW)
    vnni      vpdpbusd: 32 u8×s8 products summed in fours into 8 int32 lanes, one
              instruction (AVX512-VNNI with AVX512-VL, or AVX-VNNI)
    avx2      vpmaddubsw (u8×s8 pairs -> int16) + vpmaddwd (pairs -> int32): two
    portable  the same sums in plain LLVM vector arithmetic, for any CPU LLVM targets

``MPITP_ISA`` (amx, avx512, vnni, avx2, portable) forces one; asking for instructions the CPU lacks is
an error, not a crash. The features are LLVM's view of the host (what the JIT may use).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ISAS = ("amx", "avx512", "vnni", "avx2", "portable")


@dataclass(frozen=True)
class Facts:
    """What the kernels of one instruction set are, read by everything that picks one
    (:mod:`.int8`, :mod:`.jit`, :mod:`.decode`, :mod:`.ir.blocks`)."""

    vector: str  # the vector kernels it decodes with (amx decodes with avx512's)
    narrow: str  # those for fewer than WIDE_ROWS rows of x (avx512: vnni's 8 lanes, one weight stream)
    prefill_rows: int  # rows of x a prefill kernel call takes (avx512, avx2: 8; 16 rows spill)
    tiles_from: int | None  # rows of x from which AMX's tile kernels take a call (decode too)
    baseline: bool  # compiled for the baseline x86-64 (SSE2), not for the host CPU
    f16c: bool  # float16 widened by vcvtph2ps (else integer moves); a float16 KV cache's core
    # prefill's two digits against K-quants: x a scale per super-block of 256, each block's
    # sums scaled by the weights' integer sub-block scales in avx2's vpmaddwd (which multiplies
    # by 1 otherwise) and added as integers, one conversion a super-block (int8.whole); VNNI's
    # sums come out in int32 with no free multiply to fold a scale into
    whole_k: bool = False


WIDE_ROWS = 4  # avx512's 16 lanes from this many rows of x (1 row: 25 GB/s with 8 lanes, 20 with 16, Zen 4)
FACTS = {
    "amx": Facts("avx512", "vnni", 16, 8, False, True),
    "avx512": Facts("avx512", "vnni", 8, None, False, True),
    "vnni": Facts("vnni", "vnni", 16, None, False, True),
    "avx2": Facts("avx2", "avx2", 8, None, False, True, True),  # 16 rows' accumulators spill its 16 registers
    "portable": Facts("portable", "portable", 16, None, True, False),
}
# Linux's arch_prctl: ask for the AMX tile data state (XFEATURE_XTILEDATA), which a process
# does not have until it asks (its 8 KB of registers saved on every context switch)
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


@lru_cache(maxsize=1)
def host() -> tuple[str, frozenset[str]]:
    """(LLVM's name for this CPU, its enabled features)."""
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    return llvm.get_host_cpu_name(), frozenset(k for k, on in feats.items() if on)


def supported(features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The instruction sets this CPU can run, best first."""
    f = host()[1] if features is None else features
    out = []
    if "avx2" in f and {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= f:
        if {"amx-tile", "amx-int8"} <= f and (features is not None or amx_permitted()):
            out.append("amx")
        out.append("avx512")
    if "avx2" in f and ("avxvnni" in f or {"avx512vnni", "avx512vl"} <= f):
        out.append("vnni")
    if "avx2" in f:
        out.append("avx2")
    out.append("portable")
    return tuple(out)


@lru_cache(maxsize=1)
def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX's tiles (asked once; without it the first
    tile instruction would kill the process with SIGILL)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        return ctypes.CDLL(None).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _env(environ):
    from .. import settings

    return settings.current() if environ is None else settings.Settings.from_env(environ)


def isa(environ=None) -> str:
    """The instruction set the kernels use: ``MPITP_ISA`` if set, else the best there is
    (``environ``: a mapping to read instead of the process's environment)."""
    want = (_env(environ).isa or "").lower()
    have = supported()
    if not want:
        return have[0]
    if want not in ISAS:
        raise ValueError(f"MPITP_ISA={want!r}: choose one of {', '.join(ISAS)}")
    if want not in have:
        raise ValueError(f"MPITP_ISA={want}: this CPU ({host()[0]}) has only {', '.join(have)}")
    return want


ACTIVATIONS = ("auto", "int8", "int8o", "int8x2", "float32")
# each int8 mode's rows of x per value, and whether the second is x's outliers (int8o)
SCHEMES = {"int8": (1, False), "int8o": (2, True), "int8x2": (2, False)}


@dataclass(frozen=True)
class Activations:
    """``--activations`` parsed once (:func:`activations`), the value that travels from the
    command line through the loader and the model to the kernels' preparation unchanged:
    its name, and for the int8 schemes the digits of x per value and whether the second
    digit holds x's outliers (int8o). ``str()`` gives the name."""

    name: str

    @property
    def int8(self) -> bool:
        return self.name in SCHEMES

    @property
    def digits(self) -> int:
        return SCHEMES[self.name][0] if self.int8 else 0

    @property
    def outliers(self) -> bool:
        return self.int8 and SCHEMES[self.name][1]

    def __str__(self) -> str:
        return self.name


def activations(choice: str | None = None, environ=None) -> Activations:
    """How block weights' matmul inputs are held: ``int8`` (one int8 digit per value, as
    ggml quantizes them), ``int8o`` (one digit, and in each block of 32 the values above 4×
    the root mean square of the block's other values kept apart in a second row, as
    LLM.int8() splits outliers off: they no longer coarsen their block's scale, and the
    kernels multiply that row only in the blocks where it is not zero; prefill, past 16 rows a
    call, multiplies two digits: :mod:`.int8`), ``int8x2`` (two
    digits, ~15 bits: a second full row of x each) or ``float32`` (the exact reference
    path). ``auto`` (the default, or ``MPITP_ACTIVATIONS``) is int8o where the CPU has
    integer dot products (amx, avx512, vnni, avx2) and float32 elsewhere. On the default model
    one digit moves the logits by a mean KL of ~3e-3 and answers README's question
    differently; int8o by ~6e-4 at about one digit's speed; two digits by ~5e-8 at up to
    twice the multiply-adds (docs/measurements.md)."""
    choice = (choice or _env(environ).activations or "auto").strip().lower()
    if choice not in ACTIVATIONS:
        raise ValueError(f"activations {choice!r}: one of {', '.join(ACTIVATIONS)}")
    if choice == "auto":
        choice = "int8o" if isa(environ) != "portable" else "float32"
    return Activations(choice)
