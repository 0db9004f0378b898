"""The ``neighbours`` and ``fill_scaling`` sections of ``python -m aiokvtier.bench host``.

``neighbours``: while memory fills, another thread maps and unmaps 1 MiB every
5 ms (what a large ``malloc``, a new thread's stack or a driver call does);
how long each of those waits is what the fill costs the rest of the process.
Arms, interleaved within each repeat: the tier with default settings for each
backing this machine has, ``MADV_POPULATE_WRITE`` over one read-write mapping
in 512 MiB and in 2 MiB calls, and the touch loop (a write per page) as the
reference, at one thread and at the tier's default thread count. A second
part samples the event loop's lag while its thread allocates 1 MiB buffers
during a fill.

``fill_scaling``: the raw loops (k threads touching, or populating, shares
of one read-write mapping) beside the tier with ``fill_threads=k``, at 1, 2,
4 and 8 threads, 4 KiB pages and THP, in one run; with a GPU, the register
and vmm tiers at the same thread counts (4 KiB pages).

Every figure is a median over the repeats; after every free the machine is
given ``settle`` seconds (a VM's free-page reporting makes memory freed just
before cost a host fault when touched again).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._config import HostTierConfig, default_fill_threads
from .._host import _headroom, _linux
from .._host._tier import HostTier
from .._progress import note
from ._common import GiB, MiB, loop_factories, median, run_on, summary_ms

PROBE_BYTES = 1 * MiB
PROBE_PERIOD = 0.005
THREADS = (1, 2, 4, 8)


def _settle(seconds: float) -> None:
    time.sleep(seconds)


class Neighbour:
    """A thread that maps and unmaps ``PROBE_BYTES`` every ``PROBE_PERIOD`` and times each pair."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (start, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-neighbour", daemon=True)

    def __enter__(self) -> Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_PERIOD):
            started = time.perf_counter()
            _linux.munmap(_linux.map_anonymous(PROBE_BYTES), PROBE_BYTES)
            self.samples.append((started, time.perf_counter() - started))

    def between(self, start: float, end: float) -> list[float]:
        return [seconds for at, seconds in self.samples if start <= at < end]


# -- raw loops over one read-write mapping -----------------------------------------------------


def _raw_fill(size: int, threads: int, huge: bool, fill: Callable[[int, int], None]) -> tuple[float, float, float]:
    """k threads run ``fill`` over shares of one read-write mapping; ``(start, end, seconds)``."""
    base, length = _linux.mmap_reserve(size, 2 * MiB)
    try:
        _linux.madvise(base, length, _linux.MADV_HUGEPAGE if huge else _linux.MADV_NOHUGEPAGE)
        _linux.mprotect(base, length, writable=True)
        share = -(-size // threads // (2 * MiB)) * (2 * MiB)
        errors: list[BaseException] = []

        def work(i: int) -> None:
            lo = min(i * share, size)
            try:
                fill(base + lo, min(share, size - lo))
            except BaseException as exc:  # reported below, on the main thread
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(i,), name=f"bench-fill-{i}") for i in range(threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        ended = time.perf_counter()
        if errors:
            raise errors[0]
        return started, ended, ended - started
    finally:
        _linux.munmap(base, length)


def _populate_calls(step: int) -> Callable[[int, int], None]:
    def fill(addr: int, length: int) -> None:
        _linux.populate_write(addr, length, step)

    return fill


def _touch(addr: int, length: int) -> None:
    _linux.touch(addr, length)


# -- the tier ------------------------------------------------------------------------------------


def _tier_config(size: int, **overrides: Any) -> HostTierConfig:
    values: dict[str, Any] = {"quota": size, "max_quota": size, "slot_size": 64 << 10, "numa_node": None}
    values.update(overrides)
    return HostTierConfig(**values)


async def _tier_fill_async(config: HostTierConfig) -> tuple[float, float, float, int]:
    started = time.perf_counter()
    async with HostTier(config) as tier:
        await tier.wait_resident()
        ended = time.perf_counter()
        return started, ended, ended - started, tier.statistics().fill_threads


def _tier_fill(config: HostTierConfig) -> tuple[float, float, float, int]:
    return asyncio.run(_tier_fill_async(config))


class _WarmContext:
    """The device's primary context held for a section, as a serving process holds one (torch made it).

    Without it the first GPU tier of each repeat would pay the driver's start-up inside its fill.
    """

    def __init__(self, cuda: bool) -> None:
        self._context: Any = None
        if cuda:
            from .._cuda._driver import PrimaryContext

            self._context = PrimaryContext(0)

    def __enter__(self) -> _WarmContext:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.release()


def cuda_backings() -> list[str]:
    """The GPU backings this machine can run (none without a CUDA device)."""
    try:
        from .._cuda._driver import device_count

        return ["register", "vmm"] if device_count() > 0 else []
    except Exception:
        return []


# -- neighbours ----------------------------------------------------------------------------------


def neighbours(
    size: int, repeats: int, settle: float, register_units: list[int], vmm_units: Sequence[int] = ()
) -> dict[str, Any]:
    default_threads = default_fill_threads()
    arms: dict[str, Callable[[], tuple[float, float, float]]] = {
        "tier_host": lambda: _tier_fill(_tier_config(size))[:3],
        "populate_512mib_calls": lambda: _raw_fill(size, 1, False, _populate_calls(512 * MiB)),
        "populate_2mib_calls": lambda: _raw_fill(size, 1, False, _populate_calls(2 * MiB)),
        "touch_1_thread": lambda: _raw_fill(size, 1, False, _touch),
    }
    if default_threads > 1:
        arms[f"touch_{default_threads}_threads"] = lambda: _raw_fill(size, default_threads, False, _touch)
    for backing in cuda_backings():
        arms[f"tier_{backing}"] = lambda b=backing: _tier_fill(_tier_config(size, device=0, backing=b))[:3]  # type: ignore[misc]
        for unit in register_units if backing == "register" else vmm_units:
            cfg = _tier_config(size, device=0, backing=backing, commit_unit=unit)
            arms[f"tier_{backing}_unit_{unit // MiB}mib"] = lambda c=cfg: _tier_fill(c)[:3]  # type: ignore[misc]
    rates: dict[str, list[float]] = {name: [] for name in arms}
    stats: dict[str, dict[str, list[float]]] = {name: {"p50_ms": [], "p99_ms": [], "max_ms": []} for name in arms}
    counts: dict[str, int] = dict.fromkeys(arms, 0)
    with _WarmContext(bool(cuda_backings())):
        for repeat in range(repeats):
            for name, arm in arms.items():  # interleaved: drift lands on every arm
                note(f"{name}, repeat {repeat + 1} of {repeats}")
                with Neighbour() as probe:
                    time.sleep(4 * PROBE_PERIOD)
                    start, end, seconds = arm()
                waits = probe.between(start, end)
                rates[name].append(size / GiB / seconds)
                summary = summary_ms(waits)
                counts[name] += len(waits)
                for key in stats[name]:
                    stats[name][key].append(summary[key])
                _settle(settle)
    out: dict[str, Any] = {
        "size_gib": size / GiB,
        "repeats": repeats,
        "default_fill_threads": default_threads,
        "probe": f"mmap+munmap of {PROBE_BYTES >> 20} MiB every {PROBE_PERIOD * 1e3:g} ms on another thread",
        "arms": {},
    }
    touch = {k: median(v) for k, v in stats["touch_1_thread"].items()}
    for name in arms:
        row: dict[str, Any] = {"fill_gib_s": round(median(rates[name]), 3), "probes": counts[name]}
        for key, values in stats[name].items():
            row[f"neighbour_{key}"] = round(median(values), 4)
        if name.startswith("tier_"):
            p50, p99 = row["neighbour_p50_ms"], row["neighbour_p99_ms"]
            row["goal_p50_ms"] = round(max(0.5, 2 * touch["p50_ms"]), 4)
            row["goal_p99_ms"] = round(max(5.0, 2 * touch["p99_ms"]), 4)
            row["meets_goal"] = bool(p50 <= row["goal_p50_ms"] and p99 <= row["goal_p99_ms"])
        out["arms"][name] = row
    out["loop_lag_allocating_1mib"] = loop_lag_while_allocating(size, settle)
    out["population_counters"] = _headroom.counters()
    return out


async def _lag_while(fill: Callable[[], Any], allocate: bool) -> dict[str, Any]:
    """Loop lag (1 ms sleeps) while ``fill`` runs on a thread; the loop allocates 1 MiB per tick if asked."""
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(None, fill)
    lags: list[float] = []
    keep: list[bytearray] = []
    while not done.done():
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        if allocate:
            keep.append(bytearray(PROBE_BYTES))  # a request's buffer, as a server allocates one
            if len(keep) > 4:
                keep.pop(0)
        lags.append(time.perf_counter() - started - 0.001)
    await done
    return summary_ms(lags)


async def _tier_lag(size: int) -> dict[str, Any]:
    async with HostTier(_tier_config(size)) as tier:
        filled = asyncio.ensure_future(tier.wait_resident())
        lags: list[float] = []
        keep: list[bytearray] = []
        while not filled.done():
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            keep.append(bytearray(PROBE_BYTES))
            if len(keep) > 4:
                keep.pop(0)
            lags.append(time.perf_counter() - started - 0.001)
        await filled
    return summary_ms(lags)


def loop_lag_while_allocating(size: int, settle: float) -> dict[str, Any]:
    """p50/p99/max of the loop's lag while its thread allocates 1 MiB buffers during a fill."""
    out: dict[str, Any] = {}
    for name, factory in loop_factories().items():
        note(f"loop lag while allocating, on {name}")
        tier = run_on(factory, _tier_lag(size))
        _settle(settle)
        populate = run_on(
            factory, _lag_while(lambda: _raw_fill(size, 1, False, _populate_calls(512 * MiB)), allocate=True)
        )
        _settle(settle)
        out[name] = {"tier_host_default": tier, "populate_512mib_calls": populate}
    return out


# -- fill scaling --------------------------------------------------------------------------------


def fill_scaling(size: int, repeats: int, settle: float, threads: tuple[int, ...] = THREADS) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for huge in (False, True):
        for k in threads:
            arms: dict[str, Callable[[], float]] = {
                "raw_touch": lambda k=k, huge=huge: _raw_fill(size, k, huge, _touch)[2],  # type: ignore[misc]
                "raw_populate": lambda k=k, huge=huge: _raw_fill(size, k, huge, _populate_calls(64 * MiB))[2],  # type: ignore[misc]
                "tier_host": lambda k=k, huge=huge: _tier_fill(  # type: ignore[misc]
                    _tier_config(size, fill_threads=k, transparent_huge_pages=huge)
                )[2],
            }
            for backing in cuda_backings() if not huge else []:
                cfg = _tier_config(size, fill_threads=k, device=0, backing=backing)
                arms[f"tier_{backing}"] = lambda c=cfg: _tier_fill(c)[2]  # type: ignore[misc]
            seconds: dict[str, list[float]] = {name: [] for name in arms}
            with _WarmContext(len(arms) > 3):
                for repeat in range(repeats):
                    for name, arm in arms.items():
                        note(
                            f"{'THP' if huge else '4 KiB pages'}, {k} threads, {name}, repeat {repeat + 1} of {repeats}"
                        )
                        seconds[name].append(arm())
                        _settle(settle)
            rates = {name: size / GiB / median(s) for name, s in seconds.items()}
            raw = max(rates["raw_touch"], rates["raw_populate"])
            rows.append(
                {
                    "pages": "thp" if huge else "4k",
                    "threads": k,
                    **{f"{name}_gib_s": round(rate, 3) for name, rate in rates.items()},
                    "tier_vs_best_raw": round(rates["tier_host"] / raw, 3),
                }
            )
    return {"size_gib": size / GiB, "repeats": repeats, "rows": rows, "population_counters": _headroom.counters()}


# -- transparent huge pages: off, on, auto -------------------------------------------------------


class Fragmenter:
    """Holds every other 4 KiB page of ``size`` bytes, so no free 2 MiB block is left in that memory.

    The node's free order-9 blocks are used up (what a long-running process's
    heap does to a node); a huge-page fault then needs compaction.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.base = _linux.map_anonymous(size)
        _linux.madvise(self.base, size, _linux.MADV_NOHUGEPAGE)
        _linux.touch(self.base, size)
        page = _linux.PAGE_SIZE
        for offset in range(0, size, 2 * page):
            _linux.madvise(self.base + offset, page, _linux.MADV_DONTNEED)

    def close(self) -> None:
        _linux.munmap(self.base, self.size)


def thp_auto(size: int, repeats: int, settle: float, fragment: int | None) -> dict[str, Any]:
    """The tier with THP off, on and ``"auto"``, on the node as it is and on one fragmented on purpose.

    ``fragment`` bytes (default: what the free 2 MiB blocks hold, at most
    16 GiB and what memory allows beside the tier) are touched and then every
    other page freed; ``free_2mib_blocks_before`` shows whether that used the
    free blocks up.
    """
    from .._host import _hugepages

    if fragment is None:
        room = (_headroom.available_bytes() or 0) - 2 * size - GiB
        fragment = min(_hugepages.free_huge_blocks(None) * _hugepages.HUGE_PAGE, 16 * GiB, room)
    fragment = max(fragment // (2 * MiB) * (2 * MiB), 2 * MiB)

    modes: dict[str, bool | str] = {"off": False, "on": True, "auto": "auto"}
    out: dict[str, Any] = {
        "size_gib": size / GiB,
        "repeats": repeats,
        "kernel": dict(zip(("enabled", "defrag"), _hugepages.kernel_settings(), strict=True)),
        "fragment_gib": round(fragment / GiB, 3),
    }
    for node_state in ("as_is", "fragmented"):
        if node_state == "fragmented":
            note(f"fragmenting {fragment / GiB:.2f} GiB")
        fragmenter = Fragmenter(fragment) if node_state == "fragmented" else None
        try:
            free_blocks = _hugepages.free_huge_blocks(None)
            seconds: dict[str, list[float]] = {m: [] for m in modes}
            units: list[int] = []
            for repeat in range(repeats):
                for mode, value in modes.items():
                    note(f"{node_state}, THP {mode}, repeat {repeat + 1} of {repeats}")
                    cfg = _tier_config(size, transparent_huge_pages=value)
                    seconds[mode].append(asyncio.run(_thp_fill(cfg, units if mode == "auto" else None)))
                    _settle(settle)
        finally:
            if fragmenter is not None:
                fragmenter.close()
                _settle(settle)
        rates = {m: size / GiB / median(s) for m, s in seconds.items()}
        best = max(rates["off"], rates["on"])
        out[node_state] = {
            "free_2mib_blocks_before": free_blocks,
            **{f"{m}_gib_s": round(r, 3) for m, r in rates.items()},
            "auto_vs_best": round(rates["auto"] / best, 3),
            "auto_never_loses": rates["auto"] >= 0.95 * best,
            "auto_huge_page_units_median": median([float(u) for u in units]) if units else 0,
        }
    return out


async def _thp_fill(config: HostTierConfig, units: list[int] | None) -> float:
    started = time.perf_counter()
    async with HostTier(config) as tier:
        await tier.wait_resident()
        seconds = time.perf_counter() - started
        if units is not None:
            units.append(tier.statistics().huge_page_units)
    return seconds


# -- the fill next to a saturated event loop ---------------------------------------------------


async def _spin(stop: asyncio.Event) -> None:
    """A saturated loop: about a millisecond of Python, then one loop iteration, until stopped."""
    x = 0
    while not stop.is_set():
        for i in range(20_000):
            x += i
        await asyncio.sleep(0)


async def _fill_beside(config: HostTierConfig, busy: bool, deadline: float) -> dict[str, Any]:
    """The fill rate as DESIGN section 7 defines it (from the start of ``open`` to ``wait_resident()``),
    with the loop saturated from before the open: the open's own steps run beside it too."""
    stop = asyncio.Event()
    spinner = asyncio.create_task(_spin(stop)) if busy else None
    try:
        started = time.perf_counter()
        async with HostTier(config) as tier:
            try:
                async with asyncio.timeout(max(0.0, deadline - (time.perf_counter() - started))):
                    await tier.wait_resident()
            except TimeoutError:
                pass  # reported as the bytes resident at the deadline
            seconds = time.perf_counter() - started
            resident = tier.statistics().resident_bytes
    finally:
        stop.set()
        if spinner is not None:
            await spinner
    return {
        "resident_gib": round(resident / GiB, 3),
        "seconds": round(seconds, 2),
        "gib_s": round(resident / GiB / seconds, 3),
    }


def busy_loop(size: int, repeats: int, settle: float, deadline: float = 15.0) -> dict[str, Any]:
    """Fill rate with an idle loop and beside a saturated one, per backing, interleaved; the median run of each."""
    backings = ["host", *cuda_backings()]
    rows: dict[str, Any] = {}
    with _WarmContext(len(backings) > 1):
        for backing in backings:
            device = None if backing == "host" else 0
            config = _tier_config(size, backing=backing, device=device)
            runs: dict[str, list[dict[str, Any]]] = {"idle": [], "busy": []}
            for repeat in range(max(1, repeats)):
                for busy in (False, True):
                    note(f"{backing}, {'busy' if busy else 'idle'} loop, repeat {repeat + 1} of {max(1, repeats)}")
                    _settle(settle)
                    runs["busy" if busy else "idle"].append(asyncio.run(_fill_beside(config, busy, deadline)))
            row: dict[str, Any] = {}
            for arm, results in runs.items():
                results.sort(key=lambda r: float(r["gib_s"]))
                row[arm] = {**results[len(results) // 2], "runs_gib_s": [r["gib_s"] for r in results]}
            idle, busy_rate = row["idle"]["gib_s"], row["busy"]["gib_s"]
            row["busy_vs_idle"] = round(busy_rate / idle, 3) if idle else None
            rows[backing] = row
    return {
        "size_gib": round(size / GiB, 3),
        "loop": "1 ms of Python, then await asyncio.sleep(0), on the tier's loop",
        "deadline_s": deadline,
        "repeats": max(1, repeats),
        "backings": rows,
    }
