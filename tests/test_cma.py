"""The CMA reader on its own (one process reading itself): what it copies, and the
errors it raises for memory that is not there or a process that does not exist."""

import os

import numpy as np
import pytest

from mpitp.comm.transport import cma


def _permitted() -> bool:
    a, b = np.arange(4.0), np.zeros(4)
    try:
        cma.Reader().read(os.getpid(), b.ctypes.data, a.ctypes.data, a.nbytes)
    except OSError:
        return False
    return bool(np.array_equal(a, b))


needs_cma = pytest.mark.skipif(not _permitted(), reason="process_vm_readv not permitted here (seccomp, Yama)")


@needs_cma
def test_reads_this_process():
    src = np.arange(300_001, dtype=np.float64)
    dst = np.zeros_like(src)
    cma.Reader().read(os.getpid(), dst.ctypes.data, src.ctypes.data, src.nbytes)
    assert np.array_equal(dst, src)


@needs_cma
def test_unmapped_address_is_an_error():
    dst = np.zeros(16, np.uint8)
    with pytest.raises(OSError, match="process_vm_readv from process"):
        cma.Reader().read(os.getpid(), dst.ctypes.data, 8, 16)  # page 0 is never mapped


@needs_cma
def test_missing_process_is_an_error():
    dst = np.zeros(16, np.uint8)
    with pytest.raises(OSError, match="No such process"):
        cma.Reader().read(2**22 + 12345, dst.ctypes.data, dst.ctypes.data, 16)


def test_switches(monkeypatch):
    monkeypatch.setenv("MPITP_CMA", "0")
    assert not cma.enabled()
    monkeypatch.setenv("MPITP_CMA", "1")
    assert cma.enabled()
    monkeypatch.setenv("MPITP_CMA_SEGMENT", "4096")
    assert cma.segment_bytes() == 4096
    monkeypatch.delenv("MPITP_CMA_SEGMENT")
    assert cma.segment_bytes() == 2 << 20
