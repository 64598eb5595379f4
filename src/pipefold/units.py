"""Byte amounts as people write them (2e6, 1.5MB, 64MiB) and as tables show them (1.4 MiB)."""

from __future__ import annotations

import re

from pipefold.errors import ConfigError

__all__ = ["MAX_BYTES", "format_bytes", "parse_bytes"]

MAX_BYTES = 1e18
"""The largest byte amount :func:`parse_bytes` takes (an exabyte): beyond it is a typo, or not even a float."""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, what: str = "the memory budget") -> float:
    """'2000000', '2e6', '1.5MB', '64MiB' -> bytes; anything else, not above zero or above :data:`MAX_BYTES`, is a
    ConfigError."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if match is None or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"cannot read {what} {text!r}: give bytes such as 2000000, 2e6, 1.5MB or 64MiB")
    amount = float(match.group(1)) * _UNITS[match.group(2)]
    if amount > MAX_BYTES:
        raise ConfigError(f"{what} {text!r} is more than any machine has (the limit is {MAX_BYTES:.0e} bytes, "
                          "an exabyte): give bytes such as 2e6, 1.5MB or 64GiB")
    return amount


def format_bytes(n: float) -> str:
    """'512 B', '292.5 KiB', '2.7 MiB', '1.2 GiB'."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
