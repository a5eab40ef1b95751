"""Memory sizes as users write them (`24GiB`, `512MiB`, `1.5GB`): the one size parser."""

from __future__ import annotations

import re

from fulltune.errors import ConfigError

SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([KMGT]i?B|[KMGT]|B)?\s*$", re.IGNORECASE)
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(value: int | str) -> int:
    """A memory size in bytes: `24GiB`, `512MiB`, `1.5GB`, `16G`, `1000000` or an int — the one size parser.

    KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000, and a bare K/M/G/T follows the binary
    convention of memory sizes (`24G` is 24 GiB).

    Raises:
        ConfigError: negative, not a number, or an unknown unit.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"memory size must be a number of bytes or a string like '24GiB', not {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise ConfigError(f"memory size must be a non-negative number of bytes, got {value}")
        return int(value)
    match = SIZE_PATTERN.match(value)
    if not match:
        raise ConfigError(f"cannot read memory size {value!r}: write a number of bytes or a number with a unit, "
                          "e.g. '24GiB', '512MiB', '1.5GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    return int(number * SIZE_UNITS[unit])
