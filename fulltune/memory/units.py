"""Byte quantities: parse what users write in YAML ("24GiB") and print what the planner found."""

from __future__ import annotations

import re

from fulltune.memory.errors import MemoryConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # Bare "k/m/g/t" follow the binary convention of memory sizes (`--memory 24G` means GiB).
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str) -> int:
    """Turn `24GiB`, `512MiB`, `1.5GB`, `1000000` or an int into a number of bytes.

    Raises:
        MemoryConfigError: the value is negative, not a number, or has a unit other than B, KB/MB/GB/TB
            (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024).
    """
    if isinstance(value, bool):
        raise MemoryConfigError(f"memory size must be a number of bytes or a string like '24GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise MemoryConfigError(f"memory size must not be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise MemoryConfigError(f"memory size must be a non-negative number of bytes, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise MemoryConfigError(f"memory size must be a number of bytes or a string like '24GiB', not {type(value).__name__}")
    match = _PATTERN.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise MemoryConfigError(
            f"cannot read memory size {value!r}: write a number of bytes or a number with a unit, "
            "e.g. '24GiB', '512MiB', '1.5GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int | float | None) -> str:
    """Binary units with three significant digits: `1.93 GiB`, `512 MiB`, `17 B`."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{sign}{value:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"
