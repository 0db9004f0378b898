"""The fill benchmark sections run at a tiny size and print JSON of the documented shape (no timings checked)."""

from __future__ import annotations

import json
import math

from .test_programs import _run


def test_neighbours_and_fill_scaling_print_their_json() -> None:
    out = _run(
        "-m", "aiokvtier.bench", "host", "--sections", "neighbours", "fill_scaling", "thp_auto", "slot_operations",
        "--gib", "0.0625", "--repeats", "1", "--settle", "0", "--ops-gib", "0.01", "--pairs", "100",
        "--fragment-gib", "0.0625",
    )  # fmt: skip
    report = json.loads(out)
    neighbours = report["neighbours"]
    arms = neighbours["arms"]
    assert {"tier_host", "populate_512mib_calls", "populate_2mib_calls", "touch_1_thread"} <= set(arms)
    for row in arms.values():
        assert {"fill_gib_s", "probes", "neighbour_p50_ms", "neighbour_p99_ms", "neighbour_max_ms"} <= set(row)
        assert row["fill_gib_s"] > 0
    assert {"goal_p50_ms", "goal_p99_ms", "meets_goal"} <= set(arms["tier_host"])
    for loop in neighbours["loop_lag_allocating_1mib"].values():
        assert set(loop) == {"tier_host_default", "populate_512mib_calls"}
        assert {"n", "p50_ms", "p99_ms", "max_ms"} <= set(loop["tier_host_default"])
    assert set(neighbours["population_counters"]) == {"touched_bytes", "populated_bytes", "copied_bytes"}
    rows = report["fill_scaling"]["rows"]
    assert [(r["pages"], r["threads"]) for r in rows] == [(p, k) for p in ("4k", "thp") for k in (1, 2, 4, 8)]
    for row in rows:
        assert {"raw_touch_gib_s", "raw_populate_gib_s", "tier_host_gib_s", "tier_vs_best_raw"} <= set(row)
        assert row["tier_vs_best_raw"] > 0
    thp = report["thp_auto"]
    assert set(thp["kernel"]) == {"enabled", "defrag"}
    for state in ("as_is", "fragmented"):
        assert {"free_2mib_blocks_before", "off_gib_s", "on_gib_s", "auto_gib_s", "auto_vs_best"} <= set(thp[state])
        assert isinstance(thp[state]["auto_never_loses"], bool)
    # A tier of fewer than 4096 slots still reports its slot operations.
    ops = report["slot_operations"]["asyncio"]
    assert ops["batch_slots"] < 4096 and not math.isnan(ops["allocate_many_4096_plus_free_many_ms"])


def test_busy_loop_prints_idle_and_busy_side_by_side() -> None:
    report = json.loads(
        _run("-m", "aiokvtier.bench", "host", "--sections", "busy_loop", "--gib", "0.0625", "--settle", "0")
    )
    section = report["busy_loop"]
    assert section["size_gib"] == 0.062 and section["deadline_s"] > 0
    host = section["backings"]["host"]
    for arm in ("idle", "busy"):
        assert set(host[arm]) == {"resident_gib", "seconds", "gib_s", "runs_gib_s"}
        assert host[arm]["seconds"] > 0
    assert host["idle"]["resident_gib"] == 0.062 and "busy_vs_idle" in host
