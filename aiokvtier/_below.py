"""What the tiers below the host tier (disk, Mooncake) check alike in their arguments."""

from __future__ import annotations

__all__ = ["check_fingerprint", "check_io_threads"]


def check_fingerprint(fingerprint: object) -> str:
    """:raises ValueError: not a non-empty str, or not encodable as UTF-8 (it is hashed into names)."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
    try:
        fingerprint.encode()
    except UnicodeEncodeError:
        raise ValueError(f"fingerprint must be encodable as UTF-8, got {fingerprint!r}") from None
    return fingerprint


def check_io_threads(io_threads: object) -> int:
    """:raises ValueError: not an int between 1 and 64."""
    if type(io_threads) is not int or not 1 <= io_threads <= 64:
        raise ValueError(f"io_threads must be an int between 1 and 64, got {io_threads!r}")
    return io_threads
