"""The block server attacked over real HTTP on loopback, as a hostile or unlucky client and operator would:
requests that lie about their bodies, keys and methods no route takes, clients racing on one key, a full
tier, and, with ``--workers``, a worker or the pool's owner killed, and signals with requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import itertools
import os
import random
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_server import APP, ENV, ROOT, Raw, Server, assert_error, assert_json_503, head, wait_for

SLOT = 64 << 10


# -- helpers ----------------------------------------------------------------------------------------


async def exchange(url: str, data: bytes, seconds: float = 10) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a new connection; the answer read to the end of the stream (status 0: none)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    return await Raw(reader, writer).answer(seconds)


def request(line: str, *fields: str, body: bytes = b"") -> bytes:
    """A request that asks the server to close after answering (so that ``exchange`` reads to the end)."""
    return head(line, *fields, "Connection: close").encode() + body


def sealed(rng: random.Random, size: int) -> bytes:
    """A block whose first 32 bytes are the SHA-256 of the rest: bytes of two blocks mixed fail ``unsealed``."""
    rest = rng.randbytes(size - 32)
    return hashlib.sha256(rest).digest() + rest


def unsealed(data: bytes) -> bool:
    return len(data) > 32 and hashlib.sha256(data[32:]).digest() == data[:32]


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def processes_naming(text: str) -> list[int]:
    """The pids whose command line holds ``text`` (a worker names its pool's path there)."""
    found = []
    for entry in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(entry, "rb") as cmdline:
                if text.encode() in cmdline.read():
                    found.append(int(entry.split("/")[2]))
        except OSError:
            pass
    return found


async def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def until(predicate: Callable[[], bool | Awaitable[bool]], seconds: float, what: str) -> None:
    """Poll a predicate (or an async one) every 50 ms; the test fails, naming ``what``, past ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {seconds} s")
        await asyncio.sleep(0.05)


class Workers:
    """``--workers N`` on a free loopback port: the parent (owner of the pool) and its workers' pids.

    ``tmp`` is the parent's TMPDIR: its private directory, with the pool's socket, is made there.
    ``session``: the parent leads a process group of its own, as a shell's job does, so that a test
    can signal the group as a terminal's Ctrl-C does.
    """

    def __init__(self, proc: asyncio.subprocess.Process, url: str, tmp: Path) -> None:
        self.proc, self.url, self.tmp = proc, url, tmp
        self.clients: dict[int, httpx.AsyncClient] = {}

    @classmethod
    async def start(cls, tmp: Path, n: int, *options: str, session: bool = False) -> Workers:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *APP, "--host", "127.0.0.1", "--port", "0", "--workers", str(n), *options,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**ENV, "TMPDIR": str(tmp)},
            cwd=ROOT, start_new_session=session,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            match = re.search(rf"listening on (http://127\.0\.0\.1:\d+) \({n} workers, one pool\)", line)
            assert match, line
            for _ in range(n):  # each worker says where it listens once it serves
                assert "listening" in (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return cls(proc, match.group(1), tmp)

    def worker_pids(self) -> list[int]:
        return processes_naming(str(self.tmp) + os.sep)

    async def pin_clients(self, n: int) -> dict[int, httpx.AsyncClient]:
        """One keep-alive client per worker (found by the pid its ``/v1/stats`` names), ``n`` in all."""
        spare = []
        try:
            for _ in range(200):
                client = httpx.AsyncClient(base_url=self.url, timeout=30)
                pid = (await client.get("/v1/stats")).json()["worker"]["pid"]
                if pid in self.clients:
                    spare.append(client)
                else:
                    self.clients[pid] = client
                if len(self.clients) == n:
                    return self.clients
        finally:
            for client in spare:
                await client.aclose()
        pytest.fail(f"connections reached {len(self.clients)} of {n} workers")

    async def close(self, seconds: float = 60) -> tuple[int, str]:
        """SIGTERM (unless it exited), the exit code and stderr; the workers are never left behind."""
        for client in self.clients.values():
            await client.aclose()
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stderr is not None
        reading = asyncio.ensure_future(self.proc.stderr.read())  # read as it comes: a full pipe blocks a writer
        try:
            code = await asyncio.wait_for(self.proc.wait(), seconds)
        finally:
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
            kill_workers(self.tmp)  # the parent is gone: a worker left is a stray (and holds stderr open)
        stderr = await asyncio.wait_for(reading, seconds)
        return code, stderr.decode()


def kill_workers(tmp: Path) -> None:
    """SIGKILL what is left of the workers of a parent whose TMPDIR is ``tmp`` (they name it in their command)."""
    for pid in processes_naming(str(tmp) + os.sep):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A TMPDIR for a server with ``--workers``: empty again once its parent has exited cleanly."""
    yield tmp_path
    kill_workers(tmp_path)  # a failed test's workers: never left running


def run(scenario: Coroutine[Any, Any, None], seconds: float) -> None:
    asyncio.run(asyncio.wait_for(scenario, seconds))


# -- hostile requests -------------------------------------------------------------------------------

OLD = b"the old value of aa01"


async def hostile_scenario() -> None:
    server = await Server.start("--quota", "64MiB")
    try:
        url = server.url
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            assert (await client.put("/v1/blocks/aa01", content=OLD)).status_code == 201

            # Bodies that lie. A shorter Content-Length: the block is what it declared, the rest is the next
            # request on the connection (not HTTP: refused, and the connection closed).
            status, _, _ = await exchange(url, request("PUT /v1/blocks/b001", "Content-Length: 3", body=b"abcdef"))
            assert status == 201
            assert (await client.get("/v1/blocks/b001")).content == b"abc"
            # No Content-Length and not chunked: an empty body, refused; the bytes after it are no request.
            status, headers, body = await exchange(url, request("PUT /v1/blocks/b002", body=b"abcdef"))
            assert status == 400 and headers["content-type"] == "application/json" and b"empty" in body
            # Content-Length that cannot be a length, or two of them: refused before any body is read.
            for fields in (
                ("Content-Length: -1",),
                ("Content-Length: +3",),
                ("Content-Length: 0x10",),
                ("Content-Length: " + "9" * 40,),
                ("Content-Length: 3", "Content-Length: 4"),
                ("Transfer-Encoding: gzip",),
            ):
                status, _, _ = await exchange(url, request("PUT /v1/blocks/b003", *fields, body=b"abcd"))
                assert status == 400, fields
            # Both a Content-Length and a Transfer-Encoding: framed two ways (how requests are smuggled past
            # a proxy that reads the other one), refused, the connection closed with the request after it unread.
            both = (
                head("PUT /v1/blocks/b007", "Content-Length: 8", "Transfer-Encoding: chunked") + "3\r\nabc\r\n0\r\n\r\n"
            )
            status, headers, body = await exchange(url, both.encode() + request("GET /v1/blocks/aa01"))
            assert status == 400 and headers["connection"] == "close" and b"Transfer-Encoding" in body, body
            assert OLD not in body  # the request after it was not answered
            # A chunked body that is not chunked.
            chunked = "Transfer-Encoding: chunked"
            status, _, _ = await exchange(url, request("PUT /v1/blocks/b004", chunked, body=b"zz\r\nabc\r\n0\r\n\r\n"))
            assert status == 400
            # Past a slot, declared: 413 at once, the body never read (an Expect: 100-continue client
            # is never told to send it); chunked, 413 once a slot's worth has come.
            for declared in ("Content-Length: 1000000000", "Content-Length: 65537"):
                status, headers, _ = await exchange(
                    url, request("PUT /v1/blocks/aa01", declared, "Expect: 100-continue")
                )
                assert status == 413 and headers["content-type"] == "application/json"
            # An answer sent before the body was read to its end says it closes the connection, and does:
            # the server does not go on reading, and throwing away, the body the client goes on sending.
            for line, want in (
                ("PUT /v1/blocks/aa01", 413),
                ("PUT /v1/blocks/ZZ", 400),
                ("POST /v1/blocks/aa01", 405),
                ("POST /nowhere", 404),
            ):
                early = await Raw.open(url, head(line, "Content-Length: 1000000000"), bytes(1000))
                status, headers, _ = await early.answer(10)
                assert status == want and headers["connection"] == "close", (line, status, headers)
            # One whose body was read keeps its connection: the next request on it is answered.
            kept = await Raw.open(
                url,
                head("PUT /v1/blocks/b006", "Content-Length: 3")
                + "abc"
                + head("GET /v1/blocks/b006", "Connection: close"),
            )
            status, headers, body = await kept.answer(10)
            assert status == 201 and "connection" not in headers and body.endswith(b"\r\n\r\nabc"), body
            huge = b"%x\r\n" % (SLOT + 1) + bytes(SLOT + 1) + b"\r\n0\r\n\r\n"
            status, _, _ = await exchange(url, request("PUT /v1/blocks/aa01", chunked, body=huge))
            assert status == 413

            # Keys: each refused with a JSON error, none reaches the store.
            for target, want in (
                ("/v1/blocks/", 404),
                ("/v1/blocks/" + "a" * 10_000, 400),
                ("/v1/blocks/%ff%fe", 400),
                ("/v1/blocks/ab%00", 400),
                ("/v1/blocks/%61%61%30%31", 200),  # percent-encoded hex is the same key
                ("/v1/blocks/aa%2F01", 404),  # an encoded slash is a slash: no such route
                ("/v1/blocks/../../etc/passwd", 404),
                ("/v1/blocks/..%2F..%2Fmetrics", 404),
                ("/v1/blocks/aa01/..", 404),
                ("/v1/blocks/aa01%20", 400),
                ("/v1/blocks/aa01?x=../../", 200),  # a query is not part of the key
            ):
                status, headers, body = await exchange(url, request(f"GET {target}"))
                assert status == want, (target, status, body[:200])
                if want == 200:
                    assert body == OLD, target
                else:
                    assert headers["content-type"] == "application/json", target
                    assert len(body) < 1024, (target, len(body))  # a huge key is not echoed whole
            # A trailing slash is another path: 404, never a redirect (to where the client's Host header says).
            for line in ("GET /v1/blocks/aa01/", "PUT /v1/blocks/b005/", "GET /healthz/", "DELETE /v1/blocks/aa01//"):
                status, headers, _ = await exchange(url, request(line, "Content-Length: 3", body=b"abc"))
                assert status == 404 and "location" not in headers, (line, status, headers)
                assert headers["content-type"] == "application/json", line
            status, _, _ = await exchange(url, b"GET /v1/blocks/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 400  # not UTF-8 on the wire: not even a request
            # 100 KB of request head: refused once 16 KiB of it wait for the rest (a 400, or the connection
            # reset under the bytes still coming), or taken whole when it came at once; never a 5xx.
            status, _, _ = await exchange(url, request("GET /v1/blocks/" + "a" * 100_000))
            assert status in (0, 400), status
            status, _, _ = await exchange(url, request("GET /healthz", "X: " + "a" * 100_000))
            assert status in (0, 200, 400), status

            # Methods no route takes: 405 naming the path's methods.
            for method in ("BREW", "OPTIONS", "TRACE", "PATCH", "POST", "CONNECT"):
                target = "127.0.0.1:1" if method == "CONNECT" else "/v1/blocks/aa01"
                status, headers, _ = await exchange(url, request(f"{method} {target}"))
                if method == "CONNECT":
                    assert status in (400, 404, 405), status
                    continue
                assert status == 405, method
                assert {m.strip() for m in headers["allow"].split(",")} == {"GET", "HEAD", "PUT", "DELETE"}

            # Missing keys: 404 by every method; HEAD without a body.
            for method in ("GET", "DELETE", "HEAD"):
                status, headers, body = await exchange(url, request(f"{method} /v1/blocks/0bad"))
                assert status == 404 and headers["content-type"] == "application/json", method
                assert (body == b"") == (method == "HEAD"), (method, body)
            status, headers, body = await exchange(url, request("HEAD /v1/blocks/aa01"))
            assert status == 200 and body == b"" and headers["content-length"] == str(len(OLD))

            # A Range is not served: the whole block, 200, never a part of it.
            for ranges in ("bytes=0-1", "bytes=-3", "bytes=5-", "bytes=100-200", "bytes=0-1,4-5", "lines=1-2"):
                got = await client.get("/v1/blocks/aa01", headers={"Range": ranges})
                assert got.status_code == 200 and got.content == OLD, ranges
                assert "content-range" not in got.headers

            # Nothing above changed a block or left one half stored.
            assert (await client.get("/v1/blocks/aa01")).content == OLD
            for key in ("b002", "b003", "b004", "b005", "b007"):
                assert_error(await client.get(f"/v1/blocks/{key}"), 404)
            stats = (await client.get("/v1/stats")).json()
            assert stats["store"]["blocks"] == 3 == stats["tier"]["slots_allocated"], stats["store"]
            assert stats["store"]["in_flight"] == 0 and stats["store"]["blocks_pinned"] == 0
            assert stats["server"]["internal_errors"] == 0
    finally:
        code, stderr = await server.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr


def test_requests_that_lie_about_bodies_keys_and_methods_get_a_4xx_and_store_nothing() -> None:
    run(hostile_scenario(), 120)


async def cut_and_stalled_scenario() -> None:
    server = await Server.start("--quota", "64MiB", "--slot-size", "4MiB")
    stalled: list[Raw] = []
    try:
        url = server.url
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            # Half a body, then the client goes: no answer, nothing stored. Closed outright, or half-closed
            # (it still reads): the server sees the body end short either way.
            gone_ = await Raw.open(url, head("PUT /v1/blocks/c001", "Content-Length: 5000"), b"x" * 100)
            await asyncio.sleep(0.1)
            gone_.close()
            half = await Raw.open(url, head("PUT /v1/blocks/c002", "Content-Length: 5000"), b"x" * 100)
            half.writer.write_eof()
            status, _, _ = await half.answer(10)
            assert status in (0, 400), status
            chunked = head("PUT /v1/blocks/c005", "Transfer-Encoding: chunked")
            chunks = await Raw.open(url, chunked, b"10\r\n" + b"z" * 8)
            await asyncio.sleep(0.1)
            chunks.close()

            # Half a body, then the client stalls: it holds no claim on the key. Another client stores the
            # key meanwhile; the stalled body, once it ends, finds it stored and changes nothing.
            mine = os.urandom(5000)
            stalled.append(await Raw.open(url, head("PUT /v1/blocks/c003", "Content-Length: 5000"), mine[:100]))
            stalled.append(await Raw.open(url, head("PUT /v1/blocks/c004", "Transfer-Encoding: chunked"), b"10\r\n"))
            stalled.append(await Raw.open(url, head("POST /v1/lookup", "Content-Length: 100"), b'{"keys": ["c0'))
            await asyncio.sleep(0.2)
            theirs = os.urandom(7000)
            for key in ("c003", "c004"):
                assert (await client.put(f"/v1/blocks/{key}", content=theirs)).status_code == 201
                assert (await client.get(f"/v1/blocks/{key}")).content == theirs
            assert (await client.post("/v1/lookup", json={"keys": ["c003", "c004"]})).json() == {"hits": 2}
            stalled[0].writer.write(mine[100:])
            status, _, body = await stalled[0].answer(10, to_end=False)  # the connection stays open
            assert status == 200, body  # already stored: not overwritten
            stalled[1].close()
            stalled[2].close()
            for key in ("c003", "c004"):
                assert (await client.get(f"/v1/blocks/{key}")).content == theirs
            for key in ("c001", "c002", "c005"):
                assert_error(await client.get(f"/v1/blocks/{key}"), 404)

            # A client that reads its answer slowly holds no pin: its block is deleted and stored anew
            # meanwhile, and it still receives every byte of the block it asked for, nothing else.
            old, new = os.urandom(4 << 20), os.urandom(4 << 20)
            assert (await client.put("/v1/blocks/d001", content=old)).status_code == 201
            slow = await Raw.open(url, head("GET /v1/blocks/d001", "Connection: close"), receive_buffer=4096)
            await asyncio.sleep(0.3)
            assert (await client.delete("/v1/blocks/d001")).status_code == 204
            assert (await client.put("/v1/blocks/d001", content=new)).status_code == 201
            status, headers, body = await slow.answer(30)
            assert status == 200 and int(headers["content-length"]) == len(old) and body == old
            assert (await client.get("/v1/blocks/d001")).content == new

            stats = (await client.get("/v1/stats")).json()
            assert stats["store"]["blocks"] == 3 == stats["tier"]["slots_allocated"], stats["store"]
            assert stats["store"]["in_flight"] == 0 and stats["store"]["blocks_pinned"] == 0
            assert stats["server"]["internal_errors"] == 0
    finally:
        for raw in stalled:
            raw.close()
        code, stderr = await server.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr


def test_bodies_cut_short_or_stalled_hold_nothing_and_store_nothing_half() -> None:
    run(cut_and_stalled_scenario(), 120)


# -- racing clients ---------------------------------------------------------------------------------

KEYS = ["e0", "e1", "e2"]
CONNECTIONS = 24
ROUNDS = 40


async def race(url: str, seed: int, counts: dict[tuple[str, int], int], mixed: list[str]) -> None:
    """One connection's requests on a few shared keys, each PUT a block of its own (sealed)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        for _ in range(ROUNDS):
            op = rng.choice("PPGGGDL")
            key = rng.choice(KEYS)
            if op == "P":
                answer = await client.put(f"/v1/blocks/{key}", content=sealed(rng, rng.randrange(33, SLOT + 1)))
            elif op == "G":
                answer = await client.get(f"/v1/blocks/{key}")
                if answer.status_code == 200 and not unsealed(answer.content):
                    mixed.append(f"{key}: {len(answer.content)} bytes of no one block")
            elif op == "D":
                answer = await client.delete(f"/v1/blocks/{key}")
            else:
                answer = await client.post("/v1/lookup", json={"keys": KEYS})
            counts[(op, answer.status_code)] = counts.get((op, answer.status_code), 0) + 1


async def racing_scenario(tmp: Path, workers: int) -> None:
    options = ("--quota", "64MiB")
    if workers > 1:
        started: Server | Workers = await Workers.start(tmp, workers, *options)
    else:
        started = await Server.start(*options)
    try:
        async with httpx.AsyncClient(base_url=started.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            counts: dict[tuple[str, int], int] = {}
            mixed: list[str] = []
            await asyncio.gather(*(race(started.url, seed, counts, mixed) for seed in range(CONNECTIONS)))
            assert not mixed, mixed
            assert set(counts) <= {("P", 201), ("P", 200), ("G", 200), ("G", 404), ("D", 204), ("D", 404), ("L", 200)}
            assert counts.get(("P", 201), 0) > 0 and counts.get(("D", 204), 0) > 0, counts
            stats = (await client.get("/v1/stats")).json()
            store = stats["pool" if workers > 1 else "store"]
            assert store["stores"] == counts.get(("P", 201), 0), (store, counts)
            assert store["present"] == counts.get(("P", 200), 0), (store, counts)
            assert store["loads"] == counts.get(("G", 200), 0), (store, counts)
            assert store["discards"] == counts.get(("D", 204), 0), (store, counts)
            assert store["evictions"] == 0 and store["skipped"] == 0, store
            blocks = store["stores"] - store["discards"]
            assert store["blocks"] == blocks == stats["tier"]["slots_allocated"], (store, stats["tier"])
            assert store["blocks_pinned"] == 0 and store.get("claims", 0) == 0 and store.get("in_flight", 0) == 0
            assert stats["server"]["internal_errors"] == 0
            left = [key for key in KEYS if (await client.get(f"/v1/blocks/{key}")).status_code == 200]
            assert len(left) == blocks, left
            if workers == 1:  # the Prometheus figures are the same counts
                metrics = (await client.get("/metrics")).text
                for name, value in (("stores", store["stores"]), ("discards", store["discards"])):
                    line = f'aiokvtier_store_{name}_total{{store="default"}} {float(value)}'
                    assert re.search(f"^{re.escape(line)}$", metrics, re.M), (line, metrics)
    finally:
        if isinstance(started, Workers):
            code, stderr = await started.close()
        else:
            code, stderr = await started.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_racing_clients_on_the_same_keys_never_see_two_blocks_mixed_and_the_counts_add_up(
    scratch: Path, workers: int
) -> None:
    run(racing_scenario(scratch, workers), 180)


# -- a full pool ------------------------------------------------------------------------------------


async def full_pool_scenario(tmp: Path) -> None:
    # Four 16 MiB slots shared by two workers, and eight clients each storing then reading their own
    # blocks: every slot is often a block still being stored or one a load reads. A PUT then gets 507
    # (nothing could be evicted), never a hang; a GET gets its block whole, or 404 once evicted.
    server = await Workers.start(tmp, 2, "--quota", "64MiB", "--slot-size", "16MiB")
    blocks = [os.urandom(16 << 20) for _ in range(3)]
    try:

        async def client_run(i: int) -> list[int]:
            statuses = []
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                for j in range(3):
                    data = blocks[(i + j) % len(blocks)]
                    put = await client.put(f"/v1/blocks/f{i:x}{j:x}", content=data)
                    assert put.status_code in (201, 507), put.text
                    if put.status_code == 507:
                        assert_error(put, 507)
                    statuses.append(put.status_code)
                    got = await client.get(f"/v1/blocks/f{i:x}{j:x}")
                    assert got.status_code in (200, 404)
                    assert got.status_code == 404 or got.content == data
            return statuses

        statuses = [s for run_ in await asyncio.gather(*(client_run(i) for i in range(8))) for s in run_]
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            stats = (await client.get("/v1/stats")).json()
        pool = stats["pool"]
        assert pool["stores"] == statuses.count(201) and pool["skipped"] == statuses.count(507), (pool, statuses)
        assert pool["blocks"] == pool["stores"] - pool["evictions"] == stats["tier"]["slots_allocated"] <= 4
        assert pool["claims"] == 0 and pool["blocks_pinned"] == 0 and stats["server"]["internal_errors"] == 0
    finally:
        code, stderr = await server.close()
    assert code == 0 and "Traceback" not in stderr, stderr


def test_a_full_pool_answers_507_and_never_hangs(scratch: Path) -> None:
    run(full_pool_scenario(scratch), 180)


# -- workers killed ---------------------------------------------------------------------------------


async def killed_worker_scenario(tmp: Path) -> None:
    # Two workers; one is SIGKILLed while its clients PUT and GET 4 MiB blocks. The parent stops the other
    # (documented: a worker that exits on its own stops the others, exit 1), which keeps serving through
    # its --drain-seconds: the pool has taken back the killed worker's claims and pins by then, and every
    # block it stored reads back whole.
    # A drain longer than the checks below take on a loaded machine (they move about 400 MiB), ended by a
    # second signal to the survivor once they are done.
    server = await Workers.start(tmp, 2, "--quota", "256MiB", "--slot-size", "4MiB", "--drain-seconds", "120")
    try:
        clients = await server.pin_clients(2)
        (victim, _), (survivor, other) = clients.items()
        blocks = {f"a{i:02x}": os.urandom(4 << 20) for i in range(48)}
        answered: dict[str, int] = {}

        killed = False
        held_open, kill = asyncio.Event(), asyncio.Event()

        async def held_body() -> AsyncIterator[bytes]:
            yield b"h" * (1 << 20)
            held_open.set()
            await kill.wait()
            yield b"h" * (3 << 20)

        async def held_put() -> httpx.Response:
            # A PUT through the victim whose body is still arriving at the kill: in flight whatever the timing
            # of the traffic below (whose requests may all have been answered by then). Started just before
            # the kill, so that the body's timeout cannot answer it first.
            client = httpx.AsyncClient(base_url=server.url, timeout=30)
            try:
                while (await client.get("/v1/stats")).json()["worker"]["pid"] != victim:
                    await client.aclose()
                    client = httpx.AsyncClient(base_url=server.url, timeout=30)
                return await client.put("/v1/blocks/b00", content=held_body())
            finally:
                await client.aclose()

        async def traffic(seed: int) -> None:
            rng = random.Random(seed)
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                # Only connections that reached the victim count: find one (or give up once it is gone).
                while (await client.get("/v1/stats")).json()["worker"]["pid"] != victim:
                    await client.aclose()
                    if killed:
                        return
                    client = httpx.AsyncClient(base_url=server.url, timeout=30)
                # PUT (200 once stored: never overwritten) and GET until the kill cuts the connection off, so
                # that a task that reached the victim has a request in flight when it dies. None starts after
                # the kill: httpx would open a new connection, to the survivor, and keep it busy.
                for key in itertools.cycle(list(blocks)[seed::4]):
                    if killed:
                        return
                    put = await client.put(f"/v1/blocks/{key}", content=blocks[key])
                    assert put.status_code in (200, 201), put.text
                    answered.setdefault(key, put.status_code)
                    if killed:
                        return
                    got = await client.get(f"/v1/blocks/{list(answered)[rng.randrange(len(answered))]}")
                    assert got.status_code == 200 and got.content in blocks.values()

        tasks = [asyncio.ensure_future(traffic(seed)) for seed in range(4)]
        await until(lambda: len(answered) >= 6, 60, "six PUTs through the victim")
        held = asyncio.ensure_future(held_put())
        await asyncio.wait_for(held_open.wait(), 60)
        killed = True
        os.kill(victim, signal.SIGKILL)
        kill.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for outcome in outcomes:  # cut off mid-request, or never reached the victim: nothing else
            assert outcome is None or isinstance(outcome, httpx.TransportError), outcome
        with pytest.raises(httpx.TransportError):
            await asyncio.wait_for(held, 60)  # cut off mid-body

        async def released() -> bool:
            pool = (await other.get("/v1/stats")).json()["pool"]
            return bool(pool["clients"] == 1 and pool["claims"] == 0 and pool["blocks_pinned"] == 0)

        await until(released, 3, "the pool took back the killed worker's claims")
        for key, data in blocks.items():
            got = await other.get(f"/v1/blocks/{key}")
            if answered.get(key) == 201:
                assert got.status_code == 200 and got.content == data, key
            else:  # never stored, or its PUT was cut off: whole, or not there
                assert got.status_code == 404 or got.content == data, key
        assert (await other.get("/v1/blocks/b00")).status_code == 404  # nothing of the PUT cut off mid-body
        for key in blocks:  # every key can be stored again through the survivor: no claim is left on it
            put = await other.put(f"/v1/blocks/{key}", content=blocks[key])
            assert put.status_code in (200, 201), put.text
        assert (await other.put("/v1/blocks/b00", content=b"h" * (4 << 20))).status_code == 201
        stats = (await other.get("/v1/stats")).json()
        assert stats["worker"]["pid"] == survivor and stats["server"]["draining"] is True
        assert stats["pool"]["blocks"] == len(blocks) + 1 == stats["tier"]["slots_allocated"]
        assert stats["server"]["internal_errors"] == 0
        os.kill(survivor, signal.SIGTERM)  # its second signal: the drain ends at once
        code = await asyncio.wait_for(server.proc.wait(), 30)
    finally:
        code, stderr = await server.close()
    assert code == 1 and "a worker exited on its own" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert os.listdir(tmp) == [] and gone(survivor)


def test_a_worker_killed_mid_put_and_get_leaves_no_claim_and_no_half_block(scratch: Path) -> None:
    run(killed_worker_scenario(scratch), 180)


async def killed_owner_scenario(tmp: Path) -> None:
    # The parent, which owns the pool, SIGKILLed: its workers cannot serve a block any more, and nobody
    # is left to stop them. Each answers 503 (JSON) meanwhile and /readyz is not 200, then exits by
    # itself: the port is freed and no process keeps the pool's memory mapped.
    server = await Workers.start(tmp, 2, "--quota", "64MiB", "--grace-seconds", "2")
    try:
        clients = await server.pin_clients(2)
        data = os.urandom(5000)
        for client in clients.values():
            assert (await client.put("/v1/blocks/0a", content=data)).status_code in (200, 201)
        server.proc.kill()
        await server.proc.wait()
        for client in clients.values():
            try:
                got = await client.get("/v1/blocks/0a")
                scraped = await client.get("/metrics")  # its figures are asked of the owner
                ready = await client.get("/readyz")
            except httpx.TransportError:
                continue  # that worker is already gone
            for answer in (got, scraped):
                assert_error(answer, 503)
                assert "pool" in answer.json()["error"], answer.text
            assert ready.status_code == 503 and ready.json()["status"] == "lost", ready.text
        await until(lambda: all(gone(pid) for pid in clients), 20, "the workers exited")
        assert await refused(server.url)
        assert server.worker_pids() == []
    finally:
        await server.close()


def test_the_pool_owner_killed_its_workers_answer_503_then_exit(scratch: Path) -> None:
    run(killed_owner_scenario(scratch), 120)


# -- signals with requests in flight ------------------------------------------------------------------


async def signal_in_flight_scenario(tmp: Path, sig: signal.Signals, group: bool) -> None:
    # Eight uploads in flight over the workers when the signal comes: half end within the grace (201),
    # half never do (JSON 503 after the grace). Then every worker has exited, the parent ends as the signal
    # asks (SIGTERM: exit 0; SIGINT, Ctrl-C: by SIGINT, after the same shutdown), and
    # neither the pool's socket nor its private directory is left. ``group``: the signal goes to the
    # parent's whole process group, as a terminal's Ctrl-C does.
    server = await Workers.start(tmp, 2, "--quota", "64MiB", "--grace-seconds", "3", session=group)
    uploads: list[Raw] = []
    try:
        pids = list(await server.pin_clients(2))
        assert sorted(pids) == sorted(server.worker_pids())
        bodies = [os.urandom(6000) for _ in range(8)]
        for i, body in enumerate(bodies):
            uploads.append(await Raw.open(server.url, head(f"PUT /v1/blocks/9{i}", "Content-Length: 6000"), body[:10]))
        await asyncio.sleep(0.3)
        if group:
            os.killpg(server.proc.pid, sig)
        else:
            server.proc.send_signal(sig)
        await asyncio.sleep(0.5)
        assert await refused(server.url)  # the port closed at once
        for raw, body in zip(uploads[::2], bodies[::2], strict=True):  # these end within the grace
            raw.writer.write(body[10:])
        answers = await asyncio.gather(*(raw.answer(15) for raw in uploads))
        for i, answer in enumerate(answers):
            if i % 2 == 0:
                assert answer[0] == 201, answer
            else:
                assert_json_503(answer)
        ended = 0 if sig == signal.SIGTERM else -signal.SIGINT
        code = await asyncio.wait_for(server.proc.wait(), 30)
        assert code == ended
        assert all(gone(pid) for pid in pids)
        assert os.listdir(tmp) == [], os.listdir(tmp)  # no socket, no lock, no directory
    finally:
        for raw in uploads:
            raw.close()
        code, stderr = await server.close()
    assert code == ended, stderr
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr
    cut = re.findall(r"(\d+) request\(s\) still in flight, answered 503", stderr)
    assert sum(map(int, cut)) == 4, stderr  # the workers cut the four uploads that never ended, no other


@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["sigterm", "sigint", "ctrl-c"],
)
def test_a_signal_with_uploads_in_flight_over_workers_gives_them_the_grace_and_ends_as_asked(
    scratch: Path, sig: signal.Signals, group: bool
) -> None:
    run(signal_in_flight_scenario(scratch, sig, group), 120)


async def drain_over_workers_scenario(tmp: Path) -> None:
    # --drain-seconds over workers: after SIGTERM every worker keeps serving, new connections too, with
    # /readyz 503 "draining"; once the drain is over the port refuses connections and the parent exits 0.
    # The drain is long enough for the eight connections below on a loaded machine (they took over 3 s).
    server = await Workers.start(tmp, 2, "--quota", "64MiB", "--drain-seconds", "10")
    try:
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        for _ in range(8):  # each a new connection, taken by either worker
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                ready = await client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
                assert (await client.get("/v1/stats")).json()["server"]["draining"] is True
        await until(lambda: refused(server.url), 30, "the port closed after the drain")
        assert await asyncio.wait_for(server.proc.wait(), 30) == 0
    finally:
        code, stderr = await server.close()
    assert code == 0 and "Traceback" not in stderr, stderr
    assert os.listdir(tmp) == []


def test_a_drain_over_workers_serves_new_connections_then_the_port_closes(scratch: Path) -> None:
    run(drain_over_workers_scenario(scratch), 60)


async def signal_at_start_scenario(tmp: Path, after: float) -> None:
    # SIGTERM while the parent opens the pool and starts its workers: it stops those it started, exits 0,
    # and leaves no socket, no directory and no worker behind.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *APP, "--host", "127.0.0.1", "--port", "0", "--workers", "2", "--quota", "64MiB",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**ENV, "TMPDIR": str(tmp)}, cwd=ROOT,
    )  # fmt: skip
    try:
        await until(lambda: bool(glob.glob(f"{tmp}/aiokvtier-server-*/pool.sock")), 30, "the pool's socket")
        await asyncio.sleep(after)
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()
    assert "Traceback" not in stderr.decode(), stderr.decode()
    assert os.listdir(tmp) == [] and processes_naming(str(tmp) + os.sep) == []


@pytest.mark.parametrize("after", [0.0, 0.01, 0.03, 0.1])
def test_a_signal_while_the_workers_start_stops_them_and_exits_0(scratch: Path, after: float) -> None:
    run(signal_at_start_scenario(scratch, after), 60)
