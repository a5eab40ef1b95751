"""Byte quantities: parse what users write in YAML ("24GiB") and print what the planner found."""

from __future__ import annotations

from fulltune.memory.errors import MemoryConfigError


def parse_bytes(value: int | str) -> int:
    """A memory size in bytes, read by the spec's one size parser (`fulltune.sizes.parse_size`).

    Raises:
        MemoryConfigError: the value is negative, not a number, or has an unknown unit.
    """
    from fulltune.errors import ConfigError
    from fulltune.sizes import parse_size

    try:
        return parse_size(value)
    except ConfigError as exc:
        raise MemoryConfigError(str(exc)) from None


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


def format_seconds(value: float | None, unit: str = "s") -> str:
    """A duration: `85.8 µs`, `12.5 ms`, `0.5 s`, `12.3 s`, `780 s`, `1,270 s (21 min)`, `9,000 s (2.5 h)` (three
    significant digits, whole seconds from 100, minutes or hours beside it from 1,000); `unit` "s/step" for a
    step's."""
    if value is None:
        return "-"
    if 0 < abs(value) < 1e-3:  # a tiny model's step on the ranking model: microseconds, not 8.58e-05 s
        return f"{value * 1e6:.3g} µ{unit}"
    if 0 < abs(value) < 0.1:
        return f"{value * 1e3:.3g} m{unit}"
    if value < 100:
        return f"{value:.3g} {unit}"
    if value < 1000:
        return f"{value:.0f} {unit}"
    beside = f"{value / 60:.0f} min" if value < 6000 else f"{value / 3600:.2g} h"
    return f"{value:,.0f} {unit} ({beside})"
