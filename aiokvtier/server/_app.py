"""The HTTP service: the endpoints over one ``Blocks``, as a Starlette app.

Every answer but a success is JSON ``{"error": "..."}``, including the
answer to a request that shutdown cuts short (``Service.cut()``): such a
request is not left to the server's own cancellation, which answers a
plain-text 500 and logs a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._errors import PoolLostError, TierClosedError
from ._blocks import Blocks

__all__ = ["ApiError", "Service"]

log = logging.getLogger("aiokvtier.server")

KEY = re.compile(r"[0-9a-f]{1,128}")
LOOKUP_MAX_BYTES = 1 << 20  # a lookup body: 4096 keys of 128 hex characters fit with room to spare
LOOKUP_MAX_KEYS = 4096
PUT_STATUS = {"stored": 201, "present": 200}
SHUTTING_DOWN = "the server is shutting down"
CLOSE = {"connection": "close"}  # the server closes it after this answer; say so
_CUT = "aiokvtier server: cut at shutdown"
"""The message of the cancellation that ``Service.cut()`` sends (it names the cause, should one ever escape)."""

Endpoint = Callable[[Request], Awaitable[Response]]


class Framing:
    """ASGI middleware: how a request's body is framed decides whether its connection carries another.

    A request with both a ``Content-Length`` and a ``Transfer-Encoding`` is refused (400) and its
    connection closed (RFC 9112 6.3: a proxy in front that reads the other header would see another
    request where this server sees a body: how requests are smuggled). An answer sent before the body
    was read to its end (a 413, or a 400, 404 or 405 to a request that came with a body) says
    ``Connection: close``: without it the server would read on, throwing the rest of the body away,
    until its keep-alive timeout.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if b"transfer-encoding" in headers and b"content-length" in headers:
            message = "a request has a Content-Length or a Transfer-Encoding, not both"
            await JSONResponse({"error": message}, status_code=400, headers=CLOSE)(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"").strip()
        unread = b"transfer-encoding" in headers or declared.lstrip(b"0") != b""  # a body, not of 0 bytes

        async def receiving() -> Message:
            nonlocal unread
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                unread = False  # the body ended, or the client went away
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and unread:
                fields = list(message.get("headers", []))
                if not any(name.lower() == b"connection" for name, _ in fields):
                    message = {**message, "headers": [*fields, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receiving, sending)


class ApiError(Exception):
    """An answer other than success: its status and the message of the JSON body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def store_key(text: str) -> bytes:
    if not KEY.fullmatch(text):
        raise ApiError(400, f"a key is lowercase hex text of 1 to 128 characters, got {text[:140]!r}")
    return text.encode("ascii")


class Service:
    """The endpoints, over one ``Blocks``; ``draining`` is set by SIGTERM / SIGINT.

    Every endpoint runs under ``cut()``'s watch: a request still in flight
    when the shutdown's grace is over (its body still arriving, or a store
    waiting for the tier's fill) is answered 503 in JSON. A body that has
    not arrived whole ``body_timeout`` seconds after its handler began to
    read it (None: no limit) is answered 408 before anything is stored.
    """

    def __init__(self, blocks: Blocks, *, body_timeout: float | None = None) -> None:
        self.blocks = blocks
        self.body_timeout = body_timeout
        self.draining = False
        self.opened = False
        self.cutting = False
        self.internal_errors = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self._running: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()

    def cut(self) -> int:
        """Answer 503 to every request in flight (its handler is cancelled) and to every later one.

        Returns how many were in flight. A handler is cancelled where it
        waits: reading its body, or in a store call, whose cancellation
        leaves no partial block. Event loop only.
        """
        self.cutting = True
        cut = self._running - self._cut
        for task in cut:
            self._cut.add(task)
            task.cancel(_CUT)
        return len(cut)

    @property
    def in_flight(self) -> int:
        """Requests whose handler is running."""
        return len(self._running)

    def _cuttable(self, endpoint: Endpoint) -> Endpoint:
        @functools.wraps(endpoint)
        async def run(request: Request) -> Response:
            if self.cutting:
                raise ApiError(503, SHUTTING_DOWN, CLOSE)
            task = asyncio.current_task()
            assert task is not None
            self._running.add(task)
            try:
                return await endpoint(request)
            except asyncio.CancelledError:
                if task not in self._cut:
                    raise  # not ours: the server's, or the loop's end
                self._cut.discard(task)
                if task.uncancel() > 0:
                    raise  # someone else cancelled it too: theirs goes through
                raise ApiError(503, f"{SHUTTING_DOWN}: the request did not finish in time", CLOSE) from None
            finally:
                self._running.discard(task)
                if task in self._cut:  # the endpoint swallowed the cancellation: take it back
                    self._cut.discard(task)
                    task.uncancel()

        return run

    async def open(self) -> None:
        """Open the blocks (the tier, the tiers below, the store) and export their figures.

        :raises AiokvtierError: the tier, a tier below or the store refused (nothing is left open).
        :raises OSError: the same, from the system.
        """
        await self.blocks.open()
        self.opened = True
        for collector in self.blocks.collectors():
            self.registry.register(collector)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if not self.opened:  # the server opens them before it starts, to refuse in one line
            await self.open()
        try:
            yield
        finally:
            await self.blocks.aclose()

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        resident, target, fill_error = self.blocks.residency() if self.opened else (0, 0, None)
        lost = self.blocks.lost() if self.opened else None
        if lost is not None:  # nothing can be served any more, and the process is on its way out
            status, state = 503, "lost"
        elif self.draining:
            status, state = 503, "draining"
        elif resident > 0:  # a fill that failed part way still serves the resident prefix
            status, state = 200, "ready"
        elif fill_error is not None:  # nothing resident and nothing more coming: not "filling"
            status, state = 503, "failed"
        else:
            status, state = 503, "filling"
        body = {
            "status": state,
            "resident_bytes": resident,
            "target_bytes": target,
            "fraction": resident / target if target else 0.0,
            "fill_error": fill_error,
        }
        if lost is not None:
            body["lost"] = lost
        return JSONResponse(body, status_code=status)

    async def block(self, request: Request) -> Response:
        """One route for the path, so that a wrong method's 405 lists all three in ``Allow``."""
        if request.method == "PUT":
            return await self.put_block(request)
        if request.method == "DELETE":
            return await self.delete_block(request)
        return await self.get_block(request)  # GET, or HEAD (Starlette answers it as GET without the body)

    async def put_block(self, request: Request) -> Response:
        key = store_key(request.path_params["key"])
        body = await self._body(request, self.blocks.slot_size, "block")
        if not body:
            raise ApiError(400, "the body is the block: it is empty")
        outcome = await self.blocks.put(key, body)
        if outcome == "skipped":
            raise ApiError(507, "no room for the block, even after eviction")
        return JSONResponse({"key": request.path_params["key"], "bytes": len(body)}, status_code=PUT_STATUS[outcome])

    async def get_block(self, request: Request) -> Response:
        key = store_key(request.path_params["key"])
        data = await self.blocks.get(key)
        if data is None:
            raise ApiError(404, f"no block {request.path_params['key']}")
        return Response(data, media_type="application/octet-stream")

    async def delete_block(self, request: Request) -> Response:
        key = store_key(request.path_params["key"])
        if not await self.blocks.delete(key):
            raise ApiError(404, f"no block {request.path_params['key']}")
        return Response(status_code=204)

    async def lookup(self, request: Request) -> Response:
        raw = await self._body(request, LOOKUP_MAX_BYTES, "lookup body")
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, 'the body is JSON: {"keys": ["<hex>", ...]}') from None
        keys = document.get("keys") if isinstance(document, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ApiError(400, '"keys" is a list of strings')
        if len(keys) > LOOKUP_MAX_KEYS:
            raise ApiError(413, f"at most {LOOKUP_MAX_KEYS} keys per lookup, got {len(keys)}")
        return JSONResponse({"hits": await self.blocks.lookup([store_key(k) for k in keys])})

    async def stats(self, request: Request) -> Response:
        body = await self.blocks.stats()
        body["server"] = {"draining": self.draining, "internal_errors": self.internal_errors}
        return JSONResponse(body)

    async def metrics(self, request: Request) -> Response:
        await self.blocks.refresh()
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _body(self, request: Request, limit: int, what: str) -> bytes:
        """The body, refused with 413 past ``limit`` bytes (from Content-Length before reading, else while
        reading), and with 408 when it is not whole within ``body_timeout``: a client that stalls would
        otherwise hold its request, and whatever it waits for, forever."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, f"Content-Length is not a byte count: {declared[:40]!r}")
            if int(declared) > limit:
                raise ApiError(413, f"the {what} is {int(declared)} bytes, at most {limit}")
        chunks = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    chunks += chunk
                    if len(chunks) > limit:
                        raise ApiError(413, f"the {what} is more than {limit} bytes")
        except ClientDisconnect:
            raise ApiError(400, "the client went away before the body ended") from None
        except TimeoutError:
            message = f"the {what} did not arrive within {self.body_timeout:g} s ({len(chunks)} bytes came)"
            raise ApiError(408, message, CLOSE) from None
        return bytes(chunks)

    # -- errors: every answer but a success is JSON {"error": ...}

    async def api_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)

    async def http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return JSONResponse({"error": error.detail}, status_code=error.status_code, headers=error.headers)

    async def closed_error(self, request: Request, error: Exception) -> Response:
        if isinstance(error, PoolLostError):  # not a shutdown: the pool's owner went away under this worker
            return JSONResponse({"error": f"the block pool is lost: {error}"}, status_code=503, headers=CLOSE)
        return JSONResponse({"error": SHUTTING_DOWN}, status_code=503, headers=CLOSE)

    async def internal_error(self, request: Request, error: Exception) -> Response:
        self.internal_errors += 1
        log.exception("aiokvtier server: internal error", exc_info=error)
        return JSONResponse({"error": "internal error"}, status_code=500)

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self._cuttable(self.healthz), methods=["GET"]),
            Route("/readyz", self._cuttable(self.readyz), methods=["GET"]),
            Route("/v1/blocks/{key}", self._cuttable(self.block), methods=["GET", "PUT", "DELETE"]),
            Route("/v1/lookup", self._cuttable(self.lookup), methods=["POST"]),
            Route("/v1/stats", self._cuttable(self.stats), methods=["GET"]),
            Route("/metrics", self._cuttable(self.metrics), methods=["GET"]),
        ]
        handlers = {
            ApiError: self.api_error,
            HTTPException: self.http_error,
            TierClosedError: self.closed_error,
            Exception: self.internal_error,
        }
        app = Starlette(
            routes=routes, exception_handlers=handlers, middleware=[Middleware(Framing)], lifespan=self.lifespan
        )
        # A path with a trailing slash is not a route: 404, not Starlette's 307 to the path without it, which
        # names whatever host the client's Host header says and has a PUT send its block again.
        app.router.redirect_slashes = False
        return app
