"""Array backend: NumPy on the host, CuPy (or another device array type) on a GPU.

The communication layer never imports CuPy itself; it asks this module:

* ``is_device(a)``       — does ``a`` live in device memory (``__cuda_array_interface__``)?
* ``device_ops(a)``      — the adapter for that array type (allocate, copy to/from host,
                           synchronize, the array namespace used for reductions);
* ``cuda_aware_mpi()``   — may device pointers be handed straight to MPI?

Device arrays reach MPI in one of two ways:

    CUDA-aware MPI:   stream.synchronize() ; MPI reads/writes the device buffer directly
    otherwise:        stream.synchronize() ; copy to host ; MPI on host ; copy back

CuPy is registered automatically when it imports. Other array types (tests use a
host-memory array that exposes ``__cuda_array_interface__``, as mpi4py's own test
suite does) register an adapter with :func:`register_device_type`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # optional extra: pip install mpitp[cuda12]
    import cupy
except Exception:  # ImportError, or a CUDA runtime that fails to load
    cupy = None


@dataclass(frozen=True)
class DeviceOps:
    """What the communicator needs to know about one device array type."""

    xp: Any  # namespace with add/multiply/maximum/... ufuncs
    empty: Callable[[tuple, np.dtype], Any]  # allocate on the device
    to_host: Callable[[Any], np.ndarray]  # device -> new host array
    from_host: Callable[[Any, np.ndarray], None]  # host -> existing device array
    synchronize: Callable[[Any], None]  # make prior device work on the array visible
    ascontiguous: Callable[[Any], Any]  # C-contiguous (copy only if needed)


_registry: dict[type, DeviceOps] = {}


def register_device_type(cls: type, ops: DeviceOps) -> None:
    """Teach mpitp how to handle device arrays of type ``cls``."""
    _registry[cls] = ops


if cupy is not None:
    register_device_type(
        cupy.ndarray,
        DeviceOps(
            xp=cupy,
            empty=lambda shape, dtype: cupy.empty(shape, dtype),
            to_host=lambda a: cupy.asnumpy(a),
            from_host=lambda dst, host: dst.set(host),
            synchronize=lambda a: cupy.cuda.get_current_stream().synchronize(),
            ascontiguous=lambda a: a if a.flags.c_contiguous else a.copy(order="C"),
        ),
    )


def device_for_rank(environ, device_count: int) -> int | None:
    """The GPU a rank should use: its local rank modulo the GPUs it sees, unless
    ``CUDA_VISIBLE_DEVICES`` already narrows it to one (the scheduler's or launcher's
    choice, e.g. ``srun --gpus-per-task=1``), or no launcher says its local rank."""
    from .threads import local_rank

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) <= 1:
        return None
    lr = local_rank(environ)
    if lr is None or device_count <= 1:
        return None
    return lr % device_count


def select_gpu(environ=os.environ) -> int | None:
    """Make this rank's GPU CuPy's current device (see :func:`device_for_rank`)."""
    if cupy is None:
        return None
    try:
        idx = device_for_rank(environ, cupy.cuda.runtime.getDeviceCount())
        if idx is not None:
            cupy.cuda.Device(idx).use()
        return idx
    except Exception:  # no driver, no device: CuPy reports it when first used
        return None


def is_device(a: Any) -> bool:
    return not isinstance(a, np.ndarray) and hasattr(a, "__cuda_array_interface__")


def device_ops(a: Any) -> DeviceOps:
    for cls in type(a).__mro__:
        if cls in _registry:
            return _registry[cls]
    raise TypeError(
        f"{type(a).__name__} exposes __cuda_array_interface__ but mpitp has no adapter "
        "for it (CuPy is supported; register others with mpitp.backend.register_device_type)"
    )


def xp_of(a: Any):
    """The array namespace (numpy or cupy) that owns ``a``."""
    return device_ops(a).xp if is_device(a) else np


def cuda_aware_mpi() -> bool:
    """Whether device buffers may be passed straight to MPI.

    ``MPITP_CUDA_AWARE=0/1`` overrides. Otherwise ask MPI: mpi4py >= 4 exposes
    ``MPI.Query_cuda_support()`` where the library implements ``MPIX_Query_cuda_support``
    (Open MPI, MPICH >= 4). An MPI that cannot say is treated as not CUDA-aware, which is
    always safe (host staging).
    """
    from . import settings

    env = settings.current().cuda_aware
    if env is not None:
        return env
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except Exception:
        return False


def as_contiguous(a: Any) -> Any:
    """C-contiguous version of ``a``; copies non-contiguous inputs instead of rejecting them."""
    if is_device(a):
        return device_ops(a).ascontiguous(a)
    return a if a.flags.c_contiguous else a.copy(order="C")  # keeps 0-d arrays 0-d


def empty(shape: tuple, dtype: np.dtype, like: Any) -> Any:
    """A new uninitialised array on the same device as ``like``."""
    if is_device(like):
        return device_ops(like).empty(tuple(shape), np.dtype(dtype))
    return np.empty(shape, dtype)


def to_host(a: Any) -> np.ndarray:
    """``a`` as a host (NumPy) array: a device array copied, a host one as it is."""
    return device_ops(a).to_host(a) if is_device(a) else np.asarray(a)


def synchronize(a: Any) -> None:
    if is_device(a):
        device_ops(a).synchronize(a)


def versions() -> dict[str, str | None]:
    """Versions of the array libraries, for ``mpitp info``."""
    out: dict[str, str | None] = {"numpy": np.__version__, "cupy": None}
    if cupy is not None:
        out["cupy"] = cupy.__version__
    return out


select_gpu()  # at import: before any device memory is allocated through mpitp
