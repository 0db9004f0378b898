"""The Mooncake tier against a real ``mooncake_master`` on loopback ports: round trips, keys, a second
process, the master killed and restarted, hung calls, cancellation, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import CacheConfig, HostTier, MooncakeError, MooncakeTier, MooncakeTierConfig, TierClosedError
from aiokvtier._mooncake import _client
from aiokvtier._mooncake._keys import KeySpace

from .helpers import KiB, MiB, small_config
from .invariants import wait_no_library_threads

pytestmark = pytest.mark.timeout(120)

BLOCK = 64 * KiB


class Master:
    """A ``mooncake_master`` bound to loopback ports, its log in ``log``."""

    def __init__(self, binary: str, log: Path, *flags: str) -> None:
        self.binary = binary
        self.log = log
        self.flags = flags
        """More of ``mooncake_master``'s flags (``--default_kv_lease_ttl=200``)."""
        self.rpc, self.http, self.metrics = _client.loopback_ports(3)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        return [*_client.master_argv(self.binary, self.rpc, self.http, self.metrics), *self.flags]

    def config(self, **overrides: Any) -> MooncakeTierConfig:
        values: dict[str, Any] = dict(
            master=f"127.0.0.1:{self.rpc}",
            metadata_server=f"http://127.0.0.1:{self.http}/metadata",
            local_hostname="127.0.0.1",
            segment_size=64 * MiB,
            local_buffer_size=16 * MiB,
            timeout=10.0,
            open_timeout=30.0,
        )
        values.update(overrides)
        return MooncakeTierConfig(**values)

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mooncake_master exited: {self.log.read_text()[-2000:]}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.rpc), timeout=0.2):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.http), timeout=0.2):
                    return
            time.sleep(0.05)
        raise AssertionError(f"mooncake_master did not listen within 20 s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


def _why_no_mooncake() -> str | None:
    why = _client.why_unloadable()
    if why is not None:
        return why
    if _client.find_master() is None:
        return "mooncake_master is not installed (it comes with the mooncake wheel)"
    return None


def running_master(log: Path, *flags: str) -> Iterator[Master]:
    """A started master for a fixture (skipped where the wheel or the binary is missing); stopped after."""
    why = _why_no_mooncake()
    if why is not None:
        pytest.skip(why)
    binary = _client.find_master()
    assert binary is not None
    m = Master(binary, log, *flags)
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    yield from running_master(tmp_path_factory.mktemp("mooncake") / "master.log")


@pytest.fixture
def own_master(tmp_path: Path) -> Iterator[Master]:
    """A master of this test's own, to kill and restart."""
    yield from running_master(tmp_path / "master.log")


class Pages:
    """Page-aligned anonymous memory, ``n`` blocks of ``BLOCK`` bytes."""

    def __init__(self, n: int) -> None:
        self.map = mmap.mmap(-1, n * BLOCK)
        self.array = np.frombuffer(self.map, dtype=np.uint8).reshape(n, BLOCK)
        self.base = self.array.ctypes.data
        self.size = n * BLOCK

    def addresses(self, ids: range | list[int]) -> list[int]:
        return [self.base + i * BLOCK for i in ids]

    def fill(self, seed: int) -> None:
        self.array[:] = np.random.default_rng(seed).integers(0, 256, self.array.shape, dtype=np.uint8)


def unique(name: str) -> str:
    """A fingerprint no other test (or earlier run against the same master) has used."""
    return f"{name}-{os.getpid()}-{time.monotonic_ns()}"


@contextlib.asynccontextmanager
async def open_tier(
    config: MooncakeTierConfig, fingerprint: str, *memory: Pages, wrap_client: Any = None
) -> AsyncIterator[MooncakeTier]:
    async with MooncakeTier(config, block_size=BLOCK, fingerprint=fingerprint, wrap_client=wrap_client) as tier:
        for pages in memory:
            await tier.register(pages.base, pages.size)
        yield tier


def test_keys_are_deterministic_and_ints_never_meet_bytes() -> None:
    a, b = KeySpace("p", "model"), KeySpace("p", "model")
    assert a.name(1) == b.name(1) and a.name(b"\x01") == b.name(b"\x01")
    assert a.name(1) != a.name(b"\x01") and a.name(-1) != a.name(1) and a.name(b"") != a.name(0)
    assert KeySpace("p", "other").name(1) != a.name(1) and KeySpace("q", "model").name(1) != a.name(1)
    with pytest.raises(TypeError):
        a.name(True)


def test_an_int_of_any_size_has_one_name_whatever_the_process_converts_to_decimal() -> None:
    space = KeySpace("p", "model")
    prefix = space.namespace
    edge = 10**640  # 641 digits: past what a process may limit its decimal text to
    assert space.name(edge - 1) == f"{prefix}i{edge - 1}" and space.name(1 - edge) == f"{prefix}i{1 - edge}"
    assert space.name(edge) == f"{prefix}x{edge:x}" and space.name(-edge) == f"{prefix}x-{edge:x}"
    huge = 10**5000  # past Python's default 4300 digits: its decimal text is a ValueError
    with pytest.raises(ValueError):
        str(huge)
    names = {space.name(k) for k in (huge, -huge, huge + 1, edge, -edge, edge - 1, 1, -1, b"\x01")}
    assert len(names) == 9
    keys = [huge, -huge, edge, edge - 1, 1 - edge]
    expected = space.names(keys)
    assert expected == [f"{prefix}x{huge:x}", f"{prefix}x-{huge:x}", f"{prefix}x{edge:x}"] + [
        f"{prefix}i{k}" for k in keys[3:]
    ]
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)  # the least a process may set: the names do not change
    try:
        assert space.names(keys) == expected
    finally:
        sys.set_int_max_str_digits(before)
    assert KeySpace("p", "model").name(huge) == space.name(huge)


def test_the_config_takes_its_place_after_disk(tmp_path: Path) -> None:
    remote = {"kind": "mooncake", "master": "10.0.0.1:50051", "metadata_server": "http://10.0.0.1:8080/metadata"}
    remote["local_hostname"] = "10.0.0.2"
    config = CacheConfig(tiers=[{"kind": "disk", "quota": "1GiB", "path": tmp_path}, remote])
    assert config.tiers[1].kind == "mooncake"
    with pytest.raises(ValueError, match="ordered gpu, host, disk, mooncake"):
        CacheConfig(tiers=[remote, {"kind": "disk", "quota": "1GiB", "path": tmp_path}])
    with pytest.raises(ValueError, match="rdma_devices"):
        MooncakeTierConfig(**remote, protocol="rdma")
    with pytest.raises(ValueError, match="master"):
        MooncakeTierConfig(**{**remote, "master": "no port"})


async def test_blocks_round_trip_bit_exact_from_and_into_host_tier_slots(master: Master) -> None:
    config = master.config()
    async with HostTier(small_config(slot_size=BLOCK, quota=4 * MiB)) as host:
        await host.wait_resident()
        async with MooncakeTier(config, block_size=BLOCK, fingerprint=unique("slots")) as tier:
            await tier.register(host.base_address, int(host.config.quota))
            slots = await host.allocate(16)
            rng = np.random.default_rng(1)
            data = [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(16)]
            for slot, block in zip(slots, data, strict=True):
                host.view(slot)[:] = block
            keys: list[bytes | int] = [b"k%d" % i for i in range(8)] + list(range(8))
            lengths = [BLOCK] * 8 + [1000 + i for i in range(8)]
            addresses = host.slot_addresses(slots).tolist()
            assert await tier.write(keys, addresses, lengths) == tuple(keys)
            assert await tier.lookup(keys) == 16 and await tier.lookup([b"nope", *keys]) == 0
            back = await host.allocate(16)
            got = await tier.read(keys[::-1], host.slot_addresses(back).tolist(), lengths[::-1])
            assert got == (True,) * 16
            for i, slot in enumerate(back):
                n = lengths[15 - i]
                assert bytes(host.view(slot)[:n]) == data[15 - i][:n]
            s = tier.statistics()
            assert s.available and (s.hits, s.bytes_written, s.bytes_read) == (16, sum(lengths), sum(lengths))
            assert (s.queue_depth, s.held_calls, s.errors) == (0, 0, 0) and s.registered_bytes == 4 * MiB
    await wait_no_library_threads()


async def test_int_and_bytes_keys_are_distinct_and_sizes_are_checked(master: Master) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(2)
    async with open_tier(master.config(), unique("keys"), src, dst) as tier:
        assert await tier.write([1, b"\x01"], src.addresses([0, 1]), [BLOCK, BLOCK]) == (1, b"\x01")
        assert await tier.read([b"\x01", 1], dst.addresses([0, 1])) == (True, True)
        assert np.array_equal(dst.array[0], src.array[1]) and np.array_equal(dst.array[1], src.array[0])
        # a block of another size than expected is a miss, never data
        assert await tier.write([7], src.addresses([2]), [BLOCK // 2]) == (7,)
        assert await tier.read([7, 8], dst.addresses([2, 3])) == (False, False)
        s = tier.statistics()
        assert s.size_mismatches == 1 and s.misses == 2 and s.hits == 2
        assert await tier.read([7], dst.addresses([2]), [BLOCK // 2]) == (True,)
        assert np.array_equal(dst.array[2, : BLOCK // 2], src.array[2, : BLOCK // 2])


_READER = textwrap.dedent(
    """
    import asyncio, hashlib, json, mmap, sys
    import numpy as np
    from aiokvtier import MooncakeTier, MooncakeTierConfig

    async def main():
        config = MooncakeTierConfig.model_validate_json(sys.argv[1])
        block, n = 65536, int(sys.argv[3])
        buf = mmap.mmap(-1, n * block)
        base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        async with MooncakeTier(config, block_size=block, fingerprint=sys.argv[2]) as tier:
            await tier.register(base, n * block)
            got = await tier.read(list(range(n)), [base + i * block for i in range(n)])
        print(json.dumps({"got": list(got), "sha": hashlib.sha256(buf).hexdigest()}), flush=True)

    asyncio.run(main())
    """
)


async def test_a_second_process_reads_bit_exact_what_the_first_wrote(master: Master) -> None:
    import json

    src = Pages(16)
    src.fill(3)
    fingerprint = unique("shared")
    config = master.config()
    async with open_tier(config, fingerprint, src) as tier:
        assert len(await tier.write(list(range(16)), src.addresses(range(16)), [BLOCK] * 16)) == 16
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _READER,
            config.model_dump_json(),
            fingerprint,
            "16",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["got"] == [True] * 16
    assert report["sha"] == hashlib.sha256(src.map).hexdigest()


async def until(condition: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():  # the tier changes state on its own task: poll
        assert time.monotonic() < deadline, f"not {what} within {within} s"
        await asyncio.sleep(0.05)


async def test_the_master_killed_and_restarted_makes_the_tier_unavailable_then_back(
    own_master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(4)
    async with open_tier(own_master.config(), unique("restart"), src, dst) as tier:
        assert len(await tier.write(list(range(4)), src.addresses(range(4)), [BLOCK] * 4)) == 4
        await asyncio.to_thread(own_master.stop)
        # the first call that meets the dead master fails and turns the tier off; nothing raises
        assert await tier.write([100], src.addresses([4]), [BLOCK]) == ()
        await until(lambda: not tier.available, 20, "unavailable")
        assert await tier.read(list(range(4)), dst.addresses(range(4))) == (False,) * 4
        assert await tier.lookup([0]) == 0 and await tier.discard([0]) == 0
        s = tier.statistics()
        assert not s.available and "master" in (s.unavailable_why or "") and s.writes_skipped >= 1
        assert caplog.text.count("Mooncake tier is unavailable") == 1
        await asyncio.to_thread(own_master.start)
        await until(lambda: tier.available, 30, "available again")
        assert tier.statistics().reconnects == 1 and "available again" in caplog.text
        # the restarted master starts empty; the tier stores and serves again
        assert len(await tier.write([5, 6], src.addresses([5, 6]), [BLOCK] * 2)) == 2, tier.statistics()
        assert await tier.read([5, 6], dst.addresses([5, 6])) == (True, True)
        assert np.array_equal(dst.array[5:7], src.array[5:7])
    await wait_no_library_threads()


class Wrapped:
    """The tier's client as ``wrap_client`` hands it over, every call passed through; a subclass
    changes some calls while ``active``."""

    def __init__(self) -> None:
        self.client: Any = None
        self.active = False

    def __call__(self, client: Any) -> Wrapped:
        self.client = client
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class Hanging(Wrapped):
    """While active, ``batch_get_into`` is held until ``gate`` is set."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def batch_get_into(self, *args: Any) -> Any:
        if self.active:
            self.gate.wait(60)
        return self.client.batch_get_into(*args)


async def test_a_hung_call_returns_at_the_timeout_and_holds_its_memory_until_it_ends(master: Master) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(5)
    gate = threading.Event()
    try:
        await hung_call_round(master, src, dst, gate)
    finally:
        gate.set()  # whatever failed: the held call must not outlive the memory it writes into
        await wait_no_library_threads(15)


async def hung_call_round(master: Master, src: Pages, dst: Pages, gate: threading.Event) -> None:
    hanging = Hanging(gate)
    async with open_tier(master.config(timeout=0.3), unique("hung"), src, dst, wrap_client=hanging) as tier:
        assert len(await tier.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)) == 2
        hanging.active = True
        started = time.monotonic()
        assert await tier.read([0, 1], dst.addresses([0, 1])) == (False, False)
        assert time.monotonic() - started < 5
        s = tier.statistics()
        assert s.timeouts == s.held_calls in (1, 2) and (s.held_bytes, s.available) == (2 * BLOCK, False)
        assert set(tier.held) == {(dst.base, BLOCK), (dst.base + BLOCK, BLOCK)}
        with pytest.raises(ValueError, match="held by a call"):
            await tier.read([0], dst.addresses([1]))
        gate.set()
        await until(lambda: not tier.held, 10, "released")
        await until(lambda: tier.available, 10, "available again")
        hanging.active = False
        assert await tier.read([0, 1], dst.addresses([0, 1])) == (True, True)
        assert np.array_equal(dst.array[:2], src.array[:2])


async def test_a_close_while_the_monitor_starts_new_threads_stops_them_too(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung call retires its thread; the health monitor starts replacements. A close that cancels the
    monitor while it starts them must stop them too (they were lost with the cancelled call's result)."""
    from aiokvtier._mooncake import _tier

    starting = threading.Event()
    plain = _tier.Worker

    class SlowWorker(plain):  # type: ignore[misc, valid-type]
        def __init__(self, name: str) -> None:
            if "-io-" in name and hanging.active:
                starting.set()
                time.sleep(0.3)  # the close comes while the monitor is in here
            super().__init__(name)

    monkeypatch.setattr(_tier, "Worker", SlowWorker)
    src, dst = Pages(4), Pages(4)
    src.fill(7)
    gate = threading.Event()
    hanging = Hanging(gate)
    try:
        async with open_tier(master.config(timeout=0.3), unique("monitor"), src, dst, wrap_client=hanging) as tier:
            assert len(await tier.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)) == 2
            hanging.active = True
            assert await tier.read([0, 1], dst.addresses([0, 1])) == (False, False)
            await until(starting.is_set, 10, "the monitor starts new threads")
            await tier.aclose()
    finally:
        gate.set()  # the held calls return, and their retired threads exit
        await wait_no_library_threads(15)


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.01])
async def test_cancelled_writes_and_reads_leave_nothing_held(master: Master, delay: float) -> None:
    src, dst = Pages(32), Pages(32)
    src.fill(6)
    async with open_tier(master.config(), unique("cancel"), src, dst) as tier:
        keys = list(range(32))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tier.write(keys, src.addresses(range(32)), [BLOCK] * 32), delay)
        s = tier.statistics()
        assert (s.queue_depth, s.held_calls) == (0, 0) and s.bytes_written in (0, 32 * BLOCK)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tier.read(keys, dst.addresses(range(32))), delay)
        s = tier.statistics()
        assert (s.queue_depth, s.held_calls) == (0, 0) and s.available
        assert len(await tier.write(keys, src.addresses(range(32)), [BLOCK] * 32)) == 32
        assert await tier.read(keys, dst.addresses(range(32))) == (True,) * 32
        assert np.array_equal(src.array, dst.array)
    await wait_no_library_threads()


async def test_bad_input_changes_nothing(master: Master) -> None:
    with pytest.raises(ValueError, match="block_size"):
        MooncakeTier(master.config(), block_size=0, fingerprint="m")
    with pytest.raises(ValueError, match="fingerprint"):
        MooncakeTier(master.config(), block_size=BLOCK, fingerprint="")
    with pytest.raises(ValueError, match="UTF-8"):  # it is hashed into the keys' names
        MooncakeTier(master.config(), block_size=BLOCK, fingerprint="\ud800")
    src, elsewhere = Pages(2), Pages(1)
    async with open_tier(master.config(), unique("bad"), src) as tier:
        with pytest.raises(ValueError, match="does not fit"):
            await tier.write([1], src.addresses([0]), [BLOCK + 1])
        with pytest.raises(ValueError, match="does not fit"):
            await tier.read([1], src.addresses([0]), [BLOCK + 1])
        with pytest.raises(ValueError, match="one address and one length per key"):
            await tier.write([1, 2], src.addresses([0]), [BLOCK])
        with pytest.raises(ValueError, match="one address per key"):
            await tier.read([1, 2], src.addresses([0]))
        with pytest.raises(ValueError, match="not inside memory registered"):
            await tier.write([1], elsewhere.addresses([0]), [BLOCK])
        with pytest.raises(ValueError, match="not inside memory registered"):
            await tier.write([1], [src.base + BLOCK + 1], [BLOCK])
        with pytest.raises(ValueError, match="overlaps"):
            await tier.register(src.base + BLOCK, BLOCK)
        with pytest.raises(TypeError):
            await tier.write([1.5], src.addresses([0]), [BLOCK])  # type: ignore[list-item]
        assert await tier.lookup([1]) == 0
        s = tier.statistics()
        assert (s.bytes_written, s.writes_skipped, s.errors, s.misses) == (0, 0, 0, 0)
    with pytest.raises(TierClosedError):
        await tier.read([1], src.addresses([0]))


_OPEN_DEAD = textwrap.dedent(
    """
    import asyncio, sys, time
    from aiokvtier import MooncakeError, MooncakeTier, MooncakeTierConfig

    async def main():
        config = MooncakeTierConfig(
            master=f"127.0.0.1:{sys.argv[1]}", metadata_server=f"http://127.0.0.1:{sys.argv[2]}/metadata",
            local_hostname="127.0.0.1", segment_size=16 << 20, local_buffer_size=16 << 20, open_timeout=1.0,
        )
        started = time.monotonic()
        try:
            await MooncakeTier.open(config, block_size=65536, fingerprint="m")
        except MooncakeError as exc:
            print("MooncakeError", round(time.monotonic() - started, 1), exc, flush=True)
        import os
        os._exit(0)  # the setup thread retries for a minute more: nothing to wait for

    asyncio.run(main())
    """
)


async def test_an_unreachable_master_fails_the_open_at_once() -> None:
    why = await asyncio.to_thread(_why_no_mooncake)
    if why is not None:
        pytest.skip(why)
    rpc, http = await asyncio.to_thread(_client.loopback_ports, 2)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _OPEN_DEAD,
        str(rpc),
        str(http),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(child.communicate(), 60)
    line = out.decode().strip()
    assert line.startswith("MooncakeError"), line
    assert float(line.split()[1]) < 10 and "cannot reach the Mooncake master" in line


async def test_a_missing_wheel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(MooncakeError, match=r"pip install 'aiokvtier\[mooncake\]'"):
        _client.load()


def test_doctor_says_whether_a_master_answers(master: Master) -> None:
    from aiokvtier import _doctor

    assert _doctor.check_mooncake(f"127.0.0.1:{master.rpc}").verdict == "ok"
    (closed,) = _client.loopback_ports(1)
    check = _doctor.check_mooncake(f"127.0.0.1:{closed}", timeout=1.0)
    assert check.verdict == "warn" and "does not answer" in check.summary
    assert _doctor.check_mooncake(None).verdict == "ok"


class Failing(Wrapped):
    """While active, every put fails with ``TRANSFER_FAIL``: a transfer may still run."""

    def batch_put_from(self, names: list[str], *args: Any) -> Any:
        if self.active:
            return [-800] * len(names)
        return self.client.batch_put_from(names, *args)


async def test_a_failure_that_may_leave_a_transfer_running_poisons_the_tier(
    master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    src = Pages(2)
    failing = Failing()
    tier = MooncakeTier(master.config(), block_size=BLOCK, fingerprint=unique("poison"), wrap_client=failing)
    async with tier:
        await tier.register(src.base, src.size)
        failing.active = True
        assert await tier.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2) == ()
        s = tier.statistics()
        assert not s.available and "open a new tier" in (s.unavailable_why or "")
        assert s.held_bytes == 2 * BLOCK and s.writes_skipped == 2
        with pytest.raises(ValueError, match="held"):
            await tier.write([2], src.addresses([0]), [BLOCK])
        await asyncio.sleep(0.3)
        assert not tier.available  # no reconnecting out of this
    assert "left open" in caplog.text  # never closed under a transfer
    await asyncio.to_thread(failing.client.close)  # here nothing runs: the test may close it


async def test_read_into_takes_a_block_of_any_size_up_to_its_room_and_unregister_gives_memory_back(
    master: Master,
) -> None:
    src, dst = Pages(2), Pages(2)
    src.fill(7)
    async with open_tier(master.config(), unique("room"), src) as tier:
        await tier.register(dst.base, dst.size)
        assert await tier.write([1, 2], src.addresses([0, 1]), [1000, BLOCK]) == (1, 2)
        assert await tier.read_into([1, 2, 3], [*dst.addresses([0, 1]), dst.base], [BLOCK, BLOCK, BLOCK]) == (
            1000,
            BLOCK,
            0,
        )
        assert bytes(dst.array[0, :1000]) == bytes(src.array[0, :1000]) and np.array_equal(dst.array[1], src.array[1])
        assert await tier.read_into([2], dst.addresses([0]), [BLOCK // 2]) == (0,)  # larger than its room: a miss
        assert await tier.released(dst.addresses([0, 1]), [BLOCK, BLOCK])  # nothing held
        await tier.unregister(dst.base)
        assert tier.statistics().registered_bytes == src.size
        with pytest.raises(ValueError, match="not inside memory registered"):
            await tier.read_into([1], dst.addresses([0]), [BLOCK])
        with pytest.raises(ValueError, match="no memory is registered"):
            await tier.unregister(dst.base)
        await tier.register(dst.base, dst.size)  # registered again, unregistered once at close
        assert await tier.read([2], dst.addresses([1])) == (True,)
    with pytest.raises(TierClosedError):
        await tier.unregister(src.base)
    await wait_no_library_threads()


async def test_a_register_cancelled_while_mooncake_registers_is_recorded_and_unregistered(master: Master) -> None:
    memory = Pages(64)
    async with open_tier(master.config(), unique("register")) as tier:
        for _ in range(3):
            registering = asyncio.ensure_future(tier.register(memory.base, memory.size))
            await asyncio.sleep(0)  # the client registers it on the tier's thread
            registering.cancel()
            with pytest.raises(asyncio.CancelledError):
                await registering
            # done all the same: the tier knows it (it would never unregister it else), and lets it go
            assert tier.statistics().registered_bytes == memory.size
            with pytest.raises(ValueError, match="overlaps memory already registered"):
                await tier.register(memory.base, memory.size)
            await tier.unregister(memory.base)
            assert tier.statistics().registered_bytes == 0
        await tier.register(memory.base, memory.size)  # unregistered at close
    await wait_no_library_threads()


class RefusingUnregister(Wrapped):
    """While active, refuses to unregister memory once (the code Mooncake returns for a failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = 1

    def unregister_buffer(self, address: int) -> Any:
        if self.active and self.refuse:
            self.refuse -= 1
            return -1
        return self.client.unregister_buffer(address)


async def test_an_unregister_mooncake_refuses_keeps_the_memory_registered_and_says_so(master: Master) -> None:
    src, dst = Pages(1), Pages(1)
    refusing = RefusingUnregister()
    async with open_tier(master.config(), unique("unreg"), src, wrap_client=refusing) as tier:
        await tier.register(dst.base, dst.size)
        refusing.active = True
        with pytest.raises(MooncakeError, match="refused to unregister"):
            await tier.unregister(dst.base)
        assert tier.statistics().registered_bytes == src.size + dst.size  # still in the books
        await tier.unregister(dst.base)  # the second time Mooncake lets go
        assert tier.statistics().registered_bytes == src.size
    await wait_no_library_threads()


class SlowRefusal(RefusingUnregister):
    """While active, refuses to unregister once, after ``gate`` is set (the caller is cancelled first)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate
        self.unregistered: list[int] = []

    def unregister_buffer(self, address: int) -> Any:
        if self.active and self.refuse:
            self.gate.wait(30)
        code = super().unregister_buffer(address)
        if code == 0:
            self.unregistered.append(address)
        return code


async def test_an_unregister_cancelled_while_mooncake_refuses_stays_booked_and_the_close_lets_it_go(
    master: Master,
) -> None:
    src, dst = Pages(1), Pages(1)
    gate = threading.Event()
    refusing = SlowRefusal(gate)
    try:
        async with open_tier(master.config(), unique("unreg-cancel"), src, wrap_client=refusing) as tier:
            await tier.register(dst.base, dst.size)
            refusing.active = True
            unregistering = asyncio.ensure_future(tier.unregister(dst.base))
            await asyncio.sleep(0.05)  # Mooncake is asked, on the tier's thread
            unregistering.cancel()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await unregistering
            # still registered with Mooncake: still in the books, refused again as a second registration
            assert tier.statistics().registered_bytes == src.size + dst.size
            with pytest.raises(ValueError, match="overlaps memory already registered"):
                await tier.register(dst.base, dst.size)
        assert dst.base in refusing.unregistered  # the close let it go
    finally:
        gate.set()
    await wait_no_library_threads()


async def test_wrap_client_sees_every_call_and_a_wrapper_that_fails_leaves_nothing_open(master: Master) -> None:
    with pytest.raises(TypeError, match="wrap_client must be callable"):
        MooncakeTier(master.config(), block_size=BLOCK, fingerprint="x", wrap_client=42)  # type: ignore[arg-type]
    src, dst = Pages(2), Pages(2)
    src.fill(3)
    calls: list[str] = []

    class Counting(Wrapped):
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(self.client, name)

    async with open_tier(master.config(), unique("wrap"), src, dst, wrap_client=Counting()) as tier:
        assert len(await tier.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)) == 2
        assert await tier.read([0, 1], dst.addresses([0, 1])) == (True, True)
    assert {"register_buffer", "batch_put_from", "batch_get_into", "close"} <= set(calls)
    assert np.array_equal(dst.array, src.array)

    def refuse(client: Any) -> Any:
        raise RuntimeError("no wrapper today")

    with pytest.raises(RuntimeError, match="no wrapper today"):
        await MooncakeTier.open(master.config(), block_size=BLOCK, fingerprint=unique("refused"), wrap_client=refuse)
    await wait_no_library_threads()
