"""The driver probe of the GPU benchmarks: a thread that times a CUDA call every millisecond.

A call that other work of the process holds up (a registration pinning a
unit under the driver's locks) shows as a long sample; the report gives the
share of the time the probe spent blocked, its p99 and its worst stall.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from .._cuda._driver import PrimaryContext, driver

__all__ = ["Probe"]


class Probe:
    """Times ``cuPointerGetAttribute`` on ``dptr`` every millisecond on its own thread.

    ``ctx`` None (no device: the benchmarks' CPU-only tests) times a call that
    does nothing, so everything but the driver runs as on a GPU machine.
    """

    def __init__(self, ctx: PrimaryContext | None, dptr: int = 0) -> None:
        self._ctx, self._dptr = ctx, dptr
        self.samples: list[float] = []
        self.starts: list[float] = []
        """``time.perf_counter()`` at each sample's call, for placing a stall among other events."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _call(self) -> Callable[[], object]:
        if self._ctx is None:
            return lambda: None
        drv = driver()
        self._ctx.make_current()
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        dptr = self._dptr
        return lambda: drv.cuPointerGetAttribute(attr, dptr)

    def _run(self) -> None:
        call = self._call()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            call()
            self.samples.append(time.perf_counter() - t0)
            self.starts.append(t0)
            time.sleep(0.001)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, wall: float, started: float | None = None) -> dict[str, float]:
        """The calls of the ``wall`` seconds from ``started`` (default: every call); those that began
        after that window (a tier's close: unregistering, unmapping) as ``after_*``, those before it
        (a probe started early, waiting for the others) not at all."""
        if started is None:
            s, rest = self.samples, []
        else:
            end = started + wall
            s = [d for t, d in zip(self.starts, self.samples, strict=True) if started <= t < end]
            rest = [d for t, d in zip(self.starts, self.samples, strict=True) if t >= end]
        row = {
            "blocked_fraction": round(sum(s) / wall, 4) if wall else 0.0,
            "p99_ms": round(float(np.percentile(s, 99)) * 1e3, 3) if s else 0.0,
            "worst_stall_ms": round(max(s) * 1e3, 3) if s else 0.0,
        }
        if started is not None:
            row["after_worst_stall_ms"] = round(max(rest) * 1e3, 3) if rest else 0.0
        return row
