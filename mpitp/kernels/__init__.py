"""The compiled kernels. Importing the package points numba's on-disk cache at a folder
named by a digest of these modules' sources (:func:`numba_cache_dir`), unless
``NUMBA_CACHE_DIR`` is set.

numba checks a cached function against its own file only: the fused decode halves
(``fused.py``) compiled with ``decode.py``'s swiglu and attention, and ``matmul.py``'s
drivers, would keep the old code of a callee edited in another file (numba documents
this). A folder per digest of every module here makes any edit a fresh cache.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def numba_cache_dir(sources: Path = Path(__file__).parent) -> Path:
    """``~/.cache/mpitp/numba/<digest of the *.py files under sources>`` (``XDG_CACHE_HOME``
    respected; not ``MPITP_CACHE``, which tests point at fresh folders, where every
    process would compile the kernels again)."""
    h = hashlib.sha256()
    for p in sorted(sources.rglob("*.py")):  # the subpackages' too (weights/, ir/)
        h.update(str(p.relative_to(sources)).encode() + b"\0" + p.read_bytes() + b"\0")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpitp" / "numba" / h.hexdigest()[:16]


def _use_numba_cache() -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    import numba

    path = numba_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home: numba's own place, beside the sources
        return
    numba.config.CACHE_DIR = str(path)


_use_numba_cache()
