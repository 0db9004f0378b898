"""``bench cuda --sections executor_responsiveness``, arm ``8_processes_one_pool``: one pool, many GPU processes.

This process owns a pool of ``size`` bytes (``Pool``: host memory through a
memfd, filled progressively; with ``backing="host"`` the owner registers
nothing). ``processes`` spawned processes each make a CUDA context (the
primary context and a 1 MiB ``cuMemAlloc``, as a rank of ``contention()``)
and start the driver probe; once all are ready the owner opens the pool and
tells them at once, so the fill starts as they attach, as at an engine's
start. Each attaches with ``AttachedPool(path, device=)`` and waits until
the whole pool is usable in its own context: ``wait_resident()`` on a
GPU-attached pool returns once this process has registered every byte
(resident and registered here), so no polling is needed.

Each process reports the time from its attach call to its first slot and
to the whole pool registered, its GiB/s, and the probe's figures over that
window (what began after it, the close that unregisters every unit, as
``after_*``). The owner reports the wall time from opening the pool to the
last process's whole registration: ``size / wall`` is the rate at which the
pool became GPU-usable in every process (the goal's figure),
``processes * size / wall`` the registrations' aggregate.

Without a device (``device=None``, the CPU-only tests) nothing touches CUDA:
the probe times a call that does nothing, and a process's pool is usable
once the owner's watermark reaches the whole pool.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from typing import Any

from .._config import HostTierConfig
from .._cuda._driver import PrimaryContext, check, driver
from .._pool._client import AttachedPool
from .._pool._owner import Pool
from ._common import GiB, MiB, median
from ._probe import Probe

__all__ = ["GOAL_BLOCKED_FRACTION", "GOAL_GIB_S", "GOAL_WORST_STALL_MS", "pool_contention"]

GOAL_GIB_S = 12.0
"""The pool made GPU-usable in every process at this rate or more (``size / wall``)."""
GOAL_WORST_STALL_MS = 20.0
"""No probe waits longer than this while its process attaches and registers."""
GOAL_BLOCKED_FRACTION = 0.05
"""No probe spends more than this share of its window blocked."""

READY_TIMEOUT_S = 180.0
"""For every process's imports and CUDA context (8 at once on a busy machine)."""
RUN_TIMEOUT_S = 600.0
"""For the fill and every process's registration of the whole pool, and their closes."""


def _clock() -> float:
    """A clock every process of the machine shares (``perf_counter`` is only said to be monotonic)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


async def _attach(path: str, device: int | None) -> dict[str, Any]:
    """One process's attach: to the first slot, to the whole pool usable here, then the close."""
    at, started = _clock(), time.perf_counter()
    async with AttachedPool(path, device=device) as pool:
        attached = time.perf_counter()
        slot = await pool.allocate()
        first = time.perf_counter()
        await pool.free(slot)
        await pool.wait_resident()  # with a device: registered here too, every unit
        usable = time.perf_counter()
        registered, size = pool.registered_bytes, pool.quota
        closing = time.perf_counter()
    closed = time.perf_counter()
    wall = usable - started
    return {
        "started": started,
        "attach_at": at,
        "usable_at": at + wall,
        "attach_ms": round((attached - started) * 1e3, 2),
        "first_slot_ms": round((first - started) * 1e3, 2),
        "usable_s": round(wall, 4),
        "gib_s": round(size / GiB / wall, 3),
        "registered_bytes": registered,
        "pool_bytes": size,
        "close_ms": round((closed - closing) * 1e3, 2),
    }


def _attached(rank: int, path: str, device: int | None, go: Any, out: Any) -> None:
    """A spawned process: its CUDA context and probe, then, at ``go``, the attach (``_attach``)."""
    try:
        ctx: PrimaryContext | None = None
        dptr: Any = 0
        if device is not None:
            ctx = PrimaryContext(device)
            ctx.make_current()
            dptr = check("cuMemAlloc", driver().cuMemAlloc(1 << 20))
        try:
            with Probe(ctx, dptr) as probe:  # running before the window: its report leaves those calls out
                out.put(("ready", rank, None))
                if not go.wait(READY_TIMEOUT_S + RUN_TIMEOUT_S):
                    raise TimeoutError("the owner never opened the pool")
                row = asyncio.run(_attach(path, device))
            # The probe has stopped: its samples are read whole (the window, then the close after it).
            row |= probe.report(row["usable_s"], row.pop("started"))
        finally:
            if ctx is not None:
                driver().cuMemFree(dptr)
                ctx.release()
        out.put(("report", rank, {"rank": rank, **row}))
    except BaseException as exc:  # the owner waits for a message from every process: never leave it waiting
        out.put(("error", rank, repr(exc)))
        raise


def _collect(out: Any, procs: list[Any], kind: str, timeout: float) -> dict[int, Any]:
    """One ``kind`` message from every process; an error message, a process gone, or ``timeout`` raises."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    gone_before = False
    while len(got) < len(procs):
        try:
            what, rank, body = out.get(timeout=0.5)
        except queue.Empty:
            gone = [p.exitcode for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if gone and gone_before:  # gone, and no message of its came in the half second after
                raise RuntimeError(f"an attached process exited early (status {gone[0]})") from None
            gone_before = bool(gone)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs) - len(got)} of {len(procs)} processes did not report") from None
            continue
        if what == "error":
            raise RuntimeError(f"attached process {rank} failed: {body}")
        if what != kind:
            raise RuntimeError(f"attached process {rank} said {what!r}, expected {kind!r}")
        got[rank] = body
    return got


async def _own(config: HostTierConfig, path: str, go: Any, out: Any, procs: list[Any]) -> dict[str, Any]:
    opened_at = _clock()
    async with Pool(config, path) as pool:
        go.set()
        await pool.tier.wait_resident()
        filled_at = _clock()
        reports = await asyncio.to_thread(_collect, out, procs, "report", RUN_TIMEOUT_S)
        unit = pool.tier.config.resolved.commit_unit
    return {"opened_at": opened_at, "owner_fill_s": filled_at - opened_at, "reports": reports, "unit": unit}


def _owner_config(
    size: int, backing: str, device: int | None, slot_size: int, commit_unit: int | None
) -> HostTierConfig:
    """The pool the ``aiokvtier pool`` command opens (64 KiB slots, no NUMA binding), of ``size`` bytes."""
    fields: dict[str, Any] = {
        "quota": size,
        "max_quota": size,
        "slot_size": slot_size,
        "backing": backing,
        "numa_node": None,
        "device": None if backing == "host" else device,
    }
    if commit_unit is not None:
        fields["commit_unit"] = commit_unit
    return HostTierConfig.model_validate(fields)


def pool_contention(
    processes: int,
    size: int,
    backing: str = "host",
    *,
    device: int | None = 0,
    slot_size: int = 64 << 10,
    commit_unit: int | None = None,
) -> dict[str, Any]:
    """``processes`` processes attached to one pool of ``size`` bytes this process owns, each making
    the whole pool GPU-usable in its own context on ``device`` (None: no CUDA, host figures only).

    ``backing`` is the owner's: ``"host"`` (it registers nothing) or ``"register"`` (it registers too,
    with ``device``). ``commit_unit`` None: the pool's default (64 MiB, a GPU-usable tier's, as the
    ``aiokvtier pool`` command has it); attached processes register the owner's units.

    :raises RuntimeError: an attached process failed or exited early.
    :raises TimeoutError: the processes did not get ready, or did not report, in time.
    """
    config = _owner_config(size, backing, device, slot_size, commit_unit)
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    directory = tempfile.mkdtemp(prefix="aiokvtier-bench-")
    path = os.path.join(directory, "pool.sock")
    procs = [ctx.Process(target=_attached, args=(r, path, device, go, out)) for r in range(processes)]
    try:
        for p in procs:
            p.start()
        _collect(out, procs, "ready", READY_TIMEOUT_S)
        owned = asyncio.run(_own(config, path, go, out, procs))
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        shutil.rmtree(directory, ignore_errors=True)
    return _summary(config, processes, size, device, owned)


def _summary(
    config: HostTierConfig, processes: int, size: int, device: int | None, owned: dict[str, Any]
) -> dict[str, Any]:
    opened_at = owned["opened_at"]
    rows = [owned["reports"][r] for r in sorted(owned["reports"])]
    wall = max(r["usable_at"] for r in rows) - opened_at
    for r in rows:  # absolute clocks mean nothing outside this run: offsets from the pool's opening instead
        r["attach_after_open_ms"] = round((r.pop("attach_at") - opened_at) * 1e3, 2)
        r["usable_after_open_s"] = round(r.pop("usable_at") - opened_at, 4)
    usable_gib_s = size / GiB / wall
    worst = max(r["worst_stall_ms"] for r in rows)
    blocked = max(r["blocked_fraction"] for r in rows)
    return {
        "processes": processes,
        "pool_gib": size / GiB,
        "owner_backing": config.resolved_backing,
        "device": device,
        "slot_kib": config.resolved.slot_size // 1024,
        "commit_unit_mib": owned["unit"] / MiB,
        "owner_fill_s": round(owned["owner_fill_s"], 4),
        "wall_s": round(wall, 4),
        "pool_usable_everywhere_gib_s": round(usable_gib_s, 3),
        "aggregate_gib_s": round(processes * usable_gib_s, 3),
        "per_process_gib_s_median": round(median([r["gib_s"] for r in rows]), 3),
        "per_process_gib_s_min": min(r["gib_s"] for r in rows),
        "first_slot_ms_median": round(median([r["first_slot_ms"] for r in rows]), 2),
        "first_slot_ms_max": max(r["first_slot_ms"] for r in rows),
        "registered_everywhere": device is not None and all(r["registered_bytes"] == size for r in rows),
        "blocked_fraction_max": blocked,
        "p99_ms_max": max(r["p99_ms"] for r in rows),
        "worst_stall_ms": worst,
        "after_worst_stall_ms": max(r["after_worst_stall_ms"] for r in rows),
        "close_ms_max": max(r["close_ms"] for r in rows),
        "goal": {
            "pool_usable_everywhere_gib_s": GOAL_GIB_S,
            "worst_stall_ms": GOAL_WORST_STALL_MS,
            "blocked_fraction": GOAL_BLOCKED_FRACTION,
        },
        "meets_goal": bool(
            usable_gib_s >= GOAL_GIB_S and worst <= GOAL_WORST_STALL_MS and blocked <= GOAL_BLOCKED_FRACTION
        ),
        "per_process": rows,
    }
