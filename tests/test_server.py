"""The block service (aiokvtier.server), run as a program on loopback and driven over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import httpx
import pytest

import aiokvtier.server
from aiokvtier import DiskTierConfig, HostTierConfig, _sysinfo
from aiokvtier.server import _app, _blocks, _options

from .conftest import PopulateGate
from .helpers import eventually

ROOT = Path(__file__).resolve().parents[1]
APP = ["-m", "aiokvtier.server"]
LOW_MEMORY = [str(ROOT / "tests" / "low_memory.py"), str(64 << 20), "serve"]
"""``aiokvtier serve`` where only 64 MiB can be made resident now."""
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
CLIENTS = 32
BLOCKS_PER_CLIENT = 12
SLOT = 64 << 10


class Server:
    """A server process on a free loopback port (it binds port 0 and prints the port it got)."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, *options: str, program: Sequence[str] = APP) -> Server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *program, "--host", "127.0.0.1", "--port", "0", *options,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV, cwd=ROOT,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            assert match, line
        except BaseException:
            if proc.returncode is None:
                proc.kill()
            raise
        return cls(proc, match.group(1))

    async def stop(self, seconds: float = 30) -> tuple[int, str]:
        """SIGTERM, then the exit code and stderr (killed, and the test failed, past ``seconds``)."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stderr is not None
        try:
            stderr = await asyncio.wait_for(self.proc.stderr.read(), seconds)
            code = await asyncio.wait_for(self.proc.wait(), seconds)
        except TimeoutError:
            pytest.fail(f"the server did not exit within {seconds} s of SIGTERM")
        finally:
            if self.proc.returncode is None:  # timed out, or the test was cancelled meanwhile: never left behind
                self.proc.kill()
        return code, stderr.decode()


async def wait_for(client: httpx.AsyncClient, path: str, status: int, *, seconds: float = 30) -> httpx.Response:
    deadline = time.monotonic() + seconds
    for _ in range(int(seconds / 0.02)):
        response = await client.get(path)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.02)
    return response


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, (response.request.method, response.request.url, response.text)
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]


async def bad_requests(client: httpx.AsyncClient, victim: str) -> None:
    """Malformed requests, many aimed at a stored block: each answered with its status and a JSON error."""
    too_long = "a" * 129
    assert victim != victim.upper()
    assert_error(await client.put("/v1/blocks/zz", content=b"x"), 400)
    assert_error(await client.put("/v1/blocks/ABCD", content=b"x"), 400)
    assert_error(await client.put(f"/v1/blocks/{victim.upper()}", content=b"x"), 400)
    assert_error(await client.put(f"/v1/blocks/{too_long}", content=b"x"), 400)
    assert_error(await client.get(f"/v1/blocks/{too_long}"), 400)
    assert_error(await client.delete("/v1/blocks/0x12"), 400)
    assert_error(await client.put(f"/v1/blocks/{victim}", content=b""), 400)
    assert_error(await client.put(f"/v1/blocks/{victim}", content=bytes(SLOT + 1)), 413)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: refused while reading
        for _ in range(3):
            yield bytes(SLOT // 2)

    assert_error(await client.put(f"/v1/blocks/{victim}", content=chunks()), 413)
    for body in (b"{", b"[]", b'{"keys": "ab"}', b'{"keys": [1]}', b'{"keys": ["AB"]}', b"\xff", b'{"nokeys": 1}'):
        assert_error(await client.post("/v1/lookup", content=body), 400)
    assert_error(await client.get("/v1/nothing-here"), 404)
    assert_error(await client.get("/v1/blocks"), 404)
    wrong = await client.post(f"/v1/blocks/{victim}", content=b"x")
    assert_error(wrong, 405)
    assert {m.strip() for m in wrong.headers["allow"].split(",")} == {"GET", "HEAD", "PUT", "DELETE"}
    assert_error(await client.put("/v1/lookup", content=b"{}"), 405)
    assert_error(await client.delete("/healthz"), 405)


async def client_run(url: str, seed: int, stored: dict[str, str]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        mine: list[str] = []
        for i in range(BLOCKS_PER_CLIENT):
            key = f"a{seed:02x}{i:02x}" + rng.randbytes(rng.randrange(0, 62)).hex()
            data = rng.randbytes(rng.randrange(1, SLOT + 1)) if i else rng.randbytes(SLOT)  # a full slot, then any
            response = await client.put(f"/v1/blocks/{key}", content=data)
            assert response.status_code == 201, response.text
            assert response.json() == {"key": key, "bytes": len(data)}
            stored[key] = digest(data)
            mine.append(key)
            if i % 4 == 0:
                await bad_requests(client, key)
            again = await client.put(f"/v1/blocks/{key}", content=b"other")  # present: not overwritten
            assert again.status_code == 200
            got = await client.get(f"/v1/blocks/{mine[rng.randrange(len(mine))]}")
            assert got.status_code == 200 and got.headers["content-type"] == "application/octet-stream"
            assert digest(got.content) == stored[str(got.url).rsplit("/", 1)[1]]
        hits = await client.post("/v1/lookup", json={"keys": [*mine, "f" * 128, mine[0]]})
        assert hits.status_code == 200 and hits.json() == {"hits": len(mine)}


async def in_flight_put(url: str, key: str, data: bytes, server: Server) -> bytes:
    """A chunked PUT whose body is still arriving when SIGTERM lands; returns the response's status line."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"PUT /v1/blocks/{key} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    half = len(data) // 2
    writer.write(head.encode() + b"%x\r\n" % half + data[:half] + b"\r\n")
    await writer.drain()
    await asyncio.sleep(0.2)
    server.proc.send_signal(signal.SIGTERM)
    # Not ready from the signal on: a request that still gets in is answered 503 "draining", and
    # once uvicorn has closed the listening socket (within its 0.1 s tick) a connection is refused.
    # A connection made in that tick but not yet read is closed unanswered by uvicorn's shutdown
    # ("closed"): a client retries it, as it does a refused one.
    seen = [await readyz_after_signal(url)]
    for _ in range(250):
        if seen[-1] == "refused":
            break
        await asyncio.sleep(0.02)
        seen.append(await readyz_after_signal(url))
    assert set(seen) <= {"draining", "closed", "refused"} and seen[-1] == "refused", seen
    assert server.proc.returncode is None  # waiting for this request
    rest = data[half:]
    writer.write(b"%x\r\n" % len(rest) + rest + b"\r\n0\r\n\r\n")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return status


async def readyz_after_signal(url: str) -> str:
    """``"draining"`` (a 503 with that status), ``"closed"`` (no answer), ``"refused"``, or what else
    ``/readyz`` answered."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            response = await client.get("/readyz")
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "closed"
    body = response.json()
    if response.status_code == 503 and body["status"] == "draining":
        assert {"resident_bytes", "target_bytes", "fraction"} <= set(body)
        return "draining"
    return f"{response.status_code} {body}"


async def oversized_declared(url: str) -> bytes:
    """Content-Length past a slot and no body sent: the 413 comes without the body being read."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"PUT /v1/blocks/abc HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return status


async def scenario() -> None:
    server = await Server.start("--quota", "3GiB", "--max-quota", "3GiB", "--slot-size", "64KiB")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            health = await wait_for(client, "/healthz", 200, seconds=10)
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            ready = await client.get("/readyz")
            assert ready.status_code in (200, 503)
            assert {"resident_bytes", "target_bytes", "fraction", "fill_error"} <= set(ready.json())
            assert ready.json()["target_bytes"] == 3 << 30
            if ready.status_code == 503:
                assert ready.json()["resident_bytes"] == 0 and ready.json()["status"] == "filling"
            at_start = (await client.get("/v1/stats")).json()["tier"]
            # The clients start now, while the 3 GiB tier fills (seconds on the CI machine): their
            # stores wait for their slots' units, and /readyz turns 200 meanwhile.
            assert at_start["filling"] and at_start["resident_bytes"] < 3 << 30, at_start

            stored: dict[str, str] = {}
            clients = asyncio.gather(*(client_run(server.url, seed, stored) for seed in range(CLIENTS)))
            ready = await wait_for(client, "/readyz", 200)
            assert ready.status_code == 200 and ready.json()["resident_bytes"] > 0
            await asyncio.wait_for(clients, 60)
            assert len(stored) == CLIENTS * BLOCKS_PER_CLIENT
            for key, want in stored.items():  # nothing the bad requests or the second PUTs sent changed a block
                got = await client.get(f"/v1/blocks/{key}")
                assert got.status_code == 200 and digest(got.content) == want
            assert (await oversized_declared(server.url)).startswith(b"HTTP/1.1 413")

            victim = next(iter(stored))
            assert (await client.delete(f"/v1/blocks/{victim}")).status_code == 204
            assert_error(await client.get(f"/v1/blocks/{victim}"), 404)
            assert_error(await client.delete(f"/v1/blocks/{victim}"), 404)
            assert_error(await client.get("/v1/blocks/" + "0" * 128), 404)

            stats = (await client.get("/v1/stats")).json()
            assert stats["server"] == {"draining": False, "internal_errors": 0}
            assert stats["store"]["blocks"] == len(stored) - 1 == stats["tier"]["slots_allocated"]
            assert stats["tier"]["quota"] == 3 << 30 and stats["tier"]["slot_size"] == SLOT
            print("resident when the clients started:", at_start["resident_bytes"], "of", 3 << 30)

            metrics = await client.get("/metrics")
            assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
            names = set(re.findall(r"^(aiokvtier_\w+)", metrics.text, re.M))
            assert any("resident" in n for n in names) and any("block" in n for n in names), names

        data = os.urandom(SLOT)
        status = await in_flight_put(server.url, "ab" * 8, data, server)
        assert status.startswith(b"HTTP/1.1 201"), status
    finally:
        code, stderr = await server.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr


def test_server_serves_verified_blocks_to_concurrent_clients_while_filling_and_exits_0_on_sigterm() -> None:
    # The server under test runs its own loop in its own process; this loop only drives it, once.
    asyncio.run(asyncio.wait_for(scenario(), 120))


async def drain_scenario() -> None:
    server = await Server.start("--quota", "64MiB", "--drain-seconds", "3")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            data = os.urandom(5000)
            assert (await client.put("/v1/blocks/abcd", content=data)).status_code == 201
            server.proc.send_signal(signal.SIGTERM)
            draining = await wait_for(client, "/readyz", 503, seconds=2)
            assert draining.status_code == 503 and draining.json()["status"] == "draining"
            # Still serving everything else during the drain, on new connections too.
            assert await readyz_after_signal(server.url) == "draining"
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/v1/blocks/abcd")).content == data
            assert (await client.put("/v1/blocks/abce", content=data)).status_code == 201
            assert (await client.get("/v1/stats")).json()["server"]["draining"] is True
        await asyncio.wait_for(server.proc.wait(), 30)  # the drain ends by itself, no second signal
        assert await readyz_after_signal(server.url) == "refused"
    finally:
        code, stderr = await server.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr


async def sigint_scenario() -> None:
    # SIGINT (Ctrl-C) while a 2 GiB tier is still filling: the fill stops, the store and the tier
    # close, and the process ends by SIGINT, as every aiokvtier command does after Ctrl-C (a shell
    # shows 130; it exited 0, as after SIGTERM, before).
    server = await Server.start("--quota", "2GiB")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/healthz", 200, seconds=10)).status_code == 200
            data = os.urandom(3000)
            assert (await client.put("/v1/blocks/5eed", content=data)).status_code == 201
            assert (await client.get("/v1/blocks/5eed")).content == data
            tier = (await client.get("/v1/stats")).json()["tier"]
        server.proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(server.proc.wait(), 30)
    finally:
        code, stderr = await server.stop()
    assert code == -signal.SIGINT, stderr
    assert not stderr, stderr
    print("resident at SIGINT:", tier["resident_bytes"], "of", tier["target_bytes"])


def test_sigint_while_the_tier_fills_closes_it_and_ends_by_sigint() -> None:
    asyncio.run(asyncio.wait_for(sigint_scenario(), 60))


@pytest.mark.parametrize("command", [["-m", "aiokvtier", "serve"], [*APP, "--workers", "2"]], ids=["serve", "workers"])
def test_ctrl_c_ends_aiokvtier_serve_and_its_workers_by_sigint(command: list[str]) -> None:
    """The command's own Ctrl-C: the same shutdown, then the process ends by SIGINT (it exited 0 before)."""
    proc = subprocess.Popen(
        [sys.executable, *command, "--quota", "64MiB", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())
        assert url, proc.stderr
        with httpx.Client(base_url=url.group(0), timeout=30) as client:
            deadline = time.monotonic() + 30
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "not ready in 30 s"
                time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGINT and not err, err


def test_drain_seconds_keeps_serving_with_readyz_503_then_exits_0() -> None:
    asyncio.run(asyncio.wait_for(drain_scenario(), 60))


# -- shutdown with clients that stall ----------------------------------------------------------------

GRACE = 1.0
BOUND = GRACE + 8  # the grace, the 503s' second, the connections' second, closing a tier: never 30 s


class Raw:
    """A bare HTTP/1.1 connection that sends what it is told, and reads one answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str, head: str, body: bytes = b"", *, receive_buffer: int | None = None) -> Raw:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        if receive_buffer is not None:  # before connect: the window it advertises stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(head.encode() + body)
        await writer.drain()
        return cls(reader, writer)

    async def answer(self, seconds: float = BOUND, *, to_end: bool = True) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of the answer, then the connection closed here; status 0 when the
        server closed it without one. The body is the rest of the stream (what the server sent until it
        closed: answers to later requests too); with ``to_end`` False, the answer's ``Content-Length``
        bytes, for an answer that leaves the connection open (``--keep-alive``)."""
        try:
            async with asyncio.timeout(seconds):
                try:
                    data = await self.reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as exc:  # closed before a whole head came
                    if exc.partial:
                        raise
                    return 0, {}, b""
                except ConnectionResetError:
                    return 0, {}, b""
                status_line, *lines = data[:-4].decode().split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
                length = headers.get("content-length")
                whole = to_end or length is None
                try:
                    body = await (self.reader.read() if whole else self.reader.readexactly(int(length)))
                except ConnectionResetError:  # reset under the bytes still coming: the answer's head stands
                    body = b""
        finally:
            self.close()
        return int(status_line.split()[1]), headers, body

    def close(self) -> None:
        self.writer.close()


def head(request_line: str, *fields: str) -> str:
    return "\r\n".join([f"{request_line} HTTP/1.1", "Host: x", *fields]) + "\r\n\r\n"


def assert_json_503(answer: tuple[int, dict[str, str], bytes]) -> None:
    status, headers, body = answer
    assert status == 503, answer
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
    message = json.loads(body)
    assert list(message) == ["error"] and "shutting down" in message["error"], message


async def stopped_within(server: Server, seconds: float) -> str:
    """The server exits 0 by itself, within ``seconds``, with nothing on stderr that looks like a traceback."""
    try:
        code = await asyncio.wait_for(server.proc.wait(), seconds)
    except TimeoutError:
        pytest.fail(f"the server was still running {seconds} s after SIGTERM")
    code, stderr = await server.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr and "500" not in stderr, stderr
    return stderr


async def stuck_uploads_scenario() -> None:
    server = await Server.start("--quota", "64MiB", "--grace-seconds", str(GRACE))
    raws: list[Raw] = []
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            # A client that goes away mid-body: no answer to send, nothing logged, the server serves on.
            gone = await Raw.open(server.url, head("PUT /v1/blocks/ab", "Content-Length: 5000"), b"x")
            await asyncio.sleep(0.1)
            gone.close()
            await asyncio.sleep(0.1)
            assert (await client.get("/v1/stats")).json()["server"]["internal_errors"] == 0
        raws += [
            await Raw.open(server.url, head("PUT /v1/blocks/cd", "Content-Length: 5000"), b"x" * 100),
            await Raw.open(server.url, head("PUT /v1/blocks/ef", "Transfer-Encoding: chunked"), b"10\r\n" + b"y" * 16),
            await Raw.open(server.url, head("POST /v1/lookup", "Content-Length: 100"), b'{"keys": ['),
        ]
        await asyncio.sleep(0.2)  # their handlers are reading the bodies
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(*(raw.answer() for raw in raws))
        waited = time.monotonic() - started
        for answer in answers:
            assert_json_503(answer)
        assert GRACE * 0.9 <= waited < BOUND, waited  # the grace was given, then it ended
        stderr = await stopped_within(server, BOUND)
        assert "3 request(s) still in flight, answered 503" in stderr, stderr
    finally:
        for raw in raws:
            raw.close()
        await server.stop()


def test_sigterm_with_bodies_stuck_mid_upload_answers_json_503_after_the_grace_and_exits_0() -> None:
    asyncio.run(asyncio.wait_for(stuck_uploads_scenario(), 60))


async def idle_scenario() -> None:
    # Nothing in flight: a slowloris client part way through its headers and an idle keep-alive
    # connection are closed when the shutdown starts; the grace (long here) is not waited for.
    server = await Server.start("--quota", "64MiB", "--grace-seconds", "60")
    slow: Raw | None = None
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            slow = await Raw.open(server.url, "PUT /v1/blocks/ab HTTP/1.1\r\nHost: x\r\nContent-Le")
            await asyncio.sleep(0.2)
            server.proc.send_signal(signal.SIGTERM)
            assert await slow.answer(10) == (0, {}, b"")  # closed, no answer: there was no request to answer
            await stopped_within(server, 10)
    finally:
        if slow is not None:
            slow.close()
        await server.stop()


def test_sigterm_with_a_slowloris_header_and_an_idle_keepalive_connection_exits_0_at_once() -> None:
    asyncio.run(asyncio.wait_for(idle_scenario(), 60))


async def stuck_reader_scenario() -> None:
    # A GET of a 16 MiB block by a client that reads none of it: most of the answer stays in the
    # server's write buffer, and its connection would stay open for as long as the client likes.
    server = await Server.start("--quota", "64MiB", "--slot-size", "16MiB", "--grace-seconds", str(GRACE))
    raw: Raw | None = None
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            assert (await client.put("/v1/blocks/b16", content=os.urandom(16 << 20))).status_code == 201
        raw = await Raw.open(server.url, head("GET /v1/blocks/b16"), receive_buffer=4096)
        await asyncio.sleep(0.5)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await stopped_within(server, BOUND)
        assert time.monotonic() - started >= GRACE * 0.9  # it had its grace
    finally:
        if raw is not None:
            raw.close()
        await server.stop()


def test_sigterm_with_a_client_not_reading_its_response_exits_0_after_the_grace() -> None:
    asyncio.run(asyncio.wait_for(stuck_reader_scenario(), 60))


async def second_signal_scenario() -> None:
    server = await Server.start("--quota", "64MiB", "--grace-seconds", "60")
    raw: Raw | None = None
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
        raw = await Raw.open(server.url, head("PUT /v1/blocks/ab", "Content-Length: 5000"), b"x" * 10)
        await asyncio.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert server.proc.returncode is None  # waiting for the upload, as long as the grace allows
        server.proc.send_signal(signal.SIGTERM)  # a second signal ends the grace at once
        assert_json_503(await raw.answer(10))
        await stopped_within(server, 10)
    finally:
        if raw is not None:
            raw.close()
        await server.stop()


def test_a_second_sigterm_ends_the_grace_at_once() -> None:
    asyncio.run(asyncio.wait_for(second_signal_scenario(), 60))


async def test_cut_answers_a_request_stuck_in_a_store_call_with_json_503() -> None:
    # In process: a PUT whose store call never returns (a tier still filling, say) is cancelled by
    # cut() and answered 503 in JSON; later requests are answered 503 at once. A cancellation that
    # is not cut()'s (the client's, here) goes through untouched.
    entered, never = asyncio.Event(), asyncio.Event()

    class Stuck(_blocks.DictBlocks):
        async def put(self, key: bytes, body: bytes) -> _blocks.Put:
            entered.set()
            await never.wait()
            raise AssertionError("unreachable")

    service = _app.Service(Stuck(1 << 20, 1 << 16))
    app = service.app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        async with app.router.lifespan_context(app):
            put = asyncio.create_task(client.put("/v1/blocks/ab", content=b"block"))
            await asyncio.wait_for(entered.wait(), 10)
            abandoned = asyncio.create_task(client.put("/v1/blocks/cd", content=b"block"))
            await eventually(lambda: service.in_flight == 2)
            abandoned.cancel()
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            assert service.in_flight == 1
            assert service.cut() == 1
            answer = await asyncio.wait_for(put, 10)
            assert_error(answer, 503)
            assert answer.headers["connection"] == "close" and "shutting down" in answer.json()["error"]
            later = await client.get("/healthz")
            assert_error(later, 503)
            assert service.in_flight == 0 and service.internal_errors == 0
            assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def plain_dict_scenario() -> None:
    server = await Server.start("--plain-dict", "--quota", "256KiB")  # four 64 KiB blocks, oldest dropped first
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200, seconds=10)).status_code == 200
            blocks = {f"a{i:x}": os.urandom(1000 + i) for i in range(5)}
            for key, data in blocks.items():
                assert (await client.put(f"/v1/blocks/{key}", content=data)).status_code == 201
            assert_error(await client.get("/v1/blocks/a0"), 404)
            assert (await client.get("/v1/blocks/a4")).content == blocks["a4"]
            assert (await client.post("/v1/lookup", json={"keys": ["a1", "a2", "a0"]})).json() == {"hits": 2}
            await bad_requests(client, "a1")
            assert (await client.get("/v1/blocks/a1")).content == blocks["a1"]
            assert (await client.get("/v1/stats")).json()["server"]["internal_errors"] == 0
            metrics = await client.get("/metrics")  # the baseline has no collectors: as docs/server.md says
            assert metrics.status_code == 200 and metrics.content == b""
    finally:
        code, stderr = await server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr


def test_plain_dict_baseline_serves_the_same_api() -> None:
    asyncio.run(asyncio.wait_for(plain_dict_scenario(), 60))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--quota", "2XB"], "--quota"),
        (["--quota", "2GiB", "--max-quota", "1GiB"], "--max-quota"),
        (["--quota", "1GiB", "--slot-size", "1000"], "--slot-size"),
        (["--policy", "fifo"], "--policy"),
        (["--backing", "vmm"], "--backing"),
        (["--port", "70000"], "--port"),
        (["--log-level", "loud"], "--log-level"),
        (["--drain-seconds", "-1"], "--drain-seconds"),
        (["--drain-seconds", "nan"], "--drain-seconds"),
        (["--grace-seconds", "-1"], "--grace-seconds"),
        (["--grace-seconds", "nan"], "--grace-seconds"),
        (["--keep-alive", "0"], "--keep-alive"),
        (["--keep-alive", "1.5"], "--keep-alive"),
        (["--plain-dict", "--policy", "s3fifo"], "argument --policy: "),  # it was ignored: the dict drops its oldest
    ],
)
def test_a_bad_option_is_one_line_naming_it_and_exit_2(options: list[str], named: str) -> None:
    done = subprocess.run(
        [sys.executable, *APP, *options], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and named in lines[0], done.stderr
    # The advice names options too ("set --device", "raise --max-quota"), not the config's fields.
    assert not re.search(r"\b(set|raise|lower) (device|max_quota|quota)\b", lines[0]), lines[0]


def test_the_backing_help_names_what_auto_picks() -> None:
    """``--backing``'s help says what ``"auto"`` resolves to with ``--device``, as the config does."""
    picked = HostTierConfig(quota="64MiB", device=0).resolved_backing
    (action,) = [a for a in _options.build_parser()._actions if "--backing" in a.option_strings]
    assert f"auto: {picked} with --device" in action.help
    assert not any(f"auto: {other} with" in action.help for other in ("host", "register", "vmm") if other != picked)


async def test_readyz_is_503_before_the_tier_opens_and_while_draining() -> None:
    config = HostTierConfig(quota="64MiB", max_quota="64MiB", slot_size="64KiB", backing="host")
    service = _app.Service(_blocks.StoreBlocks(config, "lru"))
    app = service.app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        before = await client.get("/readyz")
        assert before.status_code == 503 and before.json()["status"] == "filling"
        assert before.json()["resident_bytes"] == 0 and before.json()["fill_error"] is None
        async with app.router.lifespan_context(app):
            await service.blocks.tier.wait_resident(1)
            ready = await client.get("/readyz")
            assert ready.status_code == 200 and 0 < ready.json()["fraction"] <= 1
            service.draining = True  # what SIGTERM and SIGINT do first
            draining = await client.get("/readyz")
            assert draining.status_code == 503 and draining.json()["status"] == "draining"
            assert (await client.get("/healthz")).status_code == 200
        assert json.loads((await client.get("/healthz")).text) == {"status": "ok"}


async def test_put_is_507_when_every_slot_is_held_by_a_store_still_copying(gate: PopulateGate) -> None:
    # 17 PUTs on a 16-slot tier before its one unit is resident: they wait in arrival order; when the
    # unit lands, the first 16 take the slots and start copying, and the 17th finds no free slot and
    # no block ready to evict (every slot is a block still being stored), so the store skips it.
    config = HostTierConfig(quota="1MiB", max_quota="1MiB", slot_size="64KiB", commit_unit="1MiB", fill_chunk="1MiB")
    service = _app.Service(_blocks.StoreBlocks(config, "lru"))
    app = service.app()
    blocks = {f"{i:02x}": os.urandom(1000 + i) for i in range(17)}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        async with app.router.lifespan_context(app):
            store, tier = service.blocks.store, service.blocks.tier
            puts = []
            for n, (key, data) in enumerate(blocks.items(), 1):
                puts.append(asyncio.create_task(client.put(f"/v1/blocks/{key}", content=data)))
                await eventually(lambda n=n: store.statistics().in_flight == n)
            ready = (await client.get("/readyz")).json()
            assert ready["status"] == "filling" and ready["resident_bytes"] == 0
            assert tier.statistics().slots_allocated == 0 and not any(p.done() for p in puts)

            gate.release_all()
            answers = [await p for p in puts]
            assert [a.status_code for a in answers[:16]] == [201] * 16, [a.text for a in answers]
            assert_error(answers[16], 507)
            assert "no room" in answers[16].json()["error"]
            assert b"10" not in store and len(store) == 16 == tier.statistics().slots_total
            for key, data in list(blocks.items())[:16]:  # the skip changed no stored block
                got = await client.get(f"/v1/blocks/{key}")
                assert got.status_code == 200 and got.content == data

            again = await client.put("/v1/blocks/10", content=blocks["10"])  # now a ready block can be evicted
            assert again.status_code == 201, again.text
            assert (await client.get("/v1/blocks/10")).content == blocks["10"]
            stats = (await client.get("/v1/stats")).json()
            assert stats["store"]["skipped"] == 1 and stats["store"]["evictions"] == 1
            assert stats["store"]["blocks"] == 16 and stats["server"]["internal_errors"] == 0
            metrics = (await client.get("/metrics")).text
            assert re.search(r'^aiokvtier_store_skipped_total\{store="default"\} 1\.0$', metrics, re.M), metrics


async def test_a_fill_that_fails_before_any_unit_is_503_failed_and_every_put_507(gate: PopulateGate) -> None:
    # The tier's first commit unit cannot be made resident (populate fails with ENOMEM): no slot
    # can ever be taken, so a PUT is skipped (507), and /readyz says "failed", not "filling".
    config = HostTierConfig(quota="2MiB", max_quota="2MiB", slot_size="64KiB", commit_unit="1MiB", fill_chunk="1MiB")
    service = _app.Service(_blocks.StoreBlocks(config, "lru"))
    app = service.app()
    transport = httpx.ASGITransport(app=app)
    gate.fail(0)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        async with app.router.lifespan_context(app):
            tier = service.blocks.tier
            await eventually(lambda: tier.statistics().fill_error is not None)
            ready = await client.get("/readyz")
            assert ready.status_code == 503, ready.text
            body = ready.json()
            assert body["status"] == "failed" and body["resident_bytes"] == 0
            assert "injected failure" in body["fill_error"]
            assert (await client.get("/healthz")).status_code == 200  # alive, not ready
            for key in ("ab", "cd"):
                answer = await client.put(f"/v1/blocks/{key}", content=b"block")
                assert_error(answer, 507)
                assert_error(await client.get(f"/v1/blocks/{key}"), 404)
            assert (await client.post("/v1/lookup", json={"keys": ["ab"]})).json() == {"hits": 0}
            stats = (await client.get("/v1/stats")).json()
            assert stats["store"]["skipped"] == 2 and stats["store"]["blocks"] == 0
            assert stats["tier"]["slots_allocated"] == 0 and stats["server"]["internal_errors"] == 0
            metrics = (await client.get("/metrics")).text
            assert re.search(r'^aiokvtier_tier_fill_errors\{tier="default"\} 1\.0$', metrics, re.M), metrics


# -- the package: entry points, the extra -------------------------------------------------------

WEB = ("starlette", "uvicorn", "prometheus_client", "httpx", "h11", "anyio")
WITHOUT_THE_EXTRA = "import sys\nfor name in {names!r}: sys.modules[name] = None  # as if not installed\n"


def _python(code: str, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT
    )


def test_importing_aiokvtier_and_its_server_imports_no_web_framework() -> None:
    done = _python(
        "import sys, aiokvtier, aiokvtier.server, aiokvtier.server.load, aiokvtier.server.__main__\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {WEB!r}))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_console_script_and_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    module, _, name = project["scripts"]["aiokvtier-server"].partition(":")
    assert getattr(importlib.import_module(module), name) is aiokvtier.server.main
    extras = {extra: " ".join(reqs) for extra, reqs in project["optional-dependencies"].items()}
    for needed in ("starlette", "uvicorn", "prometheus-client", "httpx"):
        assert needed in extras["server"], needed
    assert "torch" in extras["torch"] and "aiokvtier[cuda]" in extras["torch"]


@pytest.mark.parametrize("missing", [("starlette",), ("uvicorn",), ("prometheus_client",), WEB])
def test_without_the_server_extra_the_server_says_what_to_install_and_exits_1(missing: tuple[str, ...]) -> None:
    prelude = WITHOUT_THE_EXTRA.format(names=missing)
    done = _python(
        prelude + "import runpy\nsys.argv = ['x', '--quota', '64MiB', '--port', '0']\n"
        "runpy.run_module('aiokvtier.server', run_name='__main__')"
    )
    assert done.returncode == 1 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "pip install 'aiokvtier[server]'" in lines[0], done.stderr
    assert lines[0].startswith("python -m aiokvtier.server: error: ")
    # The options answer without it: --help, and one line for a bad one.
    helped = _python(prelude + "from aiokvtier.server import main\nsys.exit(main(['--help']))")
    assert helped.returncode == 0 and "--drain-seconds" in helped.stdout, helped.stderr
    bad = _python(prelude + "from aiokvtier.server import main\nsys.exit(main(['--quota', '2XB'], prog='serve'))")
    assert bad.returncode == 2 and bad.stderr.startswith("serve: error: argument --quota"), bad.stderr


def test_the_load_generator_answers_help_and_says_what_to_install_without_httpx() -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "aiokvtier.server.load", "--help"],
        capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert helped.returncode == 0 and "--clients" in helped.stdout, helped.stderr
    assert "stop after this long (default: 10)" in " ".join(helped.stdout.split())
    done = _python(
        WITHOUT_THE_EXTRA.format(names=("httpx",)) + "import runpy\nsys.argv = ['x', '--seconds', '1']\n"
        "runpy.run_module('aiokvtier.server.load', run_name='__main__')"
    )
    assert done.returncode == 1 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "httpx" in lines[0] and "pip install 'aiokvtier[server]'" in lines[0], done.stderr


LOAD = [sys.executable, "-m", "aiokvtier.server.load"]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--clients", "0"], "argument --clients: '0' is not 1 or more"),
        (["--clients", "x"], "argument --clients: 'x' is not a whole number"),
        (["--seconds", "-1"], "argument --seconds: '-1' must be a positive number of seconds"),
        (["--seconds", "nan"], "argument --seconds: 'nan' must be a positive number of seconds"),
        (["--seconds", "soon"], "argument --seconds: 'soon' is not a number of seconds"),
        (["--requests", "0"], "argument --requests: '0' is not 1 or more"),
        (["--block-size", "0"], "argument --block-size: '0' is not 1 or more"),
        (["--lookup-keys", "0"], "argument --lookup-keys: '0' is not 1 or more"),
        (["--url", "127.0.0.1:8077"], "argument --url: '127.0.0.1:8077' is not an http:// or https:// URL"),
        (["--url", "http://"], "argument --url: 'http://' names no host"),
        (["--url", "http://127.0.0.1:x"], "argument --url: 'http://127.0.0.1:x' is not a URL: "),
        (["--url", "http://127.0.0.1:99999"], "argument --url: 'http://127.0.0.1:99999' is not a URL: "),
        (["--url", "http://[::1:8077"], "argument --url: 'http://[::1:8077' is not a URL: "),
    ],
)
def test_the_load_generator_refuses_a_bad_option_in_one_line(options: list[str], says: str) -> None:
    """Before, each was taken, and ended in a traceback (or a load of no clients; a URL with no host, a port
    that is not one: still a traceback); then its words were not those of ``aiokvtier``'s commands for
    the same mistake ("0 is not 1 or more", "-1.0 is not ...")."""
    done = subprocess.run([*LOAD, *options], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m aiokvtier.server.load: error: {says}"), lines


def test_the_load_generator_says_in_one_line_that_no_server_answers() -> None:
    """Before: two chained tracebacks from httpx."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = subprocess.run(
        [*LOAD, "--url", f"http://127.0.0.1:{port}", "--clients", "2", "--seconds", "1"],
        capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"python -m aiokvtier.server.load: error: no answer from http://127.0.0.1:{port}: "
    ), lines


async def test_ctrl_c_ends_the_load_generator_at_once_and_quietly() -> None:
    """As a benchmark: no JSON, no traceback (it printed a KeyboardInterrupt traceback), ended by SIGINT."""
    server = await Server.start("--quota", "256MiB")
    try:
        load = await asyncio.create_subprocess_exec(
            *LOAD, "--url", server.url, "--clients", "2", "--seconds", "30",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV, cwd=ROOT,
        )  # fmt: skip
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            deadline = time.monotonic() + 30
            while (await client.get("/v1/stats")).json()["store"]["stores"] == 0:
                assert time.monotonic() < deadline, "the load sent nothing in 30 s"
                await asyncio.sleep(0.05)
        load.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(load.communicate(), 30)
    finally:
        code, stderr = await server.stop()
    assert code == 0, stderr
    assert load.returncode == -signal.SIGINT and out == b"" and err == b"", err


def test_help_describes_every_option_with_its_default() -> None:
    parser = _options.build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        assert action.help and len(action.help) > 10, action.option_strings
        shown = formatter._get_help_string(action) or ""
        assert action.default in (None, False, argparse.SUPPRESS) or "default" in shown, (action.option_strings, shown)
    done = subprocess.run(
        [sys.executable, *APP, "--help"], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT
    )
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    for default in ("(default: 1GiB)", "(default: 64KiB)", "(default: host)", "(default: lru)", "(default: warning)"):
        assert default in text, default
    # Seconds as the other commands show them (it showed "10.0", "0.0"), and a default said once.
    for default in ("answering them 503 and closing every connection (default: 10)", "readyz 503 (default: 0)"):
        assert default in text, default
    assert "(default: the quota)" in text and "(default: the quota) (default" not in text


def _fuzz_request(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """A request from a grammar of what clients get wrong: methods, paths, bodies and headers.

    Weighted towards the paths that exist, so that each gets its wrong methods, keys and bodies.
    """
    method = rng.choice(["GET", "PUT", "PUT", "DELETE", "POST", "POST", "PATCH", "HEAD", "OPTIONS"])
    key = rng.choice([rng.randbytes(rng.randrange(1, 8)).hex()] * 6 + [  # valid, in a space the victims are not in
        "", "A1", "0x1f", "g" * 3, "a" * 129, "ab%2Fcd", "%ff", "ab%00", "..", "é", "ab cd", "-1", "1e9",
    ])  # fmt: skip
    path = rng.choice([f"/v1/blocks/{key}"] * 6 + ["/v1/lookup"] * 4 + [
        f"/v1/blocks/{key}/x", "/v1/blocks", "/v1/stats", "/metrics", "/readyz", "/healthz", "/", "/v1",
        "//v1/blocks/ab", "/v1/blocks/ab?x=1",
    ])  # fmt: skip
    body = rng.choice([
        b"", b"x", rng.randbytes(rng.randrange(1, SLOT + 1)), bytes(SLOT + rng.randrange(1, 3)), b"{",
        b'{"keys": []}', b'{"keys": ["ab", "cd"]}', b'{"keys": "ab"}', b'{"keys": [1, null]}', b"[" * 5000,
        json.dumps({"keys": ["a"] * 5000}).encode(), b'{"keys": ["\\ud800"]}', b"\xff\xfe", b"null",
    ])  # fmt: skip
    headers = rng.choice([{}, {"content-type": "application/json"}, {"content-type": "text/plain; charset=bogus"}])
    return method, path, body, headers


async def test_no_malformed_request_gets_a_500_or_changes_a_stored_block() -> None:
    config = HostTierConfig(quota="8MiB", max_quota="8MiB", slot_size="64KiB", backing="host")
    service = _app.Service(_blocks.StoreBlocks(config, "lru"))
    app = service.app()
    rng = random.Random(20260)
    victims = {f"f00d{i:04x}" + "0" * 60: rng.randbytes(rng.randrange(1, SLOT + 1)) for i in range(8)}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        async with app.router.lifespan_context(app):
            await service.blocks.tier.wait_resident()
            for key, data in victims.items():
                assert (await client.put(f"/v1/blocks/{key}", content=data)).status_code == 201
            seen: dict[int, int] = {}
            for _ in range(600):
                method, path, body, headers = _fuzz_request(rng)
                answer = await client.request(method, path, content=body, headers=headers)
                seen[answer.status_code] = seen.get(answer.status_code, 0) + 1
                assert answer.status_code < 500, (method, path, body[:40], answer.text)
                if answer.status_code >= 400 and method != "HEAD":
                    assert_error(answer, answer.status_code)
            for key, data in victims.items():  # 120 blocks fit: nothing evicted them, nothing changed them
                got = await client.get(f"/v1/blocks/{key}")
                assert got.status_code == 200 and got.content == data
            stats = (await client.get("/v1/stats")).json()
            assert stats["server"]["internal_errors"] == 0
    assert {200, 201, 400, 404, 405, 413} <= set(seen), seen


@pytest.mark.cuda
def test_server_on_a_vmm_tier_serves_blocks_and_exits_0() -> None:
    async def run() -> None:
        server = await Server.start("--quota", "1GiB", "--backing", "vmm", "--device", "0")
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                assert (await wait_for(client, "/readyz", 200)).status_code == 200
                blocks = {f"{i:x}": os.urandom(1000 * (i + 1)) for i in range(16)}
                for key, data in blocks.items():
                    assert (await client.put(f"/v1/blocks/{key}", content=data)).status_code == 201
                for key, data in blocks.items():
                    assert (await client.get(f"/v1/blocks/{key}")).content == data
                tier = (await client.get("/v1/stats")).json()["tier"]
                assert tier["backing"] == "vmm" and tier["device"] == 0
        finally:
            code, stderr = await server.stop()
        assert code == 0 and "Traceback" not in stderr, stderr

    asyncio.run(asyncio.wait_for(run(), 120))


async def test_a_disk_tier_under_the_server_keeps_hit_blocks_across_a_restart(tmp_path: Path) -> None:
    config = HostTierConfig(quota="4MiB", max_quota="4MiB", slot_size="64KiB", backing="host")
    disk = await asyncio.to_thread(DiskTierConfig, quota="16MiB", path=tmp_path)
    body = bytes(range(256)) * 100
    for round_ in range(2):
        service = _app.Service(_blocks.StoreBlocks(config, "lru", disk))
        app = service.app()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            async with app.router.lifespan_context(app):
                blocks = service.blocks
                assert isinstance(blocks, _blocks.StoreBlocks)
                if round_ == 0:
                    assert (await client.put("/v1/blocks/ab01", content=body)).status_code in (200, 201)
                    for _ in range(2):  # hit twice: written back to the disk tier
                        assert (await client.get("/v1/blocks/ab01")).content == body
                    await eventually(lambda b=blocks: b.store.statistics().written_back == 1)
                    metrics = (await client.get("/metrics")).text
                    assert 'aiokvtier_disk_blocks{disk="default"} 1.0' in metrics
                else:  # a new process: the host tier is empty, the block comes back from disk
                    assert len(blocks.store) == 0
                    assert (await client.get("/v1/blocks/ab01")).content == body
                    assert blocks.store.statistics().promoted == 1
                    assert (await client.get("/v1/blocks/ab02")).status_code == 404


def _server(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *APP, *options], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT
    )


def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    """Before: uvicorn's own "ERROR:    [Errno 98] ..." line and exit status 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _server("--quota", "64MiB", "--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 1 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"python -m aiokvtier.server: error: cannot listen on 127.0.0.1:{port}: "), lines[0]
    assert "in use" in lines[0]
    done = _server("--quota", "64MiB", "--host", "no-such-host.invalid", "--port", "0")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "cannot listen on no-such-host.invalid:0: " in done.stderr


def test_a_device_this_machine_cannot_use_is_a_usage_error() -> None:
    """Before: the tier's open failed inside uvicorn's startup, a traceback and exit status 3."""
    from aiokvtier._cuda._driver import device_count
    from aiokvtier._errors import CudaUnavailableError

    try:
        visible = device_count()
    except CudaUnavailableError:
        visible = 0
    done = _server("--quota", "64MiB", "--backing", "register", "--device", str(visible), "--port", "0")
    assert done.returncode == 2 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m aiokvtier.server: error: argument --device: "), lines


async def test_a_tier_that_cannot_open_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """A second server over the first's disk directory: before, a traceback and exit status 3."""
    first = await Server.start("--quota", "64MiB", "--disk-path", str(tmp_path))
    try:
        second = await asyncio.create_subprocess_exec(
            sys.executable, *APP, "--quota", "64MiB", "--disk-path", str(tmp_path), "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV, cwd=ROOT,
        )  # fmt: skip
        out, err = await asyncio.wait_for(second.communicate(), 60)
    finally:
        code, stderr = await first.stop()
    assert code == 0, stderr
    assert second.returncode == 1 and out == b"", err
    lines = err.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("python -m aiokvtier.server: error: DiskTierBusy: ") and "open elsewhere" in lines[0]


def test_disk_options_are_checked() -> None:
    for options, named in (
        (["--disk-path", "/nonexistent/dir"], "--disk-path"),
        (["--disk-path", ".", "--workers", "2"], "--disk-path"),
        (["--disk-quota", "lots"], "--disk-quota"),
    ):
        done = subprocess.run(
            [sys.executable, *APP, *options], capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT
        )
        assert done.returncode == 2 and named in done.stderr, done.stderr


def test_the_server_page_lists_every_option_with_its_default() -> None:
    """docs/server.md's table left out --host and --port."""
    text = (ROOT / "docs" / "server.md").read_text()
    rows = {
        row.split(" | ")[0].strip("| `"): row.split(" | ")[1] for row in text.splitlines() if row.startswith("| `--")
    }
    parser = _options.build_parser()
    shown = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"]
    assert set(rows) == {a.option_strings[0] for a in shown}
    for action in shown:
        default = action.default
        if isinstance(default, (int, float, str)) and not isinstance(default, bool) and default is not None:
            documented = rows[action.option_strings[0]]
            assert documented in (str(default), f"{default:g}" if isinstance(default, float) else ""), (
                action.option_strings[0],
                documented,
                default,
            )


async def _other_server(answer: bytes) -> asyncio.Server:
    """An HTTP server that is not the block server: every request gets ``answer`` (a whole response)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


CLOSE_200 = b"HTTP/1.1 200 OK\r\nConnection: close\r\n"


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (CLOSE_200 + b"Content-Type: text/html\r\nContent-Length: 13\r\n\r\n<html></html>", "200 text/html"),
        (b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 9\r\n\r\nnot found", "404"),
        (CLOSE_200 + b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n[]", "200 application/json"),
    ],
    ids=["html", "404", "json-list"],
)
async def test_the_load_generator_says_in_one_line_that_another_server_answered(answer: bytes, says: str) -> None:
    """Before: a JSONDecodeError traceback (or a TypeError) after the whole run."""
    other = await _other_server(answer)
    port = other.sockets[0].getsockname()[1]
    try:
        load = await asyncio.create_subprocess_exec(
            *LOAD, "--url", f"http://127.0.0.1:{port}", "--clients", "2", "--seconds", "1",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV, cwd=ROOT,
        )  # fmt: skip
        out, err = await asyncio.wait_for(load.communicate(), 60)
    finally:
        other.close()
        await other.wait_closed()
    lines = err.decode().splitlines()
    assert load.returncode == 1 and out == b"", lines
    assert len(lines) == 1, lines
    said = f"python -m aiokvtier.server.load: error: http://127.0.0.1:{port}/v1/stats answered "
    assert lines[0].startswith(said), lines
    assert says in lines[0] and "not the block server" in lines[0], lines


async def one_answer(reader: asyncio.StreamReader) -> bytes:
    """One keep-alive answer of a known length: its head, then ``Content-Length`` bytes."""
    head_bytes = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
    length = int(re.search(rb"content-length: (\d+)", head_bytes, re.IGNORECASE).group(1))  # type: ignore[union-attr]
    return head_bytes + await asyncio.wait_for(reader.readexactly(length), BOUND)


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
async def test_an_idle_connection_stays_open_for_keep_alive_seconds_then_closes(workers: list[str]) -> None:
    """uvicorn's own 5 s equals httpx's idle expiry: a client then sent a request now and then on a
    connection the server was closing ("server disconnected"). The server keeps it ``--keep-alive``."""
    server = await Server.start("--quota", "64MiB", "--keep-alive", "2", *workers)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), BOUND)
        try:
            for _ in range(2):  # the second request after an idle second: the same connection serves it
                writer.write(head("GET /healthz").encode())
                await writer.drain()
                assert (await one_answer(reader)).startswith(b"HTTP/1.1 200"), "not served on the kept connection"
                await asyncio.sleep(1.0)
            # Closed by the server once idle 2 s (1 s from here); uvicorn's own 5 s would take 4 s more.
            assert await asyncio.wait_for(reader.read(), 3) == b""
        finally:
            writer.close()
    finally:
        code, stderr = await server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr


def test_the_keep_alive_outlasts_the_clients_idle_connections_by_default() -> None:
    from aiokvtier.server._options import build_parser

    assert build_parser().parse_args([]).keep_alive == 75  # httpx keeps an idle connection 5 s, aiohttp 15 s


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
async def test_a_body_that_stalls_is_answered_408_after_the_body_timeout_and_stores_nothing(workers: list[str]) -> None:
    """Before: the request waited for its body forever (until a shutdown cut it), holding its handler."""
    server = await Server.start("--quota", "64MiB", "--body-timeout", "0.5", *workers)
    raws: list[Raw] = []
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            raws += [
                await Raw.open(server.url, head("PUT /v1/blocks/cd", "Content-Length: 5000")),  # headers only
                await Raw.open(server.url, head("PUT /v1/blocks/ce", "Content-Length: 5000"), b"x" * 100),
                await Raw.open(server.url, head("PUT /v1/blocks/ef", "Transfer-Encoding: chunked"), b"10\r\nyy"),
                await Raw.open(server.url, head("POST /v1/lookup", "Content-Length: 100"), b'{"keys": ['),
            ]
            for raw in raws:
                status, headers, body = await raw.answer(30)
                assert status == 408, (status, headers, body)
                assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
                assert "did not arrive within 0.5 s" in json.loads(body)["error"], body
            for key in ("cd", "ce", "ef"):
                assert (await client.get(f"/v1/blocks/{key}")).status_code == 404
            stats = (await client.get("/v1/stats")).json()
            assert stats["server"]["internal_errors"] == 0
            if workers:
                assert stats["pool"]["blocks"] == 0 and stats["pool"]["claims"] == 0, stats
            else:
                assert stats["store"]["blocks"] == 0 and stats["store"]["in_flight"] == 0, stats
            assert (await client.put("/v1/blocks/cd", content=b"block")).status_code == 201  # the key is free
    finally:
        for raw in raws:
            raw.close()
        code, stderr = await server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr


async def test_bytes_that_are_not_http_get_uvicorns_plain_text_400_as_the_server_page_says() -> None:
    """uvicorn answers these before any route sees a request, and offers the app no way to shape the
    answer; docs/server.md says so, quoting it, so a client knows the one non-JSON error it can meet."""
    page = await asyncio.to_thread((ROOT / "docs" / "server.md").read_text)
    assert '`400 text/plain` "Invalid HTTP request received."' in page
    server = await Server.start("--quota", "64MiB")
    try:
        for data in (
            "GARBAGE\r\n\r\n",
            head("GET /healthz", "Bad Header: x"),
            head("PUT /v1/blocks/ab", "Content-Length: 1, 2"),
        ):
            raw = await Raw.open(server.url, data)
            status, headers, body = await raw.answer(30)
            assert status == 400, (data[:40], status, body)
            assert headers["content-type"] == "text/plain; charset=utf-8" and headers["connection"] == "close"
            assert body == b"Invalid HTTP request received.", body
    finally:
        code, stderr = await server.stop()
    assert code == 0, stderr


def _refusal(run: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit status and the one line a command's usage error printed."""
    try:
        status = run()
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert isinstance(status, int)
    return status, err.rstrip("\n")


@pytest.mark.parametrize(
    ("demo", "serve"),
    [
        (["--quota", "lots"], ["--quota", "lots"]),
        (["--quota", "-1GiB"], ["--quota", "-1GiB"]),
        (["--quota", "0"], ["--quota", "0"]),
        (["--slot-size", "2XB"], ["--slot-size", "2XB"]),
        (["--max-quota", "1.5x"], ["--max-quota", "1.5x"]),
        (["--device", "x"], ["--device", "x"]),
        (["--device", "-1"], ["--device", "-1"]),
        (["--fill-threads", "x"], ["--workers", "x"]),
        (["--fill-threads", "0"], ["--workers", "0"]),
        (["--fill-threads", "257"], ["--workers", "257"]),
        (["--hold", "soon"], ["--drain-seconds", "soon"]),
        (["--hold", "soon"], ["--body-timeout", "soon"]),
    ],
)
def test_serve_refuses_a_bad_value_as_the_other_commands_do(
    demo: list[str], serve: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``aiokvtier serve``'s refusals are argparse's prog, then the words of ``aiokvtier``'s other commands for
    the same mistake. Before: argparse's own ("invalid int value: 'x'", "invalid float value"), and sizes
    and ranges in words of their own ("not a size: 'lots' (bytes, or like 64KiB, 2GiB)", "0 is not 1 to 256")."""
    from aiokvtier import _cli

    status, theirs = _refusal(lambda: _cli.main(["demo", *demo]), capsys)
    assert status == 2 and theirs.startswith(f"aiokvtier: error: argument {demo[0]}: "), theirs
    said = theirs.removeprefix(f"aiokvtier: error: argument {demo[0]}: ")
    for prog in ("aiokvtier serve", "aiokvtier-server", "python -m aiokvtier.server"):
        status, ours = _refusal(lambda prog=prog: aiokvtier.server.main(serve, prog=prog), capsys)  # type: ignore[misc]
        assert status == 2 and ours == f"{prog}: error: argument {serve[0]}: {said}", (ours, theirs)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--port", "x"], "argument --port: 'x' is not a whole number"),
        (["--port", "70000"], "argument --port: '70000' is not 0 to 65535"),
        (["--drain-seconds", "-1"], "argument --drain-seconds: '-1' must be 0 to 3600 seconds"),
        (["--grace-seconds", "nan"], "argument --grace-seconds: 'nan' must be 0 to 3600 seconds"),
        (["--body-timeout", "inf"], "argument --body-timeout: 'inf' must be 0 to 3600 seconds"),
        (["--disk-quota", "lots"], "argument --disk-quota: 'lots' is not a size"),
    ],
)
def test_serve_refuses_numbers_in_the_words_of_the_other_commands(
    options: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, line = _refusal(lambda: aiokvtier.server.main(options, prog="aiokvtier serve"), capsys)
    assert status == 2 and line.startswith(f"aiokvtier serve: error: {says}"), line


async def test_the_body_timeout_answers_408_in_process_and_leaves_no_cancellation_behind() -> None:
    # The timeout cancels the handler's read: the 408 must not leave the task cancelling (the server's
    # own cancellation, or cut()'s, would then be taken for it), and a body in time is served as before.
    stall = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b"part of a block"
        await stall.wait()
        yield b"the rest"

    service = _app.Service(_blocks.DictBlocks(1 << 20, 1 << 16), body_timeout=0.2)
    app = service.app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        async with app.router.lifespan_context(app):
            answer = await asyncio.wait_for(client.put("/v1/blocks/ab", content=stalled()), 10)
            assert_error(answer, 408)
            assert answer.headers["connection"] == "close" and "15 bytes came" in answer.json()["error"]
            assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
            assert service.in_flight == 0
            assert_error(await client.get("/v1/blocks/ab"), 404)
            assert (await client.put("/v1/blocks/ab", content=b"block")).status_code == 201
            assert service.internal_errors == 0


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_a_quota_above_the_memory_available_now_is_refused_naming_both_ways_out(
    workers: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``aiokvtier demo`` and ``pool`` refuse it; with --workers, the parent that would own the pool does."""
    monkeypatch.setattr(_sysinfo, "available_memory", lambda: (64 << 20, "cgroup v2 limit less usage"))
    status, line = _refusal(
        lambda: aiokvtier.server.main(["--quota", "128MiB", "--port", "0", *workers], prog="aiokvtier serve"), capsys
    )
    assert status == 2
    assert line == (
        "aiokvtier serve: error: argument --quota: 128 MiB is more than this machine can make resident now "
        "(64 MiB available: cgroup v2 limit less usage); the kernel would kill the process part-way: "
        "lower --quota to 64 MiB or less, or pass --force to try anyway"
    )


def test_only_the_process_that_makes_the_tier_checks_the_memory_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker of --workers attaches to the pool its parent made; the plain dict fills only as blocks come."""
    monkeypatch.setattr(_sysinfo, "available_memory", lambda: (64 << 20, "MemAvailable"))
    for options in (["--attach", "/nonexistent/pool.sock", "--listen-fd", "3"], ["--plain-dict"], ["--force"]):
        _, config = _options.parse(["--quota", "128MiB", *options])
        assert config.quota == 128 << 20


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
async def test_force_serves_a_quota_above_the_memory_available_now(workers: list[str]) -> None:
    server = await Server.start("--quota", "128MiB", "--force", *workers, program=LOW_MEMORY)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            assert (await wait_for(client, "/readyz", 200)).status_code == 200
            assert (await client.put("/v1/blocks/ab", content=b"block")).status_code == 201
            assert (await client.get("/v1/blocks/ab")).content == b"block"
    finally:
        code, stderr = await server.stop()
    assert code == 0, stderr
