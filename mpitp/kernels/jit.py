"""Compile the int8 kernels' IR (:mod:`.vector`; the two-row quantizers, :mod:`.ir.quantize`)
for this CPU with llvmlite, once per process and format, and hand them out as ctypes
functions (which release the GIL).

``portable`` is compiled for the baseline x86-64 (SSE2) where the host is x86, so that
forcing it (``MPITP_ISA=portable``) runs what a CPU without AVX2 would run; elsewhere for
the host. The engines are kept alive for the process: their code is what ctypes calls.

Compiling at -O3 takes ~0.1-0.3 s a kernel; the object code is cached on disk (as numba
caches its own), keyed by the IR, the target CPU and its features and LLVM's version, in
``$MPITP_CACHE/kernels`` (default ``~/.cache/mpitp/kernels``), written atomically; a
cache that cannot be written is skipped.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from . import cpu
from .ir import amx as amx_ir
from .ir import attend as attend_ir
from .ir import quantize as quantize_ir
from .ir import vector as int8_ir  # the vector kernels

_LOCK = threading.Lock()
_ENGINES: list = []
_FUNCS: dict[tuple, Any] = {}
PROTO = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 7, *[ctypes.c_int64] * 4)
QPROTO = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 3)
APROTO = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 8, *[ctypes.c_int64] * 3)


def address(a) -> int:
    """Where a C-contiguous, non-empty numpy array's data starts, for a ctypes call:
    ctypes' own view of its buffer (~0.4 µs) where it is writable, else ``a.ctypes.data``
    (~1.6 µs, which builds an object each time; a decode step passes ~250 pointers)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only, or empty
        return a.ctypes.data


def target(isa: str) -> tuple[str, str, str]:
    """(triple, cpu, features) the kernels of ``isa`` are compiled for on this host.

    avx2's without AVX-512 and AVX-VNNI whatever the host has: an AVX2 CPU (AMD Zen 3) has 16
    vector registers, where AVX-512's EVEX encoding gives LLVM 32 for 256-bit code too. Forced
    on an AVX-512 host (``MPITP_ISA=avx2``), the kernels had kept 16 rows' accumulators in
    registers that a Zen 3 spills (the 16-row Q6_K prefill kernel: ~140 stack operands a
    block there, ~4 here), so what the host measured was not what an AVX2 CPU runs."""
    import llvmlite.binding as llvm

    triple = llvm.get_process_triple()
    if cpu.FACTS[isa].baseline and triple.startswith("x86_64"):
        return triple, "x86-64", ""
    features = llvm.get_host_cpu_features().flatten()
    if isa == "avx2":
        features = ",".join(_without_avx512(f) for f in features.split(","))
    return triple, llvm.get_host_cpu_name(), features


def _without_avx512(feature: str) -> str:
    """A host feature, turned off where it is AVX-512's, AVX10's or AVX-VNNI's."""
    name = feature[1:]
    off = name.startswith(("avx512", "avx10", "evex512", "avxvnni", "amx"))
    return f"-{name}" if off and feature.startswith("+") else feature


def target_machine(isa: str, cpu: str | None = None, features: str | None = None):
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    triple, host_cpu, host_features = target(isa)
    if cpu is None:
        cpu, features = host_cpu, host_features
    return llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features or "", opt=3, jit=True)


def optimized(ir: str, tm):
    """The module parsed, verified and run through LLVM's -O3 pipeline."""
    import llvmlite.binding as llvm

    mod = llvm.parse_assembly(ir)
    mod.verify()
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    return mod


def assembly(specs: list[tuple], cpu: str, features: str) -> str:
    """The machine code of some kernels for any CPU, as text (to check what a CPU this
    machine lacks would run)."""
    _, ir = _module(specs)
    tm = target_machine(specs[0][1], cpu, features)
    return tm.emit_assembly(optimized(ir, tm))


def cache_dir() -> Path:
    from .. import settings

    base = settings.current().cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mpitp"
    )
    return Path(base) / "kernels"


def object_code(ir: str, isa: str, tm) -> bytes:
    """The module's machine code for ``tm`` (``isa``'s target), from the cache or compiled
    (and cached)."""
    import llvmlite.binding as llvm

    key = hashlib.sha256("\0".join([ir, *target(isa), str(llvm.llvm_version_info)]).encode()).hexdigest()
    path = cache_dir() / f"{key[:32]}.o"
    try:
        return path.read_bytes()
    except OSError:
        pass
    code = tm.emit_object(optimized(ir, tm))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(code)
        os.replace(tmp, path)
    except OSError:
        pass
    return code


def _addresses(ir: str, isa: str, names: list[str]) -> list[int]:
    """Where the functions ``names`` of module ``ir``, compiled for ``isa``, were loaded
    (the engine kept for the process). Call with _LOCK held."""
    import llvmlite.binding as llvm

    tm = target_machine(isa)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
    engine.add_object_file(llvm.ObjectFileRef.from_data(object_code(ir, isa, tm)))
    engine.finalize_object()
    _ENGINES.append(engine)
    return [engine.get_function_address(n) for n in names]


def _module(specs: list[tuple]) -> tuple[list[str], str]:
    amx = specs[0][1] == "amx"
    if any((s[1] == "amx") != amx for s in specs):
        raise ValueError("AMX kernels are compiled apart from the vector ones")
    return (amx_ir if amx else int8_ir).module(specs)


def functions(specs: list[tuple]) -> list:
    """ctypes functions of the kernels ``(fmt, isa, R, D)``, compiled on first request
    (isa ``amx``: :mod:`.ir.amx`'s, not to be asked for with others in one call)."""
    with _LOCK:
        todo = [s for s in dict.fromkeys(specs) if s not in _FUNCS]
        if todo:
            if todo[0][1] == "amx" and not cpu.amx_permitted():  # else the first tile instruction: SIGILL
                raise ValueError("AMX kernels asked for, but Linux did not grant this process AMX's tiles")
            names, ir = _module(todo)
            for spec, address in zip(todo, _addresses(ir, todo[0][1], names)):
                _FUNCS[spec] = PROTO(address)
        return [_FUNCS[s] for s in specs]


def quantizer(isa: str, name: str = quantize_ir.OUTLIERS):
    """The ctypes function of a two-row quantizer (:mod:`.ir.quantize`: int8o's, or
    int8x2's with ``TWO_DIGITS``) for ``isa``: ``f(x, xq, xd, xs, M, K, halves)``,
    pointers then integers."""
    key = ("quantizer", isa, name)
    with _LOCK:
        if key not in _FUNCS:
            name, ir = quantize_ir.module(name)
            _FUNCS[key] = QPROTO(_addresses(ir, isa, [name])[0])
        return _FUNCS[key]


def attention(D: int, G: int, isa: str, half: bool = False):
    """The ctypes function of decode attention's core (:mod:`.attend`) for head
    dimension D and G query heads a KV head (``half``: a float16 cache), compiled for
    ``isa``'s target: ``f(q, k, v, valid, out, sc, knew, vnew, S, stride, masked)``,
    pointers then integers."""
    key = ("attend", isa, D, G, half)
    with _LOCK:
        if key not in _FUNCS:
            names, ir = attend_ir.module([(D, G, half)])
            _FUNCS[key] = APROTO(_addresses(ir, isa, names)[0])
        return _FUNCS[key]
