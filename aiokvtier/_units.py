"""Sizes and rates as people read them: binary units, three significant figures."""

from __future__ import annotations

__all__ = ["format_bytes", "format_rate"]

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(size: float) -> str:
    """``format_bytes(998244352) == "952 MiB"``; below 1 KiB, a plain byte count."""
    if size < 1024:
        return f"{size:.0f} bytes"
    value = float(size)
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if value == int(value):
        return f"{int(value)} {_UNITS[unit]}"
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{digits}f} {_UNITS[unit]}"


def format_rate(bytes_per_second: float) -> str:
    """``format_rate(2**30) == "1.00 GiB/s"``."""
    if bytes_per_second < 1024:
        return f"{bytes_per_second:.0f} bytes/s"
    return f"{format_bytes(bytes_per_second)}/s"
