"""Every ``MPITP_*`` environment variable, read in one place and checked once.

``settings.current()`` gives a frozen :class:`Settings` for the environment as it is now
(re-read only when an ``MPITP_*`` variable changed). Booleans accept 1/0, true/false,
yes/no, on/off in any case; an empty variable means the default; anything else raises
:class:`SettingsError` naming the variable. Sizes use :mod:`mpitp.units`. The README's
table of variables is checked against :data:`VARIABLES` by the tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from .errors import MpitpError
from .units import parse_size

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(MpitpError, ValueError):
    """An MPITP_* variable has a value mpitp cannot use."""


@dataclass(frozen=True)
class Settings:
    validate: bool = False  # MPITP_VALIDATE
    timeout: float | None = None  # MPITP_TIMEOUT (seconds)
    abort_on_error: bool = True  # MPITP_ABORT_ON_ERROR
    ranks_per_node: int | None = None  # MPITP_RANKS_PER_NODE
    ring_segment: int = 512 << 10  # MPITP_RING_SEGMENT
    ring_depth: int = 4  # MPITP_RING_DEPTH
    shm: bool = True  # MPITP_SHM
    shm_max: int = 2 << 20  # MPITP_SHM_MAX
    oneshot_max: int = 64 << 10  # MPITP_ONESHOT_MAX (0: off)
    cma: bool = True  # MPITP_CMA
    cma_segment: int = 2 << 20  # MPITP_CMA_SEGMENT
    cuda_aware: bool | None = None  # MPITP_CUDA_AWARE (None: ask MPI)
    tuning: str | None = None  # MPITP_TUNING
    cache: str | None = None  # MPITP_CACHE
    log_level: str | None = None  # MPITP_LOG_LEVEL
    log_dir: str | None = None  # MPITP_LOG_DIR
    timeline: str | None = None  # MPITP_TIMELINE
    activations: str | None = None  # MPITP_ACTIVATIONS (mpitp.kernels.cpu checks the value)
    isa: str | None = None  # MPITP_ISA (the same)
    kv_cache_dtype: str | None = None  # MPITP_KV_CACHE_DTYPE (mpitp.models.kv_cache checks the value)
    threads: int = 1  # MPITP_THREADS (threads per rank in the int8 kernels: mpitp.kernels.parallel)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        values = {}
        for f in fields(cls):
            var = "MPITP_" + f.name.upper()
            raw = environ.get(var, "").strip()
            if raw:
                values[f.name] = _PARSE[f.name](var, raw)
        return cls(**values)


def _flag(var: str, raw: str) -> bool:
    low = raw.lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise SettingsError(f"{var}={raw!r}: expected one of {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def _positive_size(minimum: int = 1):
    def parse(var: str, raw: str) -> int:
        try:
            n = parse_size(raw, var)
        except ValueError as e:
            raise SettingsError(str(e)) from None
        if n < minimum:
            raise SettingsError(f"{var}={raw!r}: must be at least {minimum} bytes")
        return n

    return parse


def _int(minimum: int):
    def parse(var: str, raw: str) -> int:
        try:
            n = int(raw)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected a whole number") from None
        if n < minimum:
            raise SettingsError(f"{var}={raw!r}: must be at least {minimum}")
        return n

    return parse


def _seconds(var: str, raw: str) -> float | None:
    try:
        t = float(raw)
    except ValueError:
        raise SettingsError(f"{var}={raw!r}: expected seconds, e.g. 60 or 0.5 (0 = off)") from None
    if not t == t or t < 0 or t == float("inf"):
        raise SettingsError(f"{var}={raw!r}: expected a finite number of seconds >= 0")
    return t or None


def _level(var: str, raw: str) -> str:
    up = raw.upper()
    if up not in LEVELS:
        raise SettingsError(f"{var}={raw!r}: expected one of {', '.join(LEVELS)}")
    return up


def _text(var: str, raw: str) -> str:
    return raw


_PARSE = {
    "validate": _flag,
    "timeout": _seconds,
    "abort_on_error": _flag,
    "ranks_per_node": _int(1),
    "ring_segment": _positive_size(),
    "ring_depth": _int(1),
    "shm": _flag,
    "shm_max": _positive_size(0),
    "oneshot_max": _positive_size(0),
    "cma": _flag,
    "cma_segment": _positive_size(64),
    "cuda_aware": _flag,
    "tuning": _text,
    "cache": _text,
    "log_level": _level,
    "log_dir": _text,
    "timeline": _text,
    "activations": _text,
    "isa": _text,
    "kv_cache_dtype": _text,
    "threads": _int(1),
}

VARIABLES = {"MPITP_" + f.name.upper(): f.name for f in fields(Settings)}
_NAMES = tuple(VARIABLES)

_cached: tuple[tuple, Settings] | None = None


# os.environ's own dict (CPython: encoded names to encoded values), looked up without
# encoding each name: ~2 µs for every variable, against ~25 with os.environ.get, which a
# prefill paid ~250 times (each matmul asks for the ISA and the threads)
_RAW = getattr(os.environ, "_data", None)
_RAW_NAMES = tuple(map(os.environ.encodekey, _NAMES)) if _RAW is not None else ()


def current() -> Settings:
    """Settings for the environment as it is now (cheap: cached until one of
    :data:`VARIABLES` changes; only those are read)."""
    global _cached
    key = tuple(map(_RAW.get, _RAW_NAMES)) if _RAW is not None else tuple(map(os.environ.get, _NAMES))
    if _cached is None or _cached[0] != key:
        _cached = (key, Settings.from_env(os.environ))
    return _cached[1]
