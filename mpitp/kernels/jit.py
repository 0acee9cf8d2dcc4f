"""Compile the int8 kernels' IR (:mod:`.int8_ir`) for this CPU with llvmlite, once per
process and format, and hand them out as ctypes functions (which release the GIL).

``portable`` is compiled for the baseline x86-64 (SSE2) where the host is x86, so that
forcing it (``MPITP_ISA=portable``) runs what a CPU without AVX2 would run; elsewhere for
the host. The engines are kept alive for the process: their code is what ctypes calls.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from . import int8_ir

_LOCK = threading.Lock()
_ENGINES: list = []
_FUNCS: dict[tuple, Any] = {}
PROTO = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 7, *[ctypes.c_int64] * 4)


def target_machine(isa: str, cpu: str | None = None, features: str | None = None):
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    triple = llvm.get_process_triple()
    if cpu is None:
        if isa == "portable" and triple.startswith("x86_64"):
            cpu, features = "x86-64", ""
        else:
            cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    target = llvm.Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=features or "", opt=3, jit=True)


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
    _, ir = int8_ir.module(specs)
    tm = target_machine(specs[0][1], cpu, features)
    return tm.emit_assembly(optimized(ir, tm))


def functions(specs: list[tuple]) -> list:
    """ctypes functions of the kernels ``(fmt, isa, R, C)``, compiled on first request."""
    with _LOCK:
        todo = [s for s in dict.fromkeys(specs) if s not in _FUNCS]
        if todo:
            import llvmlite.binding as llvm

            names, ir = int8_ir.module(todo)
            tm = target_machine(todo[0][1])
            engine = llvm.create_mcjit_compiler(optimized(ir, tm), tm)
            engine.finalize_object()
            _ENGINES.append(engine)
            for spec, name in zip(todo, names):
                _FUNCS[spec] = PROTO(engine.get_function_address(name))
        return [_FUNCS[s] for s in specs]
