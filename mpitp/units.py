"""Sizes with units, parsed one way everywhere (``mpitp bench``, ``mpitp plan``, MPITP_*):

    plain number      bytes                 4096
    K, M, G, T        powers of 1024        64K = 65536 (nccl-tests' -b/-e convention)
    KiB, MiB, GiB     powers of 1024        8MiB = 8388608
    KB, MB, GB, TB    powers of 1000 (SI)   8MB = 8000000

Case does not matter and a space may separate number and unit ("1.5 GiB"); a trailing
"B" alone means bytes. Anything else is an error that says what was expected.
"""

from __future__ import annotations

import math
import re

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "size") -> int:
    """Bytes for ``text``; ``ValueError`` naming ``what`` when it is not a size."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(
            f"{what} {text!r} is not a size: use bytes or a unit, e.g. 4096, 64K, 8MiB, 8MB "
            "(K/M/G and KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000)"
        )
    number, prefix, tail = float(m.group(1)), m.group(2).upper(), m.group(3).upper()
    if tail == "I":  # "8Mi": half of MiB
        raise ValueError(f"{what} {text!r}: write {prefix}iB")
    mult = _DECIMAL[prefix] if tail == "B" and prefix else _BINARY[prefix]
    value = number * mult
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{what} {text!r} is not a whole number of bytes")
    return int(value)


def size_list(text: str) -> list[int]:
    """Comma-separated sizes, as an argparse ``type``: "64K,1M,8MiB" -> bytes each; a bad
    one is a usage error that says what was expected."""
    import argparse

    try:
        return [parse_size(s, "size") for s in str(text).split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def human(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:g} {unit}"
    return f"{int(n)} B"
