"""The example, the README's code, the demo and the benchmark run as tests (behaviour, not timings)."""

from __future__ import annotations

import itertools
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _run(*args: str, timeout: float = 240) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart_example_runs() -> None:
    out = _run("examples/quickstart.py")
    assert "first slot 0 batch 1 .. 64" in out and "512 MiB resident" in out


def test_readme_python_blocks_run(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        _run(str(script))


def test_demo_reports_first_allocation_and_placement() -> None:
    out = _run("-m", "aiokvtier", "demo", "--quota", "128MiB", "--max-quota", "256MiB")
    report = json.loads(out[out.index("{") :])
    assert report["resident_bytes"] == 128 << 20
    assert report["time_to_first_allocation_ms"] > 0 and report["time_to_full_residency_s"] > 0
    assert "policy" in report["placement"]


def test_host_benchmark_prints_json_side_by_side() -> None:
    out = _run(
        "-m", "aiokvtier.bench", "host", "--sizes", "0.25", "--fill-gib", "0.25", "--repeats", "1",
        "--pairs", "10000", "--ops-gib", "0.5", "--bookkeeping-gib", "0.25",
        "--cold-gib", "0.25", "--cold-repeats", "1", "--cold-threads", "1", "--gib", "0.0625", "--settle", "0",
    )  # fmt: skip
    report = json.loads(out)
    assert list(report["cold"]["arms"]) == ["host_threads1"]
    row = report["time_to_first_allocation"][0]
    assert row["sooner_x"] > 0 and row["upfront_resident_ms"] > 0
    assert {"bare_populate_gib_s", "aiokvtier_threads1_gib_s", "ratio_threads2"} <= set(report["fill_throughput"])
    assert "asyncio" in report["event_loop_lag_during_fill"]
    assert report["bookkeeping"]["slots"] == 4096
    progress = report["fill_progress"]
    assert progress["quota_gib"] == 0.25 and progress["upfront_resident_s"] > 0
    _check_series(progress["aiokvtier_host"], 0.25)


def test_host_request_latency_section_prints_each_size_beside_its_floor_and_the_engines_own_cost() -> None:
    report = json.loads(_run("-m", "aiokvtier.bench", "host", "--quick", "--sections", "request_latency"))
    for loop in ("asyncio", "uvloop"):
        got = report["request_latency"][loop]
        for size in ("1MiB_64KiB", "4MiB_64KiB", "16MiB_64KiB"):
            assert got[size]["engine_ms"] > 0 and got[size]["floor_ms"] > 0 and got[size]["ratio"] > 0
        core = got["engine_core"]
        assert core["request_us"] > 0 and core["floor_us"] > 0 and core["tasks_64_requests_per_s"] > 0
        assert abs(core["over_floor_us"] - (core["request_us"] - core["floor_us"])) < 0.15


def _check_series(series: dict[str, Any], gib: float) -> None:
    """A recorded fill: from nothing to the whole quota, in time order, each point a change."""
    t, resident = series["t_s"], series["resident_gib"]
    assert len(t) == len(resident) >= 2 and t[0] == 0 and resident[0] == 0 and resident[-1] == gib
    assert t == sorted(t) and all(a < b for a, b in itertools.pairwise(resident))
    assert series["full_s"] == t[-1] and series["first_allocation_ms"] > 0


def _check_cold(section: dict[str, Any], arms: list[str]) -> None:
    assert section["loop"] == "asyncio" and section["python"] == platform.python_version()
    assert list(section["arms"]) == arms
    for arm in section["arms"].values():
        assert {"backing", "fill_threads", "cold_ms", "warm_ms_median", "ratio_cold_warm", "goal_ms"} <= set(arm)
        assert set(arm["cold_ms"]) == {"median", "min", "max"}
        assert 0 < arm["cold_ms"]["min"] <= arm["cold_ms"]["median"] <= arm["cold_ms"]["max"]
        assert arm["warm_ms_median"] > 0 and arm["ratio_cold_warm"] > 0 and arm["goal_ms"] == 30


def test_host_benchmark_cold_section_reports_cold_beside_warm() -> None:
    out = _run(
        "-m", "aiokvtier.bench", "host", "--sections", "cold",
        "--cold-gib", "1", "--cold-repeats", "1", "--cold-threads", "1", "2",
    )  # fmt: skip
    report = json.loads(out)
    assert list(report) == ["mode", "machine", "cold"]
    cold = report["cold"]
    assert cold["quota_gib"] == 1 and cold["slot_mib"] == 2 and cold["repeats"] == 1
    assert "cuda_context" not in cold
    _check_cold(cold, ["host_threads1", "host_threads2"])
    assert [a["fill_threads"] for a in cold["arms"].values()] == [1, 2]


def test_host_benchmark_refuses_an_unknown_section() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aiokvtier.bench", "host", "--sections", "cold", "nope"],
        capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode != 0 and "unknown sections ['nope']" in done.stderr and "cold" in done.stderr


HELP_CHECK = """
import importlib, json, sys, threading
from aiokvtier.bench.__main__ import _PROGRAMS, main, parse

mode = sys.argv[1]
try:
    main([mode, "--help"])
except SystemExit as exit:
    code = exit.code
loaded = sorted(m for m in sys.modules if m == "cuda" or m.startswith(("cuda.", "torch")))
threads = threading.active_count()
# The names as the program gets them: its sections(args) over the parsed command line (bench()).
names = list(importlib.import_module(_PROGRAMS[mode], "aiokvtier.bench").sections(parse([mode], "bench")))
print(json.dumps({"code": code, "cuda": loaded, "threads": threads, "names": names}))
"""


@pytest.mark.parametrize("mode", ["host", "cuda", "store"])
def test_bench_help_lists_every_section_it_runs_without_importing_cuda(mode: str) -> None:
    """``bench MODE --help`` names each section ``--sections`` takes, in the order they run (read from the
    table the program runs), and imports no CUDA binding and starts no thread to say so."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_CHECK, mode], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    help_text, _, last = done.stdout.rstrip().rpartition("\n")
    got = json.loads(last)
    assert got["code"] == 0 and got["cuda"] == [] and got["threads"] == 1, got
    assert len(got["names"]) > 1
    option = re.search(r"\n  --sections .*?(?=\n  -|\n\n|$)", help_text, re.S)
    assert option, help_text
    listed = re.search(r"in this order: (.*?) \(default:", " ".join(option.group(0).split()))
    assert listed and listed.group(1).split(", ") == got["names"], option.group(0)


@pytest.mark.cuda
def test_cuda_benchmark_copy_and_cold_sections_print_json_side_by_side() -> None:
    out = _run("-m", "aiokvtier.bench", "cuda", "--quick", "--sections", "copy_bandwidth", "cold")
    report = json.loads(out)
    cold = report["cold"]
    assert cold["quota_gib"] == 2 and cold["repeats"] == 1 and cold["cuda_context"] in ("torch", "cuda-bindings")
    _check_cold(cold, [f"{b}_threads{k}" for b in ("host", "register", "vmm") for k in (1, 4)])
    study = json.loads(_run(str(ROOT / "benchmarks" / "copy_submission.py"), "--gib", "0.25", "--rounds", "1"))
    for direction in ("h2d", "d2h"):
        arms = study[direction]
        assert {"bare_ramp_128_to_1024", "plain_batch_CUdeviceptr_1024", "engine_list_ids"} <= set(arms)
        assert all(arm["best_GBps"] > 0 for arm in arms.values())
        assert arms["bare_calls_of_1024"]["first_call_ms"] > 0
    row = report["copy_bandwidth"]["vmm"]["slot_64KiB_shuffled"]
    assert row["h2d"]["aiokvtier_GBps"] > 0 and row["h2d"]["x_vs_plain_batch"] is not None


@pytest.mark.cuda
def test_cuda_benchmark_fill_sections_time_default_tiers_with_a_probe() -> None:
    report = json.loads(
        _run("-m", "aiokvtier.bench", "cuda", "--quick", "--sections", "fill_throughput", "full_tier", "fill_progress")
    )
    progress = report["fill_progress"]
    assert progress["quota_gib"] == 2 and progress["cuMemHostAlloc_s"] > 0
    for backing in ("vmm", "register"):
        _check_series(progress[f"aiokvtier_{backing}"], 2)
    fill = report["fill_throughput"]
    assert {"vmm_threads1", "vmm_threads_default", "register_threads1", "register_threads_default"} <= set(fill)
    assert fill["register_threads1"]["fill_threads"] == 1 and fill["register_threads1"]["commit_unit_mib"] == 64
    full = report["full_tier"]
    assert full["size_gib"] == 2 and full["auto"]["backing"] in ("register", "vmm")
    for backing in ("auto", "register", "vmm"):
        row = full[backing]
        assert row["seconds"] > 0 and row["registered_gib"] == 2 and isinstance(row["meets_goal"], bool)
        assert {"blocked_fraction", "p99_ms", "worst_stall_ms"} <= set(row)


def test_store_benchmark_quick_prints_json_side_by_side() -> None:
    report = json.loads(_run("-m", "aiokvtier.bench", "store", "--quick"))
    assert list(report) == ["mode", "machine", "lookup", "bookkeeping", "cpu_copies", "gpu_copies", "churn", "tiers"]
    lru = report["lookup"]["lru"]
    assert lru["prefix"] == 4096 and lru["key_bytes"] == 32
    for arm in ("store_all_hit", "dict_scan_all_hit", "store_half_hit", "dict_scan_half_hit"):
        assert set(lru[arm]) == {"median_us", "p99_us"}
    book = report["bookkeeping"]["lru"]
    assert book["blocks"] == 65536 and book["goal_bytes_per_block"] == 200
    assert 0 < book["store_bytes_per_block"] < book["with_keys_bytes_per_block"]
    assert any("_store/_store.py" in name for name in book["by_file_bytes"])
    cpu = report["cpu_copies"]
    assert cpu["blocks"] == 512 and cpu["ratio_store_vs_memmove"] > 0 and cpu["memmove_in_plus_out_ms"] > 0
    gpu = report["gpu_copies"]
    assert "skipped" in gpu or all(
        gpu[m]["loaded_equals_stored"] and gpu[m]["ratio_store_vs_engine"] > 0 for m in ("dma", "auto")
    )
    churn = report["churn"]
    assert churn["working_set_blocks"] == 2 * churn["capacity_blocks"]
    for trace in ("zipf", "zipf_with_scans"):
        row = churn[trace]
        policies = [k for k in row if k.startswith("store_")]
        assert "store_lru" in policies and len(policies) + len(churn["policies_unavailable"]) == 2
        assert 0 < row["ordereddict_lru_hit_rate"] < 1
        assert all(0 < row[p]["hit_rate"] < 1 for p in policies)
        # The same trace, the same capacity, the same order: LRU is LRU.
        assert row["store_lru"]["hit_rate"] == row["ordereddict_lru_hit_rate"]
    tiers = report["tiers"]
    assert tiers["threads"] == 4 and [row["block_bytes"] for row in tiers["disk"]] == [64 << 10, 2 << 20]
    for row in tiers["disk"]:
        assert set(row["gb_per_s"]) == {"raw_write", "raw_read", "tier_write", "tier_read"}
        assert row["write_ratio"] > 0 and row["read_ratio"] > 0 and isinstance(row["direct_io"], bool)
        assert set(row["cpu_us_per_block"]) == set(row["gb_per_s"])
        assert all(cpu["user"] >= 0 and cpu["sys"] >= 0 for cpu in row["cpu_us_per_block"].values())
    assert tiers["reopen"]["blocks"] == 10_000 and tiers["reopen"]["reopen_s"] > 0
    assert set(tiers["prefix_load"]["ms"]) == {"combined", "disk_read_alone", "host_load_alone"}
    assert tiers["prefix_load"]["breakdown_ms"]["load_done"] > 0
    assert tiers["prefix_load"]["ratio_vs_sum_of_parts"] > 0


def test_store_benchmark_prefix_section_times_the_pieces_of_the_load() -> None:
    report = json.loads(_run("-m", "aiokvtier.bench", "store", "--quick", "--sections", "prefix"))
    assert list(report) == ["mode", "machine", "prefix"]
    host = report["prefix"]["prefix_load"]
    assert set(host["ms"]) == {"combined", "disk_read_alone", "host_load_alone"} and host["ratio_vs_sum_of_parts"] > 0
    times = host["breakdown_ms"]
    assert set(times) == {"first_piece_landed", "last_piece_landed", "load_done", "copy_after_last_read"}
    assert 0 < times["first_piece_landed"] <= times["last_piece_landed"] <= times["load_done"]


def test_store_benchmark_keeps_mooncakes_info_lines_off_its_progress() -> None:
    """The bench set GLOG_minloglevel, which the wheel ignores: its info lines filled the progress."""
    from aiokvtier._mooncake import _client

    if (why := _client.why_unloadable()) is not None or _client.find_master() is None:
        pytest.skip(why or "mooncake_master is not installed")
    env = {k: v for k, v in ENV.items() if k != "MC_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "aiokvtier.bench", "store", "--quick", "--sections", "tiers"],
        capture_output=True, text=True, env=env, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "skipped" not in json.loads(done.stdout)["tiers"]["mooncake"]
    info = [line for line in done.stderr.splitlines() if re.match(r"I\d{4} ", line)]
    assert not info, info[:3]


def test_engine_mock_example_hits_evicts_and_verifies() -> None:
    out = _run("examples/engine_mock.py")
    assert out.startswith("pages: ")
    rounds = re.findall(r"round (\d): (\d+) blocks asked, (\d+) hits", out)
    assert [r[0] for r in rounds] == ["1", "2", "3", "4", "5"]
    assert rounds[0][2] == "0" and all(int(hits) > 0 for _, _, hits in rounds[1:])
    evicted = int(re.search(r"(\d+) evicted, ", out).group(1))  # type: ignore[union-attr]
    assert evicted > 0
    assert "agrees with the store: True" in out
    assert re.search(r"verified: [1-9]\d* loaded blocks equal what was stored", out)


def _no_cuda_device() -> bool:
    from aiokvtier import CudaUnavailableError
    from aiokvtier._cuda._driver import device_count

    try:
        return device_count() == 0
    except CudaUnavailableError:
        return True


@pytest.mark.parametrize("hidden", [True, False], ids=["devices-hidden", "as-is"])
def test_engine_offload_skips_in_one_line_without_a_cuda_device(hidden: bool) -> None:
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""} if hidden else ENV
    if not hidden and not _no_cuda_device():
        pytest.skip("a CUDA device is present here: the cuda-marked test runs the example")
    done = subprocess.run(
        [sys.executable, "examples/engine_offload.py", "--quota", "1GiB"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("engine_offload: skipped: no CUDA device"), done.stdout
    assert "Traceback" not in done.stderr


def _check_offload(report: dict[str, Any], quota: int) -> None:
    page = report["page_bytes"]
    assert report["quota_bytes"] == quota and report["backing"] in ("register", "vmm")
    assert report["mismatches"] == 0 and report["blocks_onboarded"] > 0
    assert report["blocks_verified"] == report["blocks_onboarded"]
    assert report["blocks_offloaded"] > 0 and report["hits"] >= report["blocks_onboarded"]
    assert report["bytes_offloaded"] == report["blocks_offloaded"] * page
    assert report["bytes_onboarded"] == report["blocks_onboarded"] * page
    # Whole pages both ways: offloads are to_host (d2h), onboards to_device (h2d), nothing raw.
    assert report["copy_bytes_by_direction"] == {
        "h2d": report["bytes_onboarded"], "d2h": report["bytes_offloaded"], "any": 0,
    }  # fmt: skip
    assert report["turns"][-1]["hits"] > 0


@pytest.mark.cuda
def test_engine_offload_offloads_and_onboards_bit_exact_while_the_tier_fills() -> None:
    # 16 GiB: the default backing (register) fills about 17 GiB/s on the H200 machine, and the
    # first offload comes about 0.35 s after the open; a 2 GiB tier was resident by then.
    report = json.loads(_run("examples/engine_offload.py", "--quota", "16GiB"))
    _check_offload(report, 16 << 30)
    first = report["first_offload"]
    assert first["tier_filling"] and 0 < first["resident_bytes"] < 16 << 30, first
    assert report["store"]["evictions"] == 0 and report["lost_to_eviction"] == 0


@pytest.mark.cuda
def test_engine_offload_under_a_small_quota_evicts_and_still_verifies() -> None:
    # 1024 slots for 4000-odd blocks: stores evict, returning prefixes are partly gone.
    report = json.loads(_run("examples/engine_offload.py", "--quota", "64MiB"))
    _check_offload(report, 64 << 20)
    assert report["store"]["evictions"] > 0
    assert report["store"]["blocks"] <= report["store"]["capacity"] == 1024


def test_server_during_fill_benchmark_prints_both_runs_and_their_ratio() -> None:
    out = _run("benchmarks/server_during_fill.py", "--quota", "256MiB", "--clients", "4", "--seconds", "0.5")
    report = json.loads(out)
    for run in ("during_fill", "once_resident"):
        assert report[run]["unexpected_answers"] == 0
        assert {"PUT", "GET", "lookup"} <= set(report[run]["endpoints"])
    assert set(report["p99_during_vs_resident"]) >= {"PUT", "GET", "lookup"}
    assert report["server_exit"] == 0 and report["goal_ratio_at_most"] == 2.0


def test_server_vs_dict_benchmark_prints_both_servers_and_their_ratio() -> None:
    out = _run(
        "benchmarks/server_vs_dict.py", "--quota", "256MiB", "--clients", "2", "--seconds", "0.3", "--rounds", "2"
    )
    report = json.loads(out)
    assert set(report["runs"]) == {"blockstore", "plain_dict"} and report["tier_resident_before_load"]
    for name, run in report["runs"].items():
        assert run["unexpected_answers"] == 0 and run["server_exit"] == 0, name
        assert {"PUT", "GET", "lookup"} <= set(run["endpoints"])
        assert len(report["requests_per_s_by_round"][name]) == 2
    assert (
        report["runs"]["blockstore"]["server"] == "BlockStore"
        and report["runs"]["plain_dict"]["server"] == "plain dict"
    )
    assert report["runs"]["blockstore"]["resident_fraction_at_start"] == 1.0
    ratio = report["runs"]["blockstore"]["requests_per_s"] / report["runs"]["plain_dict"]["requests_per_s"]
    assert report["ratio_requests_per_s"] == round(ratio, 3)
    assert set(report["ratio_p99"]) == {"PUT", "GET", "lookup"}
