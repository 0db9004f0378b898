from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
from pydantic import ByteSize, ValidationError

from aiokvtier import CacheConfig, HostTierConfig, QuotaError
from aiokvtier._config import ResolvedHostConfig, default_fill_threads, default_max_quota, parse_quota
from aiokvtier._host._linux import PAGE_SIZE

from .helpers import GiB, KiB, MiB


def test_sizes_accept_strings_and_defaults_resolve() -> None:
    cfg = HostTierConfig(quota="1GiB", max_quota="64GiB")
    assert cfg.quota == GiB and cfg.max_quota == 64 * GiB
    assert cfg.slot_size == 2 * MiB and cfg.fill_chunk == 512 * MiB
    assert cfg.commit_unit == 512 * MiB  # derived: the multiple of slot_size nearest fill_chunk
    assert cfg.numa_node == "auto" and cfg.backing == "auto" and cfg.resolved_backing == "host"
    assert cfg.transparent_huge_pages is False and cfg.allow_remote_numa_fallback is True


def test_commit_unit_derived_as_slot_multiple() -> None:
    cfg = HostTierConfig(quota="1GiB", max_quota="2GiB", slot_size="3MiB", fill_chunk="500MiB")
    assert cfg.commit_unit % cfg.slot_size == 0
    assert abs(cfg.commit_unit - 500 * MiB) <= 3 * MiB


def test_default_max_quota_is_host_memory_capped() -> None:
    cfg = HostTierConfig(quota="2MiB")
    # Host memory, rounded down to whole slots like an explicit max_quota.
    assert cfg.max_quota == default_max_quota() // (2 * MiB) * (2 * MiB) > 0


def test_quota_and_max_quota_round_down_to_whole_slots() -> None:
    cfg = HostTierConfig(quota="1GB", max_quota="500GB", slot_size="2MiB")
    assert cfg.quota == 10**9 // (2 * MiB) * (2 * MiB)
    assert cfg.max_quota == 500 * 10**9 // (2 * MiB) * (2 * MiB)
    assert cfg.max_quota % PAGE_SIZE == 0  # munmap of the reservation needs a page-aligned length
    assert isinstance(cfg.quota, ByteSize) and cfg.quota.human_readable() == "952.0MiB"
    assert HostTierConfig(quota="1GB", max_quota="1GB").max_quota == cfg.quota

    odd = HostTierConfig(quota=3 * 64 * KiB + 4096, max_quota=GiB + 4096, slot_size="64KiB")
    assert odd.quota == 3 * 64 * KiB and odd.max_quota == GiB
    assert odd.model_dump()["quota"] == 3 * 64 * KiB  # the effective value is what the config reports


def test_max_quota_is_compared_with_quota_after_rounding() -> None:
    cfg = HostTierConfig(quota=2 * MiB + 8 * KiB, max_quota=2 * MiB + 4 * KiB)
    assert cfg.quota == cfg.max_quota == 2 * MiB


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(quota=4096), ["quota", "rounds down to zero slots", "slot_size"]),
        (dict(quota="1GiB", max_quota=4096), ["max_quota", "rounds down to zero slots"]),
        (dict(quota="1GiB", max_quota=1 << 64), ["max_quota", "below 2**63"]),
        (dict(quota="1GiB", max_quota=1 << 63), ["max_quota", "below 2**63"]),
        (dict(quota=1 << 63, max_quota=1 << 63), ["quota", "below 2**63"]),
        (dict(quota="1GiB", max_quota="2GiB", slot_size=1 << 63), ["slot_size", "below 2**63"]),
        (dict(quota="1GiB", max_quota="2GiB", fill_chunk=1 << 63), ["fill_chunk", "below 2**63"]),
        (dict(quota="1GiB", max_quota="2GiB", commit_unit=1 << 63), ["commit_unit", "below 2**63"]),
        (dict(quota="1GiB", max_quota="16EiB"), ["max_quota", "below 2**63"]),
        (dict(quota="1GiB", max_quota="0GiB"), ["max_quota", "more than 0"]),
        (dict(quota="1GiB", max_quota=-1), ["max_quota", "more than 0"]),
        (dict(quota="1GiB", max_quota="2 parsecs"), ["max_quota", "not a size"]),
        (dict(quota=True), ["quota", "not bool"]),
        (dict(quota=float(GiB)), ["quota", "not float"]),
        (dict(quota="1GiB", max_quota=2.0 * GiB), ["max_quota", "not float"]),
        (dict(quota="1GiB", max_quota="2GiB", slot_size=True), ["slot_size", "not bool"]),
        (dict(quota="1GiB", max_quota="2GiB", commit_unit=float(MiB)), ["commit_unit", "not float"]),
        (dict(quota="1GiB", max_quota="2GiB", fill_chunk=b"1"), ["fill_chunk", "not bytes"]),
    ],
)
def test_size_rules_name_the_field_and_the_rule(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ValidationError) as info:
        HostTierConfig(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


def test_sizes_just_below_2_63_and_numpy_integers_are_accepted() -> None:
    cfg = HostTierConfig(quota=np.int64(GiB), max_quota=(1 << 63) - 1, slot_size=np.uint32(64 * KiB))
    assert cfg.quota == GiB and cfg.slot_size == 64 * KiB
    assert cfg.max_quota == (1 << 63) - 64 * KiB


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fill_threads", True),
        ("fill_threads", 2.0),
        ("fill_threads", "2"),
        ("fill_threads", np.True_),
        ("device", True),
        ("device", False),
        ("device", 0.0),
        ("device", "0"),
        ("numa_node", False),
        ("numa_node", 0.0),
        ("numa_node", "0"),
        ("numa_node", "any"),
    ],
)
def test_integer_fields_refuse_bool_float_and_strings(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        HostTierConfig(quota="1GiB", max_quota="2GiB", **{field: value})  # type: ignore[arg-type]
    assert f"{field} must be an integer" in str(info.value)


def test_integer_fields_accept_numpy_integers_as_plain_ints() -> None:
    cfg = HostTierConfig(quota="1GiB", max_quota="2GiB", fill_threads=np.int64(3), device=np.uint8(0))
    assert cfg.fill_threads == 3 and type(cfg.fill_threads) is int
    assert cfg.device == 0 and type(cfg.device) is int
    node = HostTierConfig(quota="1GiB", max_quota="2GiB", numa_node=np.int32(0)).numa_node
    assert node == 0 and type(node) is int
    assert HostTierConfig(quota="1GiB", max_quota="2GiB", numa_node=None).numa_node is None
    assert HostTierConfig(quota="1GiB", max_quota="2GiB", device=None).device is None


def test_resolved_holds_plain_values() -> None:
    cfg = HostTierConfig(quota="1GB", slot_size=np.int64(64 * KiB), fill_threads=np.int64(2), device=0, numa_node=None)
    r = cfg.resolved
    assert r == ResolvedHostConfig(
        quota=10**9 // (64 * KiB) * (64 * KiB),
        max_quota=default_max_quota() // (64 * KiB) * (64 * KiB),
        slot_size=64 * KiB,
        fill_chunk=512 * MiB,
        commit_unit=64 * MiB,
        fill_threads=2,
        numa_node=None,
        allow_remote_numa_fallback=True,
        transparent_huge_pages=False,
        device=0,
        backing="register",
    )
    for name in ("quota", "max_quota", "slot_size", "fill_chunk", "commit_unit", "fill_threads", "device"):
        assert type(getattr(r, name)) is int, name  # not ByteSize, not numpy
    assert HostTierConfig(quota="1GiB", max_quota="2GiB").resolved.numa_node == "auto"


def test_resolved_is_built_once_and_frozen() -> None:
    cfg = HostTierConfig(quota="1GiB", max_quota="2GiB")
    assert cfg.resolved is cfg.resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.resolved.quota = 1  # type: ignore[misc]
    assert not hasattr(cfg.resolved, "__dict__")  # slotted


def test_resolved_leaves_equality_hashing_and_serialisation_alone() -> None:
    read = HostTierConfig(quota="1GiB", max_quota="2GiB")
    unread = HostTierConfig(quota="1GiB", max_quota="2GiB")
    dumped, as_json = unread.model_dump(), unread.model_dump_json()
    assert read.resolved.quota == GiB
    assert read == unread and hash(read) == hash(unread)
    assert read.model_dump() == dumped and "resolved" not in dumped
    assert read.model_dump_json() == as_json and "resolved" not in as_json
    assert "resolved" not in repr(read) and "resolved" not in HostTierConfig.model_json_schema()["properties"]
    assert HostTierConfig.model_validate_json(as_json) == read
    assert pickle.loads(pickle.dumps(read)) == read


def test_a_copy_resolves_its_own_values() -> None:
    cfg = HostTierConfig(quota="1GiB", max_quota="2GiB")
    assert cfg.fill_threads is None and cfg.resolved.fill_threads == default_fill_threads()
    assert 1 <= default_fill_threads() <= 8
    assert cfg.model_copy(update={"fill_threads": 4}).resolved.fill_threads == 4
    assert cfg.model_copy().resolved == cfg.resolved


def test_resolved_refuses_an_unvalidated_config() -> None:
    with pytest.raises(ValueError, match="model_construct"):
        _ = HostTierConfig.model_construct(quota=ByteSize(GiB)).resolved


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3 * 64 * KiB + 4096, 3 * 64 * KiB),
        ("1GB", 10**9 // (64 * KiB) * (64 * KiB)),
        ("64KiB", 64 * KiB),
        (np.int64(GiB), GiB),
        (ByteSize(2 * GiB), 2 * GiB),
        (2 * GiB + 64 * KiB - 1, 2 * GiB),  # rounds down to max_quota
    ],
)
def test_parse_quota_rounds_down_to_whole_slots(value: object, expected: int) -> None:
    quota = parse_quota(value, slot_size=64 * KiB, max_quota=2 * GiB)
    assert quota == expected and type(quota) is int


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (True, ["not bool"]),
        (float(GiB), ["not float"]),
        (None, ["not NoneType"]),
        ("lots", ["'lots'", "not a size"]),
        (0, ["more than 0", "0"]),
        (-GiB, ["more than 0", str(-GiB)]),
        (1 << 63, ["below 2**63", str(1 << 63)]),
        ("8EiB", ["below 2**63", "'8EiB'"]),
        (4096, ["zero slots", "4096"]),
        ("63KiB", ["zero slots", "'63KiB'"]),
        (2 * GiB + 64 * KiB, ["exceeds max_quota", str(2 * GiB + 64 * KiB)]),
        ("3GiB", ["exceeds max_quota", "'3GiB'", "open the tier with a larger max_quota"]),  # what to do, too
    ],
)
def test_parse_quota_refusals_name_the_rule_and_the_value(value: object, words: list[str]) -> None:
    with pytest.raises(QuotaError) as info:
        parse_quota(value, slot_size=64 * KiB, max_quota=2 * GiB)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)


def test_parse_quota_agrees_with_the_config() -> None:
    cfg = HostTierConfig(quota="1GB", max_quota="500GB").resolved
    assert parse_quota("1GB", slot_size=cfg.slot_size, max_quota=cfg.max_quota) == cfg.quota
    assert parse_quota("500GB", slot_size=cfg.slot_size, max_quota=cfg.max_quota) == cfg.max_quota


def test_config_is_frozen() -> None:
    cfg = HostTierConfig(quota="1GiB", max_quota="2GiB")
    with pytest.raises(ValidationError):
        cfg.quota = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(quota=0), "quota"),
        (dict(quota=-1), "quota"),
        (dict(quota="1GiB", max_quota=0), "max_quota"),
        (dict(quota="2GiB", max_quota="1GiB"), "max_quota"),
        (dict(quota="1GiB", max_quota="2GiB", slot_size=1000), "slot_size"),
        (dict(quota="1GiB", max_quota="2GiB", slot_size=0), "slot_size"),
        (dict(quota="1GiB", max_quota="2GiB", slot_size="4MiB", commit_unit="2MiB"), "commit_unit"),
        (dict(quota="1GiB", max_quota="2GiB", commit_unit="3MiB"), "commit_unit"),
        (dict(quota="1GiB", max_quota="2GiB", fill_threads=0), "fill_threads"),
        (dict(quota="1GiB", max_quota="2GiB", fill_threads=257), "fill_threads"),
        (dict(quota="1GiB", max_quota="2GiB", fill_chunk=0), "fill_chunk"),
        (dict(quota="1GiB", max_quota="2GiB", numa_node=-1), "numa_node"),
        (dict(quota="1GiB", max_quota="2GiB", numa_node=4096), "numa_node"),
        (dict(quota="1GiB", max_quota="2GiB", device=-1), "device"),
        (dict(quota="1GiB", max_quota="2GiB", backing="disk"), "backing"),
        (dict(quota="1GiB", max_quota="2GiB", colour="blue"), "colour"),
        (dict(quota="64KiB", max_quota="2GiB"), "slot_size"),
    ],
)
def test_invalid_input_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        HostTierConfig(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)


def test_quota_above_host_memory_needs_explicit_max_quota() -> None:
    with pytest.raises(ValidationError, match="set max_quota explicitly") as info:
        HostTierConfig(quota=default_max_quota() + GiB)
    # The bound is MemTotal (or the cgroup's limit), not the memory available now; the first fix is a lower
    # quota: a max_quota set past the memory lets the fill run into the OOM killer.
    assert "exceeds this host's memory" in str(info.value) and "MemTotal" in str(info.value)
    assert "lower quota, or" in str(info.value)
    assert HostTierConfig(quota=default_max_quota() + GiB, max_quota=1 << 44).quota > default_max_quota()


def test_gpu_backing_needs_a_device() -> None:
    with pytest.raises(ValidationError, match="needs a CUDA device"):
        HostTierConfig(quota="1GiB", max_quota="2GiB", backing="register")


def test_cache_config_validates_every_tier(tmp_path: Path) -> None:
    cfg = CacheConfig(
        tiers=[
            {"kind": "gpu", "quota": "8GiB", "device": 0},
            {"kind": "host", "quota": "1GiB", "max_quota": "2GiB"},
            {"kind": "disk", "quota": "100GiB", "path": str(tmp_path)},
        ]
    )
    assert [t.kind for t in cfg.tiers] == ["gpu", "host", "disk"]
    assert isinstance(cfg.tiers[1], HostTierConfig)

    with pytest.raises(ValidationError) as info:
        CacheConfig(
            tiers=[
                {"kind": "gpu", "quota": 0},
                {"kind": "host", "quota": 0},
                {"kind": "disk", "quota": 0, "path": str(tmp_path / "missing")},
            ]
        )
    locs = {err["loc"] for err in info.value.errors()}
    # Every tier was visited: one error per bad field, in one exception.
    assert ("tiers", 0, "gpu", "quota") in locs
    assert ("tiers", 1, "host", "quota") in locs
    assert ("tiers", 2, "disk", "quota") in locs
    assert ("tiers", 2, "disk", "path") in locs


def test_cache_config_refuses_a_file_as_disk_path(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("x")
    with pytest.raises(ValidationError, match="directory"):
        CacheConfig(tiers=[{"kind": "disk", "quota": "1GiB", "path": str(file)}])


@pytest.mark.parametrize("kinds", [["host", "gpu"], ["disk", "host"], ["gpu", "disk", "host"], ["host", "host"], []])
def test_cache_config_refuses_tiers_out_of_order(kinds: list[str], tmp_path: Path) -> None:
    tiers = [{"kind": k, "quota": "1GiB", **({"path": str(tmp_path)} if k == "disk" else {})} for k in kinds]
    for tier in tiers:
        if tier["kind"] == "host":
            tier["max_quota"] = "2GiB"
    with pytest.raises(ValidationError):
        CacheConfig(tiers=tiers)


def test_the_gpu_usable_backings_default_to_64_mib_units() -> None:
    """Measured: the driver stalls the process's mmap calls for as long as it pins or maps a unit."""
    base = {"quota": "1GiB", "max_quota": "1GiB", "device": 0}
    assert HostTierConfig(**base, backing="register").resolved.commit_unit == 64 * 2**20
    assert HostTierConfig(**base, backing="register", slot_size="3MiB").commit_unit == 21 * 3 * 2**20
    assert HostTierConfig(**base, backing="register", commit_unit="128MiB").commit_unit == 128 * 2**20
    assert HostTierConfig(**base, backing="register", fill_chunk="256MiB").commit_unit == 256 * 2**20
    assert HostTierConfig(**base, backing="vmm").commit_unit == 64 * 2**20
    assert HostTierConfig(**base, backing="auto").commit_unit == 64 * 2**20
    assert HostTierConfig(quota="1GiB", max_quota="1GiB", backing="auto").commit_unit == 512 * 2**20
    assert HostTierConfig(quota="1GiB", max_quota="1GiB").commit_unit == 512 * 2**20
    again = HostTierConfig(**base, backing="register")
    assert HostTierConfig.model_validate(again.model_dump()) == again


def test_a_misspelt_field_names_the_one_meant() -> None:
    """pydantic said only "Extra inputs are not permitted" under the misspelt name."""
    with pytest.raises(ValidationError, match=r"HostTierConfig has no field 'max_quta': did you mean 'max_quota'\?"):
        HostTierConfig(quota="1GiB", max_quta="2GiB")  # type: ignore[call-arg]
    with pytest.raises(ValidationError) as caught:  # no near miss: the fields it has; other errors still reported
        HostTierConfig.model_validate({"quota": 0, "zzz": 1})
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [("quota",), ("zzz",)]
    assert "more than 0 bytes" in errors[0]["msg"] and errors[0]["type"] == "value_error"
    assert errors[1]["type"] == "extra_forbidden"
    assert errors[1]["msg"].startswith("HostTierConfig has no field 'zzz': the fields are quota, max_quota, slot_size")
    with pytest.raises(ValidationError) as caught:  # in a whole cache, each tier's and the cache's own
        CacheConfig.model_validate(
            {"tiers": [{"kind": "host", "quota": "1GiB", "max_quota": "1GiB", "fill_thread": 2}], "tier": []}
        )
    messages = {e["loc"]: e["msg"] for e in caught.value.errors()}
    assert messages == {
        ("tiers", 0, "host", "fill_thread"): "HostTierConfig has no field 'fill_thread': did you mean 'fill_threads'?",
        ("tier",): "CacheConfig has no field 'tier': did you mean 'tiers'?",
    }
    with pytest.raises(ValidationError) as caught:  # a bound keeps its context
        HostTierConfig.model_validate({"quota": "1GiB", "max_quota": "1GiB", "fill_threads": 0, "x": 1})
    assert caught.value.errors()[0]["ctx"] == {"ge": 1}


def test_a_max_quota_below_the_quota_says_what_to_change() -> None:
    with pytest.raises(
        ValidationError, match=r"max_quota \(.*\) is below quota \(.*\): raise max_quota or lower quota"
    ):
        HostTierConfig(quota="2GiB", max_quota="1GiB")
