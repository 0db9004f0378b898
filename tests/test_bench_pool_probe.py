"""The executor_responsiveness arm of one pool shared by many processes (``bench._pool_probe``): its figures.

Without a device the attached processes run everything but CUDA (the probe
times a call that does nothing); on a GPU each registers the whole pool in
its own context. Times are checked for sense, never against a bound.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest

from aiokvtier.bench._pool_probe import GOAL_BLOCKED_FRACTION, GOAL_GIB_S, GOAL_WORST_STALL_MS, pool_contention
from aiokvtier.bench._probe import Probe

from .test_programs import _run

MiB = 1 << 20

SUMMARY = {
    "processes",
    "pool_gib",
    "owner_backing",
    "device",
    "slot_kib",
    "commit_unit_mib",
    "owner_fill_s",
    "wall_s",
    "pool_usable_everywhere_gib_s",
    "aggregate_gib_s",
    "per_process_gib_s_median",
    "per_process_gib_s_min",
    "first_slot_ms_median",
    "first_slot_ms_max",
    "registered_everywhere",
    "blocked_fraction_max",
    "p99_ms_max",
    "worst_stall_ms",
    "after_worst_stall_ms",
    "close_ms_max",
    "goal",
    "meets_goal",
    "per_process",
}
PER_PROCESS = {
    "rank",
    "attach_ms",
    "first_slot_ms",
    "usable_s",
    "gib_s",
    "registered_bytes",
    "pool_bytes",
    "close_ms",
    "blocked_fraction",
    "p99_ms",
    "worst_stall_ms",
    "after_worst_stall_ms",
    "attach_after_open_ms",
    "usable_after_open_s",
}


def _check(report: dict[str, Any], processes: int, size: int, registered: int) -> None:
    assert set(report) == SUMMARY
    assert report["processes"] == processes and report["pool_gib"] == size / (1 << 30)
    assert report["goal"] == {
        "pool_usable_everywhere_gib_s": GOAL_GIB_S,
        "worst_stall_ms": GOAL_WORST_STALL_MS,
        "blocked_fraction": GOAL_BLOCKED_FRACTION,
    }
    assert (GOAL_GIB_S, GOAL_WORST_STALL_MS, GOAL_BLOCKED_FRACTION) == (12.0, 20.0, 0.05)
    assert isinstance(report["meets_goal"], bool)
    rows = report["per_process"]
    assert [r["rank"] for r in rows] == list(range(processes))
    for r in rows:
        assert set(r) == PER_PROCESS
        assert 0 < r["attach_ms"] <= r["first_slot_ms"] <= r["usable_s"] * 1e3 + 0.1  # rounded apart
        assert r["pool_bytes"] == size and r["registered_bytes"] == registered
        assert r["gib_s"] > 0 and r["close_ms"] > 0 and r["attach_after_open_ms"] > 0
        assert 0 < r["usable_after_open_s"] <= report["wall_s"]
        assert 0 <= r["p99_ms"] <= r["worst_stall_ms"] and 0 <= r["blocked_fraction"] < 1
        assert r["after_worst_stall_ms"] >= 0
    assert report["wall_s"] == pytest.approx(max(r["usable_after_open_s"] for r in rows), abs=1e-3)
    assert report["owner_fill_s"] > 0
    usable = report["pool_usable_everywhere_gib_s"]
    assert usable == pytest.approx(size / (1 << 30) / report["wall_s"], rel=0.02)
    assert report["aggregate_gib_s"] == pytest.approx(processes * usable, rel=0.01)
    assert report["worst_stall_ms"] == max(r["worst_stall_ms"] for r in rows)
    assert report["blocked_fraction_max"] == max(r["blocked_fraction"] for r in rows)
    assert report["per_process_gib_s_min"] == min(r["gib_s"] for r in rows)
    meets = usable >= 12 and report["worst_stall_ms"] <= 20 and report["blocked_fraction_max"] <= 0.05
    assert report["meets_goal"] is meets
    assert math.isfinite(json.loads(json.dumps(report))["wall_s"])


def test_the_probe_reports_the_calls_of_its_window_and_those_after_it_apart() -> None:
    probe = Probe(None)  # never started: its samples are set here
    probe.starts, probe.samples = [0.0, 1.0, 1.5, 3.0], [0.5, 0.1, 0.2, 0.3]
    row = probe.report(1.0, 1.0)  # the call at 0.0 came before the window: left out
    assert row == {"blocked_fraction": 0.3, "p99_ms": pytest.approx(199.0), "worst_stall_ms": 200.0,
                   "after_worst_stall_ms": 300.0}  # fmt: skip
    assert probe.report(4.0)["worst_stall_ms"] == 500.0  # no window: every call


def test_the_probe_without_a_device_times_a_call_that_does_nothing() -> None:
    deadline = time.monotonic() + 30  # a probe thread that died must fail the test, not hang it
    with Probe(None) as probe:
        while len(probe.samples) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert len(probe.samples) == len(probe.starts) >= 5
    assert probe.report(1.0)["worst_stall_ms"] >= 0


def test_processes_attached_to_one_pool_report_every_figure_without_a_device() -> None:
    size = 64 * MiB
    report = pool_contention(2, size, "host", device=None)
    _check(report, 2, size, registered=0)
    assert report["owner_backing"] == "host" and report["device"] is None
    assert report["slot_kib"] == 64 and report["commit_unit_mib"] == 64  # as the pool command opens it
    assert report["registered_everywhere"] is False  # nothing registers without a device


def test_a_process_that_fails_is_reported_instead_of_leaving_the_owner_waiting() -> None:
    # Device 99 exists nowhere: the process fails making its context, before the pool opens.
    with pytest.raises(RuntimeError, match="attached process 0 failed"):
        pool_contention(1, 64 * MiB, "host", device=99)


@pytest.mark.cuda
@pytest.mark.parametrize("backing", ["host", "register"])
def test_every_process_registers_the_whole_pool_on_the_gpu(backing: str) -> None:
    size = 256 * MiB
    report = pool_contention(2, size, backing, device=0, commit_unit=64 * MiB)
    _check(report, 2, size, registered=size)
    assert report["owner_backing"] == backing and report["device"] == 0 and report["commit_unit_mib"] == 64
    assert report["registered_everywhere"] is True


@pytest.mark.cuda
def test_the_cuda_benchmark_runs_the_one_pool_arm_beside_the_others() -> None:
    out = _run("-m", "aiokvtier.bench", "cuda", "--quick", "--sections", "executor_responsiveness", timeout=600)
    report = json.loads(out)
    arms = report["executor_responsiveness"]
    assert set(arms) == {"1_process", "8_processes", "8_processes_one_pool"}
    pool = arms["8_processes_one_pool"]
    _check(pool, 8, 1 << 30, registered=1 << 30)
    assert pool["owner_backing"] == "host" and pool["registered_everywhere"] is True
