"""An example KV block service over a BlockStore, on Starlette and uvicorn.

    python examples/server/app.py --quota 2GiB --host 127.0.0.1 --port 8077

It prints where it listens and answers at once: the tier fills in the
background, ``/healthz`` is 200 from the start and ``/readyz`` turns 200 once
the first unit of the tier is resident. Blocks are named by lowercase hex text
of 1 to 128 characters; the store's key is that text as ASCII bytes.

    GET    /healthz              200 {"status": "ok"}
    GET    /readyz               503 until the first unit is resident (and after SIGTERM, or on a failed fill), then 200
    PUT    /v1/blocks/{key}      201 stored, 200 already there, 413 too large, 507 no room, 400 bad request
    GET    /v1/blocks/{key}      200 the bytes stored, 404 unknown
    DELETE /v1/blocks/{key}      204, 404 unknown
    POST   /v1/lookup            {"keys": [...]} -> {"hits": n}: how many leading keys are stored
    GET    /v1/stats             tier and store statistics as JSON
    GET    /metrics              Prometheus text format

Every error is JSON ``{"error": "..."}``. SIGTERM or SIGINT: ``/readyz`` turns
503, then (after ``--drain-seconds``, default 0, of serving on) stop accepting,
finish the requests in flight, close the store and the tier, exit 0. A second
signal during the drain ends it at once.
``--plain-dict`` serves the same API from a dict of bytes (the baseline of
``load.py``). Needs ``pip install 'aiokvtier[server]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Generator, Iterable, Sequence
from typing import Any, NoReturn, Protocol

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ByteSize, TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aiokvtier import BlockNotFound, BlockStore, HostTier, HostTierConfig, TierClosedError

log = logging.getLogger("aiokvtier.server")

KEY = re.compile(r"[0-9a-f]{1,128}")
LOOKUP_MAX_BYTES = 1 << 20  # a lookup body: 4096 keys of 128 hex characters fit with room to spare
LOOKUP_MAX_KEYS = 4096


class ApiError(Exception):
    """An answer other than success: its status and the message of the JSON body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def store_key(text: str) -> bytes:
    if not KEY.fullmatch(text):
        raise ApiError(400, f"a key is lowercase hex text of 1 to 128 characters, got {text[:140]!r}")
    return text.encode("ascii")


# -- what holds the blocks ------------------------------------------------------


class Blocks(Protocol):
    """The service's view of where blocks live: the tier's store, or a plain dict (the baseline)."""

    slot_size: int

    async def open(self) -> None: ...
    async def aclose(self) -> None: ...
    def residency(self) -> tuple[int, int, str | None]: ...
    async def put(self, key: bytes, body: bytes) -> int: ...
    async def get(self, key: bytes) -> bytes | None: ...
    def delete(self, key: bytes) -> bool: ...
    def lookup(self, keys: list[bytes]) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def collectors(self) -> list[Collector]: ...


class StoreBlocks:
    """Blocks in a :class:`BlockStore` over a :class:`HostTier`.

    A GET asks the store for the block's length and loads it into a
    buffer of that length in the same loop step (nothing can evict it
    between the two), then answers those bytes.
    """

    def __init__(self, config: HostTierConfig, policy: str) -> None:
        self.config = config
        self.policy = policy
        self.slot_size = int(config.slot_size)

    async def open(self) -> None:
        self.tier = await HostTier.open(self.config)  # returns once the fill has started, not when resident
        try:
            self.store = await BlockStore.open(self.tier, None, policy=self.policy)
        except BaseException:
            await self.tier.aclose()
            raise

    async def aclose(self) -> None:
        try:
            if "store" in self.__dict__:
                await self.store.aclose()
        finally:
            if "tier" in self.__dict__:
                await self.tier.aclose()

    def residency(self) -> tuple[int, int, str | None]:
        s = self.tier.statistics()
        return s.resident_bytes, s.target_bytes, s.fill_error

    async def put(self, key: bytes, body: bytes) -> int:
        result = await self.store.store([key], [body])
        if result.stored:
            return 201
        if result.present:
            return 200
        raise ApiError(507, "no room for the block, even after eviction")

    async def get(self, key: bytes) -> bytes | None:
        try:
            buffer = bytearray(self.store.length(key))
            await self.store.load([key], [buffer])  # checks the key before its first await
        except BlockNotFound:
            return None
        return bytes(buffer)

    def delete(self, key: bytes) -> bool:
        return self.store.discard([key]) == 1

    def lookup(self, keys: list[bytes]) -> int:
        return self.store.lookup(keys)

    def stats(self) -> dict[str, Any]:
        tier, store = self.tier.statistics(), self.store.statistics()
        return {"tier": dataclasses.asdict(tier), "store": dataclasses.asdict(store)}

    def collectors(self) -> list[Collector]:
        try:
            from aiokvtier import metrics  # type: ignore[attr-defined,unused-ignore]

            return [metrics.TierCollector(self.tier), metrics.StoreCollector(self.store)]
        except (ImportError, AttributeError, TypeError) as error:
            log.debug("aiokvtier.metrics unavailable (%s): the server's own gauges instead", error)
            return [StatisticsCollector(self)]


class StatisticsCollector(Collector):
    """A few tier and store figures, read from ``statistics()`` at each scrape."""

    def __init__(self, blocks: StoreBlocks) -> None:
        self.blocks = blocks

    def collect(self) -> Iterable[Metric]:
        tier = self.blocks.tier.statistics()
        store = self.blocks.store.statistics()
        for name, value, text in (
            ("tier_quota_bytes", tier.quota, "The tier's quota."),
            ("tier_resident_bytes", tier.resident_bytes, "Bytes of the tier resident."),
            ("tier_target_bytes", tier.target_bytes, "Bytes the fill works towards."),
            ("tier_slots_allocated", tier.slots_allocated, "Slots allocated."),
            ("tier_slots_total", tier.slots_total, "Slots in the quota."),
            ("store_blocks", store.blocks, "Blocks stored."),
            ("store_blocks_pinned", store.blocks_pinned, "Blocks a load is reading."),
        ):
            yield GaugeMetricFamily(f"aiokvtier_{name}", text, value=value)
        for name, value, text in (
            ("store_lookup_hits", store.hits, "Keys matched by lookup."),
            ("store_lookup_misses", store.misses, "Keys asked of lookup beyond the stored prefix."),
            ("store_stores", store.stores, "Blocks stored."),
            ("store_evictions", store.evictions, "Blocks evicted."),
            ("store_bytes_stored", store.bytes_stored, "Bytes copied in."),
            ("store_bytes_loaded", store.bytes_loaded, "Bytes copied out."),
        ):
            yield CounterMetricFamily(f"aiokvtier_{name}", text, value=value)


class DictBlocks:
    """The baseline: blocks as ``bytes`` in a dict, oldest dropped first past ``quota // slot_size`` blocks."""

    def __init__(self, quota: int, slot_size: int) -> None:
        self.slot_size = slot_size
        self.capacity = max(1, quota // slot_size)
        self.blocks: dict[bytes, bytes] = {}
        self.hits = self.misses = self.evictions = 0

    async def open(self) -> None:
        pass

    async def aclose(self) -> None:
        self.blocks.clear()

    def residency(self) -> tuple[int, int, str | None]:
        return 1, 1, None  # nothing to fill: ready at once

    async def put(self, key: bytes, body: bytes) -> int:
        if key in self.blocks:
            return 200
        if len(self.blocks) >= self.capacity:
            del self.blocks[next(iter(self.blocks))]
            self.evictions += 1
        self.blocks[key] = body
        return 201

    async def get(self, key: bytes) -> bytes | None:
        return self.blocks.get(key)

    def delete(self, key: bytes) -> bool:
        return self.blocks.pop(key, None) is not None

    def lookup(self, keys: list[bytes]) -> int:
        hits = 0
        for key in keys:
            if key not in self.blocks:
                break
            hits += 1
        self.hits += hits
        self.misses += len(keys) - hits
        return hits

    def stats(self) -> dict[str, Any]:
        return {
            "dict": {"blocks": len(self.blocks), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}
        }

    def collectors(self) -> list[Collector]:
        return []


# -- the HTTP service -------------------------------------------------------------


class Service:
    """The endpoints, over one :class:`Blocks`; ``draining`` is set by SIGTERM / SIGINT."""

    def __init__(self, blocks: Blocks) -> None:
        self.blocks = blocks
        self.draining = False
        self.opened = False
        self.internal_errors = 0
        self.registry = CollectorRegistry(auto_describe=True)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.blocks.open()
        self.opened = True
        for collector in self.blocks.collectors():
            self.registry.register(collector)
        try:
            yield
        finally:
            await self.blocks.aclose()

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        resident, target, fill_error = self.blocks.residency() if self.opened else (0, 0, None)
        if self.draining:
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
        status = await self.blocks.put(key, body)
        return JSONResponse({"key": request.path_params["key"], "bytes": len(body)}, status_code=status)

    async def get_block(self, request: Request) -> Response:
        key = store_key(request.path_params["key"])
        data = await self.blocks.get(key)
        if data is None:
            raise ApiError(404, f"no block {request.path_params['key']}")
        return Response(data, media_type="application/octet-stream")

    async def delete_block(self, request: Request) -> Response:
        key = store_key(request.path_params["key"])
        if not self.blocks.delete(key):
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
        return JSONResponse({"hits": self.blocks.lookup([store_key(k) for k in keys])})

    async def stats(self, request: Request) -> Response:
        body = self.blocks.stats()
        body["server"] = {"draining": self.draining, "internal_errors": self.internal_errors}
        return JSONResponse(body)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @staticmethod
    async def _body(request: Request, limit: int, what: str) -> bytes:
        """The body, refused with 413 past ``limit`` bytes: from Content-Length before reading, else while reading."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, f"Content-Length is not a byte count: {declared[:40]!r}")
            if int(declared) > limit:
                raise ApiError(413, f"the {what} is {int(declared)} bytes, at most {limit}")
        chunks = bytearray()
        try:
            async for chunk in request.stream():
                chunks += chunk
                if len(chunks) > limit:
                    raise ApiError(413, f"the {what} is more than {limit} bytes")
        except ClientDisconnect:
            raise ApiError(400, "the client went away before the body ended") from None
        return bytes(chunks)

    # -- errors: every answer but a success is JSON {"error": ...}

    async def api_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        return JSONResponse({"error": error.message}, status_code=error.status)

    async def http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return JSONResponse({"error": error.detail}, status_code=error.status_code, headers=error.headers)

    async def closed_error(self, request: Request, error: Exception) -> Response:
        return JSONResponse({"error": "the server is shutting down"}, status_code=503)

    async def internal_error(self, request: Request, error: Exception) -> Response:
        self.internal_errors += 1
        log.exception("aiokvtier server: internal error", exc_info=error)
        return JSONResponse({"error": "internal error"}, status_code=500)

    def app(self) -> Starlette:
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/v1/blocks/{key}", self.block, methods=["GET", "PUT", "DELETE"]),
            Route("/v1/lookup", self.lookup, methods=["POST"]),
            Route("/v1/stats", self.stats, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        handlers = {
            ApiError: self.api_error,
            HTTPException: self.http_error,
            TierClosedError: self.closed_error,
            Exception: self.internal_error,
        }
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self.lifespan)


# -- the process --------------------------------------------------------------------


class Server(uvicorn.Server):
    """uvicorn's server, saying where it listens, marking the service draining on a signal, exiting 0 after it.

    With ``drain_seconds``, the first signal only marks the service draining
    (``/readyz`` 503, everything else served, so that a load balancer sees
    the change before the port closes); uvicorn's shutdown starts when the
    drain is over, or at a second signal.
    """

    def __init__(self, config: uvicorn.Config, service: Service, drain_seconds: float = 0.0) -> None:
        super().__init__(config)
        self.service = service
        self.drain_seconds = drain_seconds
        self.drain_until: float | None = None

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"aiokvtier server listening on http://{host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.service.draining = True
        if self.drain_seconds > 0 and self.drain_until is None:
            # A signal handler may only set flags: on_tick (every 0.1 s on the loop) acts on it.
            self.drain_until = time.monotonic() + self.drain_seconds
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and time.monotonic() >= self.drain_until:
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn raises the caught signal again once it has shut down; the
        # shutdown here is the intended end, so the process exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default where its help does not already say it (and it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def size(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or like 64KiB, 2GiB)") from None


OPTION_OF_FIELD = {"quota": "--quota", "max_quota": "--max-quota", "slot_size": "--slot-size"}
OPTION_OF_FIELD |= {"device": "--device", "backing": "--backing"}


def build_parser() -> Parser:
    parser = Parser(
        prog="app.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=Formatter,
    )
    parser.add_argument("--quota", type=size, default="1GiB", metavar="SIZE", help="bytes of the tier, like 2GiB")
    parser.add_argument(
        "--max-quota",
        type=size,
        default=None,
        metavar="SIZE",
        help="bytes of address range reserved (default: the quota)",
    )
    parser.add_argument(
        "--slot-size", type=size, default="64KiB", metavar="SIZE", help="bytes per slot: the largest block"
    )
    parser.add_argument(
        "--backing",
        choices=["host", "register", "vmm", "auto"],
        default="host",
        help="host memory only, or GPU-usable (register, vmm: need --device); auto: register with --device",
    )
    parser.add_argument(
        "--device", type=int, default=None, metavar="N", help="CUDA ordinal of the GPU the tier serves (default: none)"
    )
    parser.add_argument("--policy", choices=["lru", "s3fifo"], default="lru", help="the store's eviction policy")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=8077, metavar="N", help="port to listen on; 0: any free port (printed)"
    )
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="warning",
        help="uvicorn's and the library's log level",
    )
    parser.add_argument("--plain-dict", action="store_true", help="serve from a dict of bytes (the baseline)")
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after SIGTERM or SIGINT, serve on this long with readyz 503",
    )
    return parser


def parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, HostTierConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is not a port (0 to 65535)")
    if not 0 <= args.drain_seconds <= 3600:  # also refuses nan
        parser.error(f"argument --drain-seconds: {args.drain_seconds} is not 0 to 3600 seconds")
    try:
        config = HostTierConfig(
            quota=args.quota,
            max_quota=args.max_quota if args.max_quota is not None else args.quota,
            slot_size=args.slot_size,
            backing=args.backing,
            device=args.device,
            numa_node=None if args.device is None else "auto",
        )
    except ValidationError as error:
        first = error.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        named = re.match(r"\w+", message)  # a rule across fields names its subject first ("max_quota (...) is below")
        if named and named.group() in OPTION_OF_FIELD:
            field = named.group()
        else:
            field = str(first["loc"][0]) if first["loc"] else "quota"
        parser.error(f"argument {OPTION_OF_FIELD.get(field, '--' + field)}: {message}")
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    blocks: Blocks = (
        DictBlocks(int(config.quota), int(config.slot_size)) if args.plain_dict else StoreBlocks(config, args.policy)
    )
    service = Service(blocks)
    uv = uvicorn.Config(
        service.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    server = Server(uv, service, args.drain_seconds)
    server.run()
    return 0 if server.started else 3


if __name__ == "__main__":
    sys.exit(main())
