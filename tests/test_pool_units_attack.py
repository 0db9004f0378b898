"""A host pool's commit units (64 MiB unless its config names one) and the edges of attaching, attacked
with real processes.

Configs at the edges of the default unit open, fill and agree in every
process with the memory itself (the memfd's allocated bytes), or are refused
by field with nothing made; resizes while processes hold slots and while the
fill runs keep every figure in step; the first slot comes after the first
unit, not the whole fill; hostile paths are refused, bounded and without a
descriptor or thread left; calls cancelled at every delay leave the owner's
books and the cancelling process clean. Every await is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pydantic
import pytest

from aiokvtier import AttachedPool, ConfigError, Pool, PoolError, QuotaError
from aiokvtier._host import _linux
from tests.conftest import PopulateGate
from tests.helpers import descriptors
from tests.test_pool import ENV, ROOT, WAIT, attached, loop_kind, sock, until

__all__ = ["sock"]  # the fixture, used by name

MiB = 1 << 20
UNIT = 64 * MiB


def pool_memory() -> list[tuple[int, int]]:
    """``(size, allocated bytes)`` of each pool memfd this process holds a descriptor of (tier or mirror)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:aiokvtier-pool"):
                continue
            st = os.fstat(int(name))
        except OSError:
            continue  # the listing's own descriptor
        out.append((st.st_size, st.st_blocks * 512))
    return out


def tier_memory(size: int) -> int:
    """Bytes of the shared tier's memfd (``size`` bytes long) that hold pages: what is resident in fact."""
    found = [allocated for length, allocated in pool_memory() if length == size]
    assert len(found) == 1, f"one memfd of {size} bytes expected, found {pool_memory()}"
    return found[0]


def held() -> tuple[list[str], list[str], int]:
    """This process's descriptors, library threads and mappings of a pool's memory."""
    with open("/proc/self/maps") as f:
        maps = sum("aiokvtier-pool" in line for line in f)
    return descriptors(), sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokvtier-")), maps


async def figures_agree(pool: Pool, a: AttachedPool) -> None:
    """The owner's figures, an attached process's and the memory's agree, once the fill has settled."""
    s = pool.statistics().tier
    await until(lambda: a.quota == s.quota, "the owner's last resize reached the attached process")
    async with asyncio.timeout(WAIT):
        await a.wait_resident(s.quota)
        theirs = (await a.statistics()).tier
    assert (theirs.quota, theirs.target_bytes, theirs.commit_unit, theirs.slots_total) == (
        s.quota,
        s.target_bytes,
        s.commit_unit,
        s.slots_total,
    )
    assert a.quota == s.quota and a.slots_total == s.slots_total
    mine = pool.statistics().tier
    assert mine.resident_bytes == mine.target_bytes == a.resident_bytes, "the fill stops at the fill target"
    assert mine.target_bytes - mine.quota < mine.commit_unit, "the target is the quota rounded up to whole units"
    assert mine.target_bytes <= mine.max_quota
    assert await asyncio.to_thread(tier_memory, mine.max_quota) == mine.resident_bytes


# -- configs at the edges of the default unit --------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "unit"),
    [
        ({"quota": "100MiB", "max_quota": "200MiB", "slot_size": "64KiB"}, UNIT),  # not a multiple of the unit
        ({"quota": "20MiB", "max_quota": "100MiB", "slot_size": "64KiB"}, UNIT),  # below one unit
        ({"quota": "192MiB", "max_quota": "192MiB", "slot_size": "96MiB"}, 96 * MiB),  # a slot above the unit
        ({"quota": "144MiB", "max_quota": "144MiB", "slot_size": "48MiB"}, 48 * MiB),  # a slot not dividing it
        ({"quota": "200MiB", "max_quota": "400MiB", "slot_size": "40MiB"}, 80 * MiB),
        ({"quota": "100MiB", "max_quota": "100MiB", "slot_size": "3MiB"}, 63 * MiB),
        ({"quota": "100MiB", "max_quota": "100MiB", "slot_size": "64KiB", "commit_unit": "16MiB"}, 16 * MiB),
        ({"quota": "100MiB", "max_quota": "100MiB", "slot_size": "64KiB", "fill_chunk": "100KiB"}, 128 << 10),
        ({"quota": "1GB", "max_quota": "1GB"}, UNIT),  # 2 MiB slots, 952 MiB
        ({"quota": "130MiB", "max_quota": 200 * MiB + 12288, "slot_size": "12KiB"}, 5461 * 12288),  # odd pages
    ],
    ids=[
        "quota-100MiB",
        "quota-20MiB",
        "slot-96MiB",
        "slot-48MiB",
        "slot-40MiB",
        "slot-3MiB",
        "unit",
        "chunk",
        "1GB",
        "slot-12KiB",
    ],
)
async def test_a_config_at_the_edges_of_the_unit_fills_and_every_process_agrees_with_the_memory(
    sock: str, config: dict[str, str], unit: int
) -> None:
    async with Pool(config, sock) as pool, attached(sock) as child, AttachedPool(sock) as a:
        assert pool.tier.config.resolved.commit_unit == unit
        await child.event("attached")
        await figures_agree(pool, a)
        s = pool.statistics().tier
        whole = await child.call("wait_resident")
        assert whole["resident"] == s.resident_bytes
        # Every slot of the quota is there for the attached processes, and no more; the last one's bytes
        # are the same memory in another address space.
        ours = (await a.allocate_ids(s.slots_total - 1)).tolist()
        (last,) = (await child.call("allocate", n=1))["slots"]
        assert sorted([*ours, last]) == list(range(s.slots_total))
        await child.call("write", slot=last, data=b"last".hex())
        assert bytes(pool.tier.view(last)[:4]) == b"last"
        refused = await child.answer(child.send("allocate", n=1))
        assert refused["error"] == "OutOfSlots"
        stats = await child.call("stats")
        assert stats["slots_allocated"] == s.slots_total and stats["clients"] == 2
        await a.free_many(ours)
        pool.check_invariants(sole_user=True)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"quota": "128MiB", "slot_size": "64KiB", "commit_unit": "100KiB"}, "commit_unit"),
        ({"quota": "128MiB", "slot_size": "64KiB", "commit_unit": "16KiB"}, "commit_unit"),
        ({"quota": "128MiB", "slot_size": "64KiB", "commit_unit": 0}, "commit_unit"),
        ({"quota": "64MiB", "max_quota": "64MiB", "slot_size": "96MiB"}, "slot_size"),
        ({"quota": "128MiB", "slot_size": 1000000}, "slot_size"),
        ({"quota": "128MiB", "max_quota": "32MiB", "slot_size": "64KiB"}, "max_quota"),
        ({"quota": "16KiB", "max_quota": "64MiB", "slot_size": "64KiB"}, "quota"),
        ({"quota": "128MiB", "slot_size": "64KiB", "fill_chunk": 0}, "fill_chunk"),
        ({"quota": "128MiB", "slot_size": "64KiB", "comit_unit": "64MiB"}, "commit_unit"),
    ],
    ids=["unit-not-slots", "unit-below-slot", "unit-zero", "slot-above-quota", "slot-not-pages", "max-below",
         "quota-below-slot", "chunk-zero", "misspelt"],
)  # fmt: skip
async def test_a_bad_config_names_its_field_and_makes_nothing(sock: str, config: dict[str, Any], field: str) -> None:
    before = await asyncio.to_thread(held)
    with pytest.raises(pydantic.ValidationError, match=field):
        await Pool.open(config, sock)
    with pytest.raises(pydantic.ValidationError, match=field):
        Pool(config, sock)
    assert not await asyncio.to_thread(os.listdir, os.path.dirname(sock)), "no socket, no lock file"
    assert await asyncio.to_thread(held) == before, "no descriptor, thread or mapping"


async def test_the_vmm_backing_makes_nothing_either(sock: str) -> None:
    before = await asyncio.to_thread(held)
    with pytest.raises(ConfigError, match="backing='vmm'"):
        await Pool.open({"quota": "128MiB", "slot_size": "64KiB", "backing": "vmm", "device": 0}, sock)
    assert not await asyncio.to_thread(os.listdir, os.path.dirname(sock))
    assert await asyncio.to_thread(held) == before


# -- resizes while processes hold slots and the fill runs ---------------------------------------------------


@pytest.fixture
def populate_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[PopulateGate]:
    """The shared backing's fill, let through one unit at a time (one populate call is one unit)."""
    gate = PopulateGate(_linux.populate_write)
    monkeypatch.setattr(_linux, "populate_write", gate)
    yield gate
    gate.release_all()


async def test_resizes_under_held_slots_and_a_running_fill_keep_every_figure_in_step(
    sock: str, populate_gate: PopulateGate
) -> None:
    gate = populate_gate
    config = {"quota": "256MiB", "max_quota": "320MiB", "slot_size": "64KiB"}
    async with Pool(config, sock) as pool, attached(sock) as child, AttachedPool(sock) as a:
        gate.allow(6)  # the ramp (4, 4, 8, 16, 32 MiB) and one 64 MiB unit; the next is held mid-fill
        await child.event("attached")
        assert (await child.call("wait_resident", nbytes=128 * MiB))["resident"] == 128 * MiB
        held_slots = (await child.call("allocate", n=10))["slots"]
        await until(lambda: gate.calls == 7, "the fill reached the held unit")
        # A shrink to a size that is no multiple of the unit, below the unit being filled: it waits for
        # that unit, then hands back whatever lies past its own last unit.
        shrink = asyncio.ensure_future(pool.resize("100MiB"))
        await asyncio.sleep(0.1)
        gate.release_all()
        async with asyncio.timeout(WAIT):
            await shrink
        await figures_agree(pool, a)
        assert pool.statistics().tier.resident_bytes == 128 * MiB
        await until(lambda: a.quota == 100 * MiB, "the shrink reached the in-process attached pool")
        # Below the slots a process holds: refused, nothing changes.
        with pytest.raises(QuotaError, match="slot 9"):
            await pool.resize("512KiB")
        await figures_agree(pool, a)
        # Down to less than the first unit, then up past the last whole unit (320 MiB is the reservation).
        await pool.resize("1MiB")
        await figures_agree(pool, a)
        assert pool.statistics().tier.resident_bytes == 4 * MiB
        await pool.resize("300MiB")
        await figures_agree(pool, a)
        assert pool.statistics().tier.resident_bytes == 320 * MiB
        seen = await child.call("wait_resident")
        assert seen["resident"] == 320 * MiB
        await child.call("free", slots=held_slots)
        await until(lambda: pool.statistics().slots_attached == 0, "the child's free reached the owner")
        pool.check_invariants(sole_user=True)


# -- the first slot comes with the first unit --------------------------------------------------------------


async def test_a_process_attached_during_the_fill_gets_each_slot_with_its_own_unit(
    sock: str, populate_gate: PopulateGate
) -> None:
    gate = populate_gate
    config = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": "64KiB"}
    async with Pool(config, sock) as pool, attached(sock) as child:
        hello = await child.event("attached")  # nothing is resident: attaching waits for none of it
        assert hello["resident"] == 0
        first = child.send("allocate", n=1)
        await asyncio.sleep(0.1)
        assert child.pending(first)
        gate.allow(1)
        assert (await child.answer(first))["slots"] == [0]
        assert pool.statistics().tier.resident_bytes == 4 * MiB  # the first unit of the ramp, no more
        # The slots up to 68.8 MiB: the first 64 MiB unit past the ramp, not the whole fill.
        more = child.send("allocate", n=1100)
        gate.allow(5)
        await until(lambda: pool.statistics().tier.resident_bytes == 64 * MiB, "the ramp filled")
        await asyncio.sleep(0.1)
        assert child.pending(more)
        gate.allow(6)
        assert len((await child.answer(more))["slots"]) == 1100
        assert pool.statistics().tier.resident_bytes == 128 * MiB
        gate.release_all()
        assert (await child.call("wait_resident"))["resident"] == 256 * MiB


# -- hostile paths --------------------------------------------------------------------------------------------


def stranger(kind: str, path: str) -> Callable[[], None]:
    """Put something that is not a pool at ``path``; what it holds goes when the returned call is made."""
    made: list[socket.socket] = []
    threads: list[threading.Thread] = []
    if kind == "fifo":
        os.mkfifo(path)
    elif kind in ("datagram socket", "seqpacket socket", "stale socket"):
        kinds = {"datagram socket": socket.SOCK_DGRAM, "seqpacket socket": socket.SOCK_SEQPACKET}
        s = socket.socket(socket.AF_UNIX, kinds.get(kind, socket.SOCK_STREAM))
        s.bind(path)
        if kind == "seqpacket socket":
            s.listen()
        if kind == "stale socket":
            s.close()  # the file stays, as a killed owner's does
        else:
            made.append(s)
    elif kind == "closed directory":
        os.mkdir(os.path.dirname(path), 0)
    elif kind in ("huge frame", "frame with descriptors"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        made.append(listener)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)
                if kind == "huge frame":
                    conn.sendall(b"\xff\xff\xff\x7f" + b"x" * 64)
                else:  # a short frame, and descriptors it did not ask for
                    r, w = os.pipe()
                    socket.send_fds(conn, [b"\x08\0\0\0" + b"z" * 8], [r, w])
                    os.close(r)
                    os.close(w)
                conn.settimeout(WAIT)
                with contextlib.suppress(OSError):
                    while conn.recv(1 << 16):
                        pass

        threads.append(threading.Thread(target=serve, name="test-stranger", daemon=True))
        threads[-1].start()

    def gone() -> None:
        for thread in threads:
            thread.join(WAIT)
        for s in made:
            s.close()
        if kind == "closed directory":
            os.chmod(os.path.dirname(path), 0o700)
            os.rmdir(os.path.dirname(path))

    return gone


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("fifo", "is not a socket, not a pool's socket"),
        ("datagram socket", "cannot connect to the pool at"),
        ("seqpacket socket", "cannot connect to the pool at"),
        ("stale socket", "refused the connection: its owner is gone"),
        ("closed directory", "(permission denied connecting|no pool) at"),
        ("huge frame", "not the pool protocol"),
        ("frame with descriptors", "not the pool protocol"),
    ],
)
async def test_attaching_to_a_hostile_path_is_a_clear_error_and_leaves_nothing(sock: str, kind: str, says: str) -> None:
    path = os.path.join(os.path.dirname(sock), "closed", "pool.sock") if kind == "closed directory" else sock
    before = await asyncio.to_thread(held)
    gone = await asyncio.to_thread(stranger, kind, path)
    try:
        async with asyncio.timeout(WAIT):
            with pytest.raises(PoolError, match=says) as caught:
                await AttachedPool.attach(path)
        assert path in str(caught.value)
    finally:
        await asyncio.to_thread(gone)
    async with asyncio.timeout(WAIT):
        # A worker thread ends just after its close: poll.
        while (now := await asyncio.to_thread(held)) != before:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert now == before


async def test_an_abstract_socket_name_nobody_serves_is_a_pool_error() -> None:
    """A name in Linux's abstract namespace (a leading NUL byte) connects as a path does; when nobody
    serves it, the check of what is there stats the name and met a ValueError (embedded null byte)."""
    name = f"\0aiokvtier-test-{os.getpid()}"
    before = await asyncio.to_thread(held)
    async with asyncio.timeout(WAIT):
        with pytest.raises(PoolError, match="refused the connection"):
            await AttachedPool.attach(name)
    assert await asyncio.to_thread(held) == before


# -- cancellation swept over attach and the calls of another process -----------------------------------------


@pytest.mark.parametrize("op", ["attach", "allocate", "free", "store", "load"])
async def test_calls_of_another_process_cancelled_at_every_delay_leave_nothing_held(sock: str, op: str) -> None:
    """tests/pool_cancel_sweep.py attaches, cancels OP after 0 to 12 ms and detaches, round after round,
    while the owner fills its 64 MiB units; then it says what it holds and what the owner holds for it."""
    config = {"quota": "512MiB", "max_quota": "512MiB", "slot_size": "64KiB"}
    async with Pool(config, sock) as pool:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "tests" / "pool_cancel_sweep.py"),
            loop_kind(),
            sock,
            op,
            "12",
            stdout=asyncio.subprocess.PIPE,
            env=ENV,
            cwd=ROOT,
        )
        try:
            async with asyncio.timeout(4 * WAIT):
                out, _ = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, out
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report["after"] == report["before"], "the process kept a descriptor, thread or mapping"
        assert any(report["cancelled"]), "no round was cancelled"
        owner = report["owner"]
        assert (owner["slots_attached"], owner["claims"], owner["blocks_pinned"]) == (0, 0, 0)
        assert owner["slots_allocated"] == owner["blocks"]
        await until(lambda: pool.clients == 0, "the owner did not see the process go")
        pool.check_invariants(sole_user=True)
