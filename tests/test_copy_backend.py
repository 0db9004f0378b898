"""The CopyEngine over a RecordingBackend, on asyncio and uvloop: what it plans, in what order it
issues, and how its callers see held, failed and cancelled jobs, without a GPU.

The backend completes each job on the engine's completion thread, as a GPU copy does (a
host-only engine's memmove lands on the submit thread instead), so these tests reach the
completion path that the host-to-host tests cannot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, CudaError, HostTier, Pages, SlotError, SmOptions, StaticHostMem
from aiokvtier.testing import IssuedCopy, RecordingBackend

from .helpers import KiB, small_config
from .invariants import wait_no_library_threads

SLOT = 64 * KiB
HANG = 10.0
DEVICE = 0x7F00_0000_0000
"""An address in no tier or StaticHostMem: device memory to an engine with a device."""


@asynccontextmanager
async def rig(
    device: int | None = None, *, max_batch: int = 1024, **backend: Any
) -> AsyncIterator[tuple[HostTier, StaticHostMem, CopyEngine, RecordingBackend]]:
    recording = RecordingBackend(**backend)
    async with (
        HostTier(small_config()) as tier,
        StaticHostMem(16 * SLOT) as stage,
        CopyEngine(device, max_batch=max_batch, backend=recording) as engine,
    ):
        await tier.wait_resident()
        yield tier, stage, engine, recording


async def bounded(aw: Any) -> Any:
    return await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(aw)), HANG)


# -- planning ---------------------------------------------------------------------------------


async def test_a_job_is_planned_in_host_order_with_runs_merged() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = await tier.allocate(6)  # fresh: ascending and contiguous, in one registration
        base = tier.address(slots[0])

        def page(i: int) -> int:
            return stage.address + i * SLOT

        # Given last slot first; in slot order: 0, 1 -> pages 0, 1; 2, 3, 4 -> pages 5, 6, 7; 5 -> page 3.
        await bounded(engine.to_device(tier, slots[::-1], [page(i) for i in (3, 7, 6, 5, 1, 0)]))
        (job,) = recording.issued
        assert job.direction == "h2d" and job.requested == 6 and job.order == 0 and job.after is None
        assert job.srcs == (base, base + 2 * SLOT, base + 5 * SLOT)  # the host side leads, ascending
        assert job.dsts == (page(0), page(5), page(3)) and job.sizes == (2 * SLOT, 3 * SLOT, SLOT)
        ascending = [stage.address + i * SLOT for i in range(6)]
        await bounded(engine.to_host(tier, slots, ascending))
        merged = recording.issued[1]
        assert merged.direction == "d2h" and merged.requested == 6
        assert merged.dsts == (base,) and merged.srcs == (stage.address,) and merged.sizes == (6 * SLOT,)
        assert merged.calls == (1,)


async def test_a_job_is_cut_into_calls_of_at_most_max_batch_descriptors() -> None:
    async with rig(max_batch=4) as (tier, stage, engine, recording):
        slots = await tier.allocate(10)
        every_other = [stage.address + i * SLOT for i in (0, 2, 4, 6, 8, 1, 3, 5, 7, 9)]  # nothing merges
        await bounded(engine.to_host(tier, slots, every_other))
        (job,) = recording.issued
        assert job.requested == 10 and len(job.dsts) == 10 and job.calls == (4, 4, 2)
        stats = engine.statistics()
        assert stats.driver_calls == 3 and stats.descriptors_submitted == 10 and stats.copies_requested == 10
        assert stats.jobs_by_method["dma"] == 1 and stats.bytes_by_method["dma"] == 10 * SLOT


async def test_a_refused_request_reaches_no_backend() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        with pytest.raises(SlotError):
            await engine.to_host(tier, [slots[0], slots[0]], [stage.address, stage.address + SLOT])
        with pytest.raises(ValueError, match="after= needs a CUDA device"):
            await engine.to_device(tier, slots, [stage.address, stage.address + SLOT], after=7)
        assert recording.issued == [] and recording.marks == []
        assert engine.statistics().jobs_submitted == 0


# -- ordering ---------------------------------------------------------------------------------


async def test_jobs_are_issued_and_settled_in_the_order_they_were_queued() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = await tier.allocate(8)
        started = [engine.begin(tier, [slot], [stage.address + i * SLOT], "h2d") for i, slot in enumerate(slots)]
        await bounded(recording.wait_issued(len(slots)))
        assert [job.srcs[0] for job in recording.issued] == [tier.address(s) for s in slots]
        assert [job.order for job in recording.issued] == list(range(len(slots)))
        await bounded(asyncio.gather(*(s.submitted for s in started)))  # issued: reported at once
        assert recording.release(3) == 3
        await bounded(asyncio.gather(*(s.done for s in started[:3])))
        await asyncio.sleep(0.01)
        assert not any(s.done.done() for s in started[3:]) and recording.held == 5
        recording.release()
        await bounded(asyncio.gather(*(s.done for s in started)))


async def test_after_marks_a_stream_on_the_callers_thread_and_passes_an_event_through() -> None:
    class Event:
        cuda_event = 0xE7

    async with rig(0) as (tier, _, engine, recording):
        slots = await tier.allocate(2)
        await bounded(engine.to_device(tier, slots, [DEVICE, DEVICE + SLOT], after=0x5))
        await bounded(engine.to_host(tier, slots, [DEVICE, DEVICE + SLOT], after=Event()))
        assert recording.marks == [(0x5, threading.current_thread().name)]
        assert [job.after for job in recording.issued] == [("stream", 0x5), ("event", 0xE7)]


# -- held, failed, cancelled ------------------------------------------------------------------


async def test_a_cancelled_caller_resumes_only_once_its_held_copy_landed() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        task = asyncio.ensure_future(engine.to_device(tier, slots, [stage.address, stage.address + SLOT]))
        await bounded(recording.wait_issued(1))
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done(), "the caller regained its buffers while the copy was in flight"
        assert len(tier.copies) == 1 and len(stage.copies) == 1
        recording.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        assert len(tier.copies) == 0 and len(stage.copies) == 0
        assert engine.statistics().jobs_completed == 1


async def test_a_failed_copy_reaches_its_caller_and_leaves_nothing_tracked() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        pages = [stage.address, stage.address + SLOT]
        call = asyncio.ensure_future(engine.to_device(tier, slots, pages))
        await bounded(recording.wait_issued(1))
        recording.fail(RuntimeError("the copy failed"))
        with pytest.raises(RuntimeError, match="the copy failed"):
            await bounded(call)
        recording.hold = False
        recording.fail_issue = OSError("refused")
        with pytest.raises(OSError, match="refused"):
            await bounded(engine.to_host(tier, slots, pages))
        assert len(tier.copies) == 0 and len(stage.copies) == 0
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == 2
        assert stats.descriptors_submitted == 1  # the refused job was never issued
        await bounded(engine.to_host(tier, slots, pages))  # the engine goes on


async def test_a_close_waits_for_held_jobs_and_leaves_no_thread() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        call = asyncio.ensure_future(engine.to_device(tier, slots, [stage.address, stage.address + SLOT]))
        await bounded(recording.wait_issued(1))
        closing = asyncio.ensure_future(engine.aclose())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done() and not call.done()
        recording.release()
        await bounded(closing)
        await bounded(call)
        assert engine.statistics().jobs_completed == 1
    await wait_no_library_threads()


# -- checked once, copied in parts --------------------------------------------------------------


async def test_pages_are_checked_once_and_started_in_parts() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = await tier.allocate(4)
        pages = engine.pages([stage.address + i * SLOT for i in range(4)], 4, page=SLOT, writable=True)
        assert isinstance(pages, Pages) and len(pages) == 4 and pages.page == SLOT and pages.regions == (stage,)
        part = pages.take([3, 1])
        assert part.addresses.tolist() == [stage.address + 3 * SLOT, stage.address + SLOT]
        started = engine.start(tier, slots[:2], part, "h2d", report_issue=True)
        await bounded(started.submitted)
        assert not started.done.done() and len(stage.copies) == 1
        quiet = engine.start(tier, slots[2:], pages.take([0, 2]), "d2h")
        assert quiet.submitted is quiet.done  # no report of the issue: one crossing less
        recording.hold = False  # the second job lands by itself if not issued yet
        recording.release()
        await bounded(asyncio.gather(started.done, quiet.done))
        assert [job.direction for job in recording.issued] == ["h2d", "d2h"]
        assert recording.issued[0].dsts == (stage.address + 3 * SLOT, stage.address + SLOT)


async def test_pages_refuse_what_start_cannot_copy() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        addresses = [stage.address, stage.address + SLOT]
        with pytest.raises(TypeError, match="page="):
            engine.pages(addresses, 2, writable=True)
        with pytest.raises(TypeError, match="bool"):
            engine.pages(addresses, True, page=SLOT, writable=True)
        source = engine.pages(addresses, 2, page=SLOT, writable=False)
        with pytest.raises(ValueError, match="source"):
            engine.start(tier, slots, source, "h2d")
        with pytest.raises(TypeError, match="pages"):
            engine.start(tier, slots, addresses, "d2h")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="one address per slot"):
            engine.start(tier, slots, source.take([0]), "d2h")
        assert recording.issued == []


async def test_checked_pages_are_located_again_only_after_a_snapshot() -> None:
    """Pages in a StaticHostMem keep their check until some region closes or shrinks (which moves
    the regions' generation); then they are located again, and a close of their own region refuses them."""
    async with rig() as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        pages = engine.pages(np.arange(2) * SLOT + stage.address, 2, page=SLOT, writable=True)
        assert pages.checked_at is not None  # a StaticHostMem's check holds until a snapshot
        await bounded(engine.start(tier, slots, pages, "h2d").done)
        other = await bounded(StaticHostMem.open(SLOT))
        await bounded(other.aclose())  # a snapshot elsewhere: located again, still copied
        await bounded(engine.start(tier, slots, pages, "h2d").done)
        await bounded(stage.aclose())
        with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
            engine.start(tier, slots, pages, "h2d")
        assert len(recording.issued) == 2
        in_tier = engine.pages([tier.address(s) for s in slots], 2, page=SLOT, writable=False)
        assert in_tier.checked_at is None  # a tier's check is made again before each copy


async def test_pages_made_or_replaced_by_hand_are_located_before_a_copy() -> None:
    """``Pages`` built by hand, or a checked one with its addresses replaced, carry no check: a
    host-to-host engine refuses addresses in no tier or StaticHostMem rather than memmove there, and
    takes those in one as if just checked."""
    async with rig() as (tier, stage, engine, recording):
        slots = await tier.allocate(2)
        outside = np.zeros(2 * SLOT, dtype=np.uint8)  # the caller's own memory: in no region
        nowhere = np.arange(2, dtype=np.uint64) * np.uint64(SLOT) + np.uint64(outside.ctypes.data)
        checked = engine.pages(np.arange(2) * SLOT + stage.address, 2, page=SLOT, writable=True)
        for forged in (
            Pages(nowhere, SLOT, ()),
            dataclasses.replace(checked, addresses=nowhere),
            dataclasses.replace(checked.take([1, 0]), addresses=nowhere),
        ):
            with pytest.raises(CopyPlanError, match="lies in no open HostTier or StaticHostMem"):
                engine.start(tier, slots, forged, "h2d")
        assert recording.issued == [] and (outside == 0).all()
        by_hand = Pages(np.arange(2, dtype=np.uint64) * np.uint64(SLOT) + np.uint64(stage.address), SLOT, ())
        await bounded(engine.start(tier, slots, by_hand, "h2d").done)  # located now: in the staging buffer
        assert len(recording.issued) == 1 and recording.issued[0].dsts == (stage.address,)  # one run of two pages


def test_an_issued_copy_is_a_plain_record() -> None:
    copy = IssuedCopy(0, "h2d", (1,), (2,), (3,), 1, (1,), None)
    assert copy == IssuedCopy(0, "h2d", (1,), (2,), (3,), 1, (1,), None)
    assert "held" in repr(RecordingBackend())


def test_a_given_backend_takes_no_default_backend_settings() -> None:
    with pytest.raises(ValueError, match="default backend"):
        CopyEngine(None, method="dma", backend=RecordingBackend())
    with pytest.raises(ValueError, match="default backend"):
        CopyEngine(0, sm_options=SmOptions(pdl=False), backend=RecordingBackend())
    with pytest.raises(TypeError, match="CopyBackend"):
        CopyEngine(None, backend=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SmOptions"):
        CopyEngine(0, sm_options={"pdl": False})  # type: ignore[arg-type]
    engine = CopyEngine(0, max_batch=8, backend=RecordingBackend())
    assert engine.method == "dma" and engine.statistics().max_batch == 8


def test_sm_options_keep_the_measured_defaults_and_refuse_an_empty_slice() -> None:
    options = SmOptions()
    assert (options.slice_bytes, options.alternate) == (8 << 20, False)
    assert options.bounded and options.head and options.pack and options.pdl and options.split_runs
    with pytest.raises(ValueError, match="slice_bytes"):
        SmOptions(slice_bytes=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.pdl = False  # type: ignore[misc]


# -- the CUDA backend's wiring, over a model of the driver -----------------------------------------


class _Err(int):
    @property
    def name(self) -> str:
        return "CUDA_SUCCESS" if self == 0 else "CUDA_ERROR_INJECTED"


class ModelDriver:
    """What the CUDA backend asks of the driver with ``method="dma"``: handles are counters, every
    stream and event is remembered until destroyed, and an event's wait may be made to fail."""

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    class CUevent_flags:
        CU_EVENT_BLOCKING_SYNC = 1
        CU_EVENT_DISABLE_TIMING = 2

    def __init__(self) -> None:
        self._next = itertools.count(100)
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.created_events = 0
        self.log: list[tuple[Any, ...]] = []
        self.fail_sync: set[int] = set()
        self.contexts = 0

    def _made(self, into: set[int]) -> tuple[_Err, int]:
        handle = next(self._next)
        into.add(handle)
        return _Err(0), handle

    def cuDeviceGetCount(self) -> tuple[_Err, int]:
        return _Err(0), 1

    def cuDeviceGet(self, device: int) -> tuple[_Err, int]:
        return _Err(0), device

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple[_Err, int]:
        self.contexts += 1
        return _Err(0), 7

    def cuDevicePrimaryCtxRelease(self, device: int) -> tuple[_Err]:
        self.contexts -= 1
        return (_Err(0),)

    def cuCtxSetCurrent(self, ctx: int) -> tuple[_Err]:
        return (_Err(0),)

    def cuCtxPushCurrent(self, ctx: int) -> tuple[_Err]:
        return (_Err(0),)

    def cuCtxPopCurrent(self) -> tuple[_Err, int]:
        return _Err(0), 7

    def cuStreamCreate(self, flags: int) -> tuple[_Err, int]:
        return self._made(self.streams)

    def cuStreamDestroy(self, stream: int) -> tuple[_Err]:
        self.streams.remove(stream)
        return (_Err(0),)

    def cuEventCreate(self, flags: int) -> tuple[_Err, int]:
        self.created_events += 1
        return self._made(self.events)

    def cuEventDestroy(self, event: int) -> tuple[_Err]:
        self.events.remove(event)
        return (_Err(0),)

    def cuEventRecord(self, event: int, stream: int) -> tuple[_Err]:
        self.log.append(("record", event, int(stream), threading.current_thread().name))
        return (_Err(0),)

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[_Err]:
        self.log.append(("wait", event, int(stream)))
        return (_Err(0),)

    def cuEventQuery(self, event: int) -> tuple[_Err]:
        return (_Err(0),)

    def cuEventSynchronize(self, event: int) -> tuple[_Err]:
        return (_Err(1 if event in self.fail_sync else 0),)

    def cuStreamSynchronize(self, stream: int) -> tuple[_Err]:
        self.log.append(("sync", int(stream)))
        return (_Err(0),)


class ModelBatch:
    """Stands in for ``BatchCall``: records each call's descriptors and stream."""

    calls: ClassVar[list[tuple[str, int, int]]] = []
    refuse_at: ClassVar[int | None] = None
    """The number of the call (from 1) that the driver refuses, if any."""

    def __init__(self, function: Any, abi: Any, direction: str, device: int) -> None:
        self.direction = direction

    def __call__(self, dsts: Any, srcs: Any, sizes: Any, stream: Any) -> None:
        if ModelBatch.refuse_at == len(ModelBatch.calls) + 1:
            raise CudaError("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE", 1)
        ModelBatch.calls.append((self.direction, len(dsts), int(stream)))


@pytest.fixture
def model_driver(monkeypatch: pytest.MonkeyPatch) -> ModelDriver:
    from aiokvtier._cuda import _backend, _driver

    model = ModelDriver()
    monkeypatch.setattr(_driver, "driver", lambda: model)
    monkeypatch.setattr(_backend, "resolve_batch_function", lambda drv: (None, 13000))
    monkeypatch.setattr(_backend, "BatchCall", ModelBatch)
    monkeypatch.setattr(ModelBatch, "calls", [])
    monkeypatch.setattr(ModelBatch, "refuse_at", None)
    return model


async def test_the_cuda_backend_issues_on_its_streams_and_reuses_its_events(model_driver: ModelDriver) -> None:
    """Calls cut at ``max_batch`` on the streams in turn, an event recorded per job and reused once
    it fired, ``after=`` a stream marked on the caller's thread and waited for on the copy's
    stream, and at close every stream, event and the context given back."""
    model = model_driver
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(6)
        engine = CopyEngine(0, method="dma", max_batch=4)
        async with engine:
            streams = set(model.streams)
            assert len(streams) == 2 and model.contexts == 1
            every_other = [DEVICE + 2 * i * SLOT for i in range(6)]
            await bounded(engine.to_device(tier, slots, every_other))
            await bounded(engine.to_host(tier, slots, every_other, after=0x5))
            await bounded(engine.copy([(DEVICE, tier.address(slots[0]), SLOT)]))
            expect = [("h2d", 4), ("h2d", 2), ("d2h", 4), ("d2h", 2), ("any", 1)]
            assert [(d, n) for d, n, _ in ModelBatch.calls] == expect
            used = [s for _, _, s in ModelBatch.calls]
            assert used[0] == used[1] != used[2] == used[3] != used[4] and set(used) == streams
            marker = next(e for kind, e, s, *_ in model.log if kind == "record" and s == 0x5)
            assert ("record", marker, 0x5, threading.current_thread().name) in model.log
            assert ("wait", marker, used[2]) in model.log and marker not in model.events
            assert model.created_events == 2  # the marker, and one completion event used three times
            stats = engine.statistics()
            assert stats.driver_calls == 5 and stats.batch_abi == 13000 and stats.jobs_completed == 3
    assert not model.streams and not model.events and model.contexts == 0


async def test_a_plan_refused_after_some_calls_waits_for_them_before_its_caller_sees_the_error(
    model_driver: ModelDriver,
) -> None:
    """The calls issued before the refused one (or part of it) still copy: the caller regains its
    buffers (and the error) only once the stream has run them."""
    model = model_driver
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(6)
        every_other = [DEVICE + 2 * i * SLOT for i in range(6)]
        async with CopyEngine(0, method="dma", max_batch=2) as engine:
            ModelBatch.refuse_at = 2
            with pytest.raises(CudaError, match="cuMemcpyBatchAsync"):
                await bounded(engine.to_device(tier, slots, every_other))
            assert [(d, n) for d, n, _ in ModelBatch.calls] == [("h2d", 2)]
            assert model.log[-1] == ("sync", ModelBatch.calls[0][2])
            ModelBatch.refuse_at = len(ModelBatch.calls) + 1  # the plan's first call
            with pytest.raises(CudaError):
                await bounded(engine.to_device(tier, slots, every_other))
            assert model.log[-1][0] == "sync"
            ModelBatch.refuse_at = None
            await bounded(engine.to_device(tier, slots, every_other))  # the engine goes on
            assert len(tier.copies) == 0
            stats = engine.statistics()
            assert stats.jobs_submitted == stats.jobs_completed == 3


async def test_a_failed_wait_reaches_the_caller_and_its_event_is_not_reused(model_driver: ModelDriver) -> None:
    model = model_driver
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(1)
        async with CopyEngine(0, method="dma") as engine:
            await bounded(engine.to_device(tier, slots, [DEVICE]))
            (event,) = model.events
            model.fail_sync.add(event)
            with pytest.raises(CudaError, match="cuEventSynchronize"):
                await bounded(engine.to_device(tier, slots, [DEVICE]))
            assert event not in model.events and len(tier.copies) == 0
            await bounded(engine.to_device(tier, slots, [DEVICE]))  # a new event
            assert model.created_events == 2
    assert not model.streams and not model.events and model.contexts == 0


class ModelSmPath:
    """Stands in for ``SmPath``: launches are recorded (or refused), slabs counted out and back."""

    refuse: ClassVar[bool] = False
    made: ClassVar[list[ModelSmPath]] = []
    """Every path made, newest last (the backend keeps its own to itself)."""

    def __init__(self, device: int, budget: int, *, options: Any = None) -> None:
        ModelSmPath.made.append(self)
        self.budget, self.options = budget, options
        self.kernel = None
        self.launched: list[int] = []
        self.out = 0
        self.closed = False

    def submit(self, dsts: Any, srcs: Any, sizes: Any, stream: Any) -> object:
        if ModelSmPath.refuse:
            raise CudaError("cuLaunchKernel", "CUDA_ERROR_INJECTED", 1)
        self.launched.append(len(dsts))
        self.out += 1
        return object()

    def give_back(self, slab: object) -> None:
        self.out -= 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def model_sm(model_driver: ModelDriver, monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """The SM path modelled too; ``problem["device"]``: what the device-side check answers."""
    from aiokvtier._cuda import _backend

    problem: dict[str, str | None] = {"device": None}
    monkeypatch.setattr(_backend, "SmPath", ModelSmPath)
    monkeypatch.setattr(ModelSmPath, "refuse", False)
    monkeypatch.setattr(ModelSmPath, "made", [])
    monkeypatch.setattr(_backend, "device_side_problem", lambda addrs, sizes, device: problem["device"])
    return problem


async def test_auto_sends_pages_to_the_kernel_and_falls_back_to_the_copy_engines(
    model_sm: dict[str, str | None], caplog: pytest.LogCaptureFixture
) -> None:
    """With a crossover that picks the kernel: launched there (the slab back once the event fired);
    a device side the kernel cannot reach goes to the copy engines for that request alone; a
    refused launch turns the kernel off for the engine, with one warning, and copies with the
    copy engines from then on."""
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(2)
        pages = [DEVICE, DEVICE + 2 * SLOT]
        async with CopyEngine(0, crossover={"h2d": 1 << 30, "d2h": 1 << 30}) as engine:
            sm = ModelSmPath.made[-1]
            await bounded(engine.to_device(tier, slots, pages))
            assert sm.launched == [2] and sm.out == 0 and ModelBatch.calls == []
            model_sm["device"] = "address 0x7f0000000000 is no allocation the driver knows"
            await bounded(engine.to_host(tier, slots, pages))
            assert len(ModelBatch.calls) == 1 and engine.statistics().sm_unavailable is None
            model_sm["device"] = None
            ModelSmPath.refuse = True
            await bounded(engine.to_device(tier, slots, pages))
            ModelSmPath.refuse = False
            await bounded(engine.to_device(tier, slots, pages))
            stats = engine.statistics()
            assert sm.launched == [2] and len(ModelBatch.calls) == 3
            assert stats.jobs_by_method == {"sm": 1, "dma": 3} and "a launch failed" in (stats.sm_unavailable or "")
            assert stats.sm_crossover_bytes == {}
            assert sum("SM copy path is off" in r.message for r in caplog.records) == 1
        assert sm.closed


async def test_a_request_for_the_kernel_goes_in_pieces_on_the_streams_in_turn(
    model_driver: ModelDriver, model_sm: dict[str, str | None]
) -> None:
    """``pieces_from``: a request the kernel takes is launched piece by piece (4,096, then 4,904 pages),
    each with its event, on the streams in turn, and its caller returns once every piece's event was
    waited for; the copy engines' requests and those below ``pieces_from`` go whole."""
    model = model_driver
    page = 4 * KiB
    async with HostTier(small_config(slot_size=page)) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(9000)
        every_other = [DEVICE + 2 * i * page for i in range(9000)]  # nothing merges
        kernel = {"h2d": 64 * KiB, "d2h": 64 * KiB}
        async with CopyEngine(0, crossover=kernel, pieces_from=8192) as engine:
            sm = ModelSmPath.made[-1]
            records = len([r for r in model.log if r[0] == "record"])
            await bounded(engine.to_device(tier, slots, every_other))
            assert sm.launched == [4096, 4904] and sm.out == 0 and ModelBatch.calls == []
            made = [(e, s) for kind, e, s, *_ in model.log[records:] if kind == "record"]
            assert len(made) == 2 and made[0][1] != made[1][1]
            await bounded(engine.to_host(tier, slots[:100], every_other[:100]))  # below pieces_from: one launch
            assert sm.launched == [4096, 4904, 100]
            stats = engine.statistics()
            assert stats.jobs_in_pieces == 1 and stats.jobs_completed == 2
            assert stats.jobs_by_method == {"sm": 2, "dma": 0}
        async with CopyEngine(0, method="dma", pieces_from=8192) as dma:
            await bounded(dma.to_device(tier, slots, every_other))
            assert dma.statistics().jobs_in_pieces == 0 and sum(n for _, n, _ in ModelBatch.calls) == 9000


async def test_sm_refuses_a_device_side_it_cannot_reach(model_sm: dict[str, str | None]) -> None:
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(1)
        async with CopyEngine(0, method="sm") as engine:
            model_sm["device"] = "address 0x7f0000000000 is memory of device 1, not 0"
            with pytest.raises(CopyPlanError, match="cannot reach the device side"):
                await bounded(engine.to_device(tier, slots, [DEVICE]))
            ModelSmPath.refuse = True
            model_sm["device"] = None
            with pytest.raises(CudaError, match="INJECTED"):
                await bounded(engine.to_device(tier, slots, [DEVICE]))
            assert ModelBatch.calls == [] and len(tier.copies) == 0
