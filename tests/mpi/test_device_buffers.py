"""The device-array path, exercised on CPU the way mpi4py's own test suite does it: a
small array type whose memory is host memory but which presents itself only through
``__cuda_array_interface__`` (no NumPy buffer protocol).

This checks mpitp's *buffer handling* for device arrays — stream synchronisation calls,
handing the CAI object straight to MPI when MPI is CUDA-aware (MPITP_CUDA_AWARE=1), host
staging otherwise (=0), allocation of results on the device, in-place forms. It does
not check CuPy's own arithmetic or a real GPU; those need a CUDA machine.
"""

import numpy as np
import pytest
from helpers import agree
from mpi4py import MPI

import mpitp
from mpitp import backend

N = MPI.COMM_WORLD.size


class HostCudaArray:
    """Host memory exposed via __cuda_array_interface__ v3 only. Counts the stream
    synchronisations and the copies to and from the host, so a test can tell which path ran."""

    syncs = 0
    to_host = 0
    from_host = 0

    def __init__(self, a: np.ndarray):
        self._a = a

    @property
    def __cuda_array_interface__(self):
        a = self._a
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "version": 3,
            "stream": None,
            "data": (a.ctypes.data if a.size else 0, False),
            "strides": None if a.flags.c_contiguous else a.strides,
        }

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)
    flags = property(lambda self: self._a.flags)

    def reshape(self, *shape):
        return HostCudaArray(self._a.reshape(*shape))

    def copy(self, order="C"):
        return HostCudaArray(self._a.copy(order=order))

    def __getitem__(self, idx):
        return HostCudaArray(self._a[idx])

    def __setitem__(self, idx, value):
        self._a[idx] = value._a if isinstance(value, HostCudaArray) else value

    def get(self):
        return self._a.copy()


class _XP:
    """The namespace ring reductions use on this 'device'."""

    @staticmethod
    def _wrap(fn):
        return lambda a, b, out: fn(a._a, b._a, out=out._a)

    add, multiply = _wrap.__func__(np.add), _wrap.__func__(np.multiply)
    maximum, minimum = _wrap.__func__(np.maximum), _wrap.__func__(np.minimum)


def _sync(a):
    HostCudaArray.syncs += 1


def _to_host(a):
    HostCudaArray.to_host += 1
    return a._a.copy()


def _from_host(dst, host):
    HostCudaArray.from_host += 1
    dst[...] = host


backend.register_device_type(
    HostCudaArray,
    backend.DeviceOps(
        xp=_XP,
        empty=lambda shape, dtype: HostCudaArray(np.empty(shape, dtype)),
        to_host=_to_host,
        from_host=_from_host,
        synchronize=_sync,
        ascontiguous=lambda a: a if a.flags.c_contiguous else a.copy(),
    ),
)


@pytest.fixture(params=["0", "1"], ids=["staged", "cuda-aware"])
def dcomm(request, monkeypatch):
    monkeypatch.setenv("MPITP_CUDA_AWARE", request.param)
    c = mpitp.Communicator()
    c.staged = request.param == "0"  # what the test expects of the path
    yield c
    c.free()


class took_the_path:
    """``with took_the_path(comm, what):`` the collectives inside copied device data to the
    host (staged) — or, CUDA-aware, handed the device buffers to MPI with no host copy."""

    def __init__(self, comm, what):
        self.staged, self.what = comm.staged, what

    def __enter__(self):
        self.before = HostCudaArray.to_host, HostCudaArray.from_host

    def __exit__(self, *exc):
        if exc[0] is not None:
            return
        copies = HostCudaArray.to_host - self.before[0], HostCudaArray.from_host - self.before[1]
        if self.staged:
            agree(copies[0] > 0 and copies[1] > 0, f"{self.what}: staged, yet copies to/from host were {copies}")
        else:
            agree(copies == (0, 0), f"{self.what}: CUDA-aware, yet copies to/from host were {copies}")


def host(a):
    return a._a


def test_mpi_reads_the_interface():
    """mpi4py itself takes CAI objects as buffers (the CUDA-aware path's premise)."""
    x = HostCudaArray(np.arange(6, dtype=np.float64) * (MPI.COMM_WORLD.rank + 1))
    y = HostCudaArray(np.empty(6))
    MPI.COMM_WORLD.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE])
    agree(np.array_equal(host(y), np.arange(6) * N * (N + 1) / 2), "MPI Allreduce on CAI buffers")


@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_allreduce_on_device_arrays(dcomm, algorithm):
    before = HostCudaArray.syncs
    x = HostCudaArray(np.full((3, 5), dcomm.rank + 1.0, np.float32))
    with took_the_path(dcomm, "allreduce"):
        y = dcomm.allreduce(x, algorithm=algorithm)
    agree(isinstance(y, HostCudaArray), f"result is {type(y).__name__}, not a device array")
    agree(np.all(host(y) == N * (N + 1) / 2) and y.shape == (3, 5), "allreduce values")
    agree(HostCudaArray.syncs > before, "stream not synchronised before MPI")
    z = HostCudaArray(np.full(7, 2, np.int64))
    with took_the_path(dcomm, "in-place allreduce"):
        r = dcomm.allreduce(z, op="prod", out=z, algorithm=algorithm)
    agree(r is z and np.all(host(z) == 2**N), "in-place allreduce on device")


def test_other_collectives_on_device_arrays(dcomm):
    r = dcomm.rank
    rows = [np.arange(2 * N, dtype=np.int32) + 100 * q for q in range(N)]  # rank q's input, known to all
    x = HostCudaArray(rows[r].copy())
    with took_the_path(dcomm, "allgather"):
        ag = dcomm.allgather(x)
    agree(isinstance(ag, HostCudaArray) and np.array_equal(host(ag), np.concatenate(rows)), "allgather")
    with took_the_path(dcomm, "reduce_scatter"):
        rs = dcomm.reduce_scatter(x)
    want = np.array_split(sum(rows), N)[r]
    agree(isinstance(rs, HostCudaArray) and np.array_equal(host(rs), want), "reduce_scatter")
    b = HostCudaArray(np.arange(4.0) if r == 0 else np.zeros(4))
    with took_the_path(dcomm, "broadcast"):
        dcomm.broadcast(b, root=0)
    agree(np.array_equal(host(b), np.arange(4.0)), "broadcast into a device buffer")
    g = dcomm.gather(x, root=0)
    agree(
        r != 0 or (isinstance(g, HostCudaArray) and np.array_equal(host(g), np.concatenate(rows))),
        "gather: rank 0 holds every rank's rows in rank order",
    )
    red = dcomm.reduce(x, root=0)
    agree(r != 0 or np.array_equal(host(red), sum(rows)), "reduce")
    with took_the_path(dcomm, "alltoall"):
        a2a = dcomm.alltoall(x)
    # block j of rank q's input goes to rank j; rank r receives block r of every rank, in rank order
    want = np.concatenate([np.array_split(rows[q], N)[r] for q in range(N)])
    agree(isinstance(a2a, HostCudaArray) and np.array_equal(host(a2a), want), "alltoall: block r of every rank")
    sc = dcomm.scatter(HostCudaArray(np.arange(N * 3.0)) if r == 0 else None, root=0)
    agree(np.array_equal(host(sc) if isinstance(sc, HostCudaArray) else sc, np.arange(3.0) + 3 * r), "scatter")
