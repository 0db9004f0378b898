"""Where the SM kernel beats the copy engines: measured once per device, kept on disk.

The crossover depends on the device, its link, the driver and the SM
budget (vLLM's kernel took over below 28 KiB on an H100 with 12 SMs; the
ratio at 16 KiB was 3.7x on an A30), so it is measured, not assumed. A
request of ``n`` copies of mean size ``s`` costs, per method,
``fixed + n * per_page(s)``; ``per_page`` is measured at a ladder of page
sizes, shuffled pages, each direction, and interpolated linearly between
them (beyond the ladder, at the last point's bandwidth). The kernel is
chosen only when it is at least ``SM_MARGIN`` faster: SMs it takes are
the model's, the copy engines' are free.

The measurement is cached as JSON under ``$AIOKVTIER_CACHE_DIR`` (default
``$XDG_CACHE_HOME/aiokvtier``, else ``~/.cache/aiokvtier``), one file per
device UUID and SM budget, and holds its key (device name and UUID, driver
version, budget, kernel version and shape). A file whose key differs, or
that cannot be read, is measured again and rewritten. ``AIOKVTIER_SM_CROSSOVER``
(``"h2d=32768,d2h=16384"``: the kernel for mean page sizes up to so many
bytes) or ``CopyEngine(crossover=...)`` overrides the measurement.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DIRECTIONS",
    "LADDER",
    "SM_MARGIN",
    "Crossover",
    "Curve",
    "cache_dir",
    "cache_path",
    "load_or_measure",
    "parse_thresholds",
    "write_atomically",
]

log = logging.getLogger("aiokvtier")

DIRECTIONS = ("h2d", "d2h")
LADDER = (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10)
"""Page sizes measured. Above 256 KiB both paths run near the link's ceiling."""
SM_MARGIN = 0.9
"""The kernel is chosen when its predicted time is at most this fraction of the copy engines'."""
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Curve:
    """One method in one direction: ``time(n, s) = fixed_s + n * per_page(s)``."""

    sizes: tuple[int, ...]
    per_page_s: tuple[float, ...]
    fixed_s: float

    def per_page(self, size: float) -> float:
        sizes, times = self.sizes, self.per_page_s
        if size <= sizes[0]:
            return times[0]
        if size >= sizes[-1]:
            return times[-1] * size / sizes[-1]
        i = bisect_left(sizes, size)
        lo, hi = sizes[i - 1], sizes[i]
        return times[i - 1] + (times[i] - times[i - 1]) * (size - lo) / (hi - lo)

    def time(self, count: int, size: float) -> float:
        return self.fixed_s + count * self.per_page(size)


@dataclass(frozen=True, slots=True)
class Crossover:
    """Chooses ``"sm"`` or ``"dma"`` for a request. Either measured curves or fixed thresholds."""

    key: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, dict[str, Curve]] = field(default_factory=dict)
    """``curves[direction][method]``."""
    thresholds: dict[str, int] | None = None
    """Override: the kernel for mean copy sizes up to so many bytes, per direction."""

    def choose(self, direction: str, count: int, nbytes: int) -> str:
        if direction not in DIRECTIONS or count <= 0:
            return "dma"
        size = nbytes / count
        if self.thresholds is not None:
            return "sm" if size <= self.thresholds.get(direction, 0) else "dma"
        per = self.curves.get(direction)
        if not per or "sm" not in per or "dma" not in per:
            return "dma"
        return "sm" if per["sm"].time(count, size) <= SM_MARGIN * per["dma"].time(count, size) else "dma"

    def crossover_bytes(self, direction: str, count: int = 4096) -> int:
        """The largest ladder size at which ``count`` copies go to the kernel (0: none); for reports."""
        best = 0
        for size in LADDER:
            if self.choose(direction, count, size * count) == "sm":
                best = size
        return best

    @classmethod
    def fixed(cls, thresholds: Mapping[str, int]) -> Crossover:
        bad = set(thresholds) - set(DIRECTIONS)
        if bad:
            raise ValueError(f"crossover thresholds are per direction ('h2d', 'd2h'), not {sorted(bad)}")
        for d, v in thresholds.items():
            if type(v) is not int or v < 0:
                raise ValueError(f"crossover threshold for {d} must be a non-negative int of bytes, got {v!r}")
        return cls(thresholds=dict(thresholds))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "key": self.key,
            "curves": {
                d: {m: {"sizes": list(c.sizes), "per_page_s": list(c.per_page_s), "fixed_s": c.fixed_s}
                    for m, c in per.items()}
                for d, per in self.curves.items()
            },
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Crossover:
        """:raises ValueError: not a crossover file of this format."""
        if data.get("format") != FORMAT:
            raise ValueError(f"crossover format {data.get('format')!r}, expected {FORMAT}")
        curves: dict[str, dict[str, Curve]] = {}
        for d, per in data["curves"].items():
            curves[d] = {}
            for m, c in per.items():
                sizes = tuple(int(s) for s in c["sizes"])
                times = tuple(float(t) for t in c["per_page_s"])
                if not sizes or len(sizes) != len(times) or list(sizes) != sorted(set(sizes)):
                    raise ValueError(f"crossover curve {d}/{m} is malformed")
                curves[d][m] = Curve(sizes, times, float(c["fixed_s"]))
        return cls(key=dict(data["key"]), curves=curves)


def parse_thresholds(text: str) -> Crossover:
    """``"h2d=32768,d2h=16384"`` (sizes in bytes, or with KiB/MiB) as a fixed crossover.

    :raises ValueError: the text names something else or a size is not a number.
    """
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"AIOKVTIER_SM_CROSSOVER: expected direction=bytes, got {part!r}")
        value = value.strip()
        scale = 1
        for suffix, factor in (("KiB", 1 << 10), ("MiB", 1 << 20)):
            if value.endswith(suffix):
                value, scale = value[: -len(suffix)], factor
        try:
            values[name.strip()] = int(value) * scale
        except ValueError:
            raise ValueError(f"AIOKVTIER_SM_CROSSOVER: {part!r} is not a size in bytes") from None
    return Crossover.fixed(values)


def cache_dir() -> Path:
    explicit = os.environ.get("AIOKVTIER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aiokvtier"


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data``: a concurrent reader sees the old file or the whole new one,
    and a write that fails leaves no temporary file behind (a full disk would gain one a process).

    :raises OSError: the directory cannot be made or written, or ``path`` cannot be replaced.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def cache_path(key: Mapping[str, Any], directory: Path | None = None) -> Path:
    uuid = "".join(c for c in str(key.get("uuid", "unknown")) if c.isalnum() or c == "-")[:64]
    return (directory or cache_dir()) / f"sm-crossover-{uuid}-{key.get('budget')}sm.json"


def load_or_measure(
    key: dict[str, Any], measure: Callable[[], dict[str, dict[str, Curve]]], directory: Path | None = None
) -> Crossover:
    """The crossover stored for ``key``, or a new measurement (stored; a file that cannot be
    written is logged, not fatal). Blocking: off the event loop."""
    try:
        path = cache_path(key, directory)
    except RuntimeError as exc:  # no home directory (and no AIOKVTIER_CACHE_DIR): measured, kept nowhere
        log.warning("aiokvtier: no cache directory for the SM copy crossover: %s", exc)
        return Crossover(key=key, curves=measure())
    reason = "none stored"
    try:
        stored = Crossover.from_json(json.loads(path.read_text()))
        if stored.key == key:
            return stored
        changed = sorted(k for k in set(stored.key) | set(key) if stored.key.get(k) != key.get(k))
        reason = f"{', '.join(changed)} changed"
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = f"unreadable ({exc})"
    started = time.perf_counter()
    measured = Crossover(key=key, curves=measure())
    log.info(
        "aiokvtier: measured the SM copy crossover for %s in %.2f s (%s): kernel up to %s B H2D, %s B D2H",
        key.get("device"), time.perf_counter() - started, reason,
        measured.crossover_bytes("h2d"), measured.crossover_bytes("d2h"),
    )  # fmt: skip
    try:
        write_atomically(path, json.dumps(measured.to_json(), indent=1).encode())
    except OSError as exc:
        log.warning("aiokvtier: cannot store the SM copy crossover at %s: %s", path, exc)
    return measured


def device_key(device: int, budget: int, spec: Any, options: Any) -> dict[str, Any]:
    """What a measurement depends on (``options``: the SM path's ``SmOptions``). Driver calls:
    the engine's context current."""
    from ._driver import check, driver
    from ._kernel import KERNEL_VERSION

    drv = driver()
    dev = check("cuDeviceGet", drv.cuDeviceGet(device))
    name = check("cuDeviceGetName", drv.cuDeviceGetName(256, dev))
    uuid = check("cuDeviceGetUuid", drv.cuDeviceGetUuid(dev))
    raw = bytes(uuid.bytes) if hasattr(uuid, "bytes") else bytes(uuid)
    return {
        "device": (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00"),
        "uuid": raw.hex(),
        "driver": int(check("cuDriverGetVersion", drv.cuDriverGetVersion())),
        "budget": budget,
        "kernel": KERNEL_VERSION,
        "threads": spec.threads,
        "unroll": spec.unroll,
        "bounded": spec.bounded,
        # How a request is launched: the slices' size and streams and the descriptors' size
        # change what a launch costs.
        "slice_bytes": options.slice_bytes,
        "alternate": options.alternate,
        "pdl": options.pdl,
        "pack": options.pack,
        "head": options.head,
        "split_runs": options.split_runs,
    }


def measure_device(
    sm: Any, batch: Callable[[str], Any], stream: Any, max_batch: int, total: int = 16 << 20
) -> dict[str, dict[str, Curve]]:
    """Time both methods over shuffled pages at each ``LADDER`` size, both directions.

    ``sm``: the engine's ``SmPath``; ``batch(direction)``: a ``BatchCall``. Runs on the
    engine's worker with its context current; allocates ``total`` bytes of pinned host
    memory and of device memory for the duration.
    """
    from ._driver import check, driver

    drv = driver()
    host = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(total, 0)))
    try:
        dev = int(check("cuMemAlloc", drv.cuMemAlloc(total)))
        try:
            return _measure(drv, sm, batch, stream, max_batch, host, dev, total)
        finally:
            drv.cuMemFree(dev)
    finally:
        drv.cuMemFreeHost(host)


def _measure(
    drv: Any, sm: Any, batch: Callable[[str], Any], stream: Any, max_batch: int, host: int, dev: int, total: int
) -> dict[str, dict[str, Curve]]:
    from .._copy._plan import chunk_slices
    from ._driver import check

    rng = np.random.default_rng(7)

    def timed(run: Callable[[], None], repeats: int) -> float:
        run()  # warm: first-touch of slabs, the driver's lazy loading
        check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
            best = min(best, time.perf_counter() - t0)
        return best

    def runner(method: str, direction: str, size: int, n: int) -> Callable[[], None]:
        slots = np.uint64(size) * rng.permutation(total // size)[:n].astype(np.uint64)
        pages = np.uint64(size) * rng.permutation(total // size)[:n].astype(np.uint64)
        h, d = np.uint64(host) + slots, np.uint64(dev) + pages
        dsts, srcs = (d, h) if direction == "h2d" else (h, d)
        sizes = np.full(n, size, dtype=np.uint64)
        if method == "dma":
            call = batch(direction)

            def copy() -> None:  # as the engine submits: its chunks of descriptors
                for chunk in chunk_slices(n, max_batch):
                    call(dsts[chunk], srcs[chunk], sizes[chunk], stream)

            return copy

        def launch() -> None:
            sm.give_back(sm.submit(dsts, srcs, sizes, stream))  # the sync after each run makes reuse safe

        return launch

    curves: dict[str, dict[str, Curve]] = {}
    for direction in DIRECTIONS:
        curves[direction] = {}
        for method in ("dma", "sm"):
            fixed = timed(runner(method, direction, LADDER[0], 1), 5)
            per_page = []
            for size in LADDER:
                n = min(total // size, 4096)
                per_page.append(max(timed(runner(method, direction, size, n), 3) - fixed, 0.0) / n)
            curves[direction][method] = Curve(LADDER, tuple(per_page), fixed)
    return curves
