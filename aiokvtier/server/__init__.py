"""A KV block service over a BlockStore, on Starlette and uvicorn (``pip install 'aiokvtier[server]'``).

    aiokvtier-server --quota 2GiB --host 127.0.0.1 --port 8077
    python -m aiokvtier.server --quota 2GiB --host 127.0.0.1 --port 8077

It prints where it listens and answers at once: the tier fills in the
background, ``/healthz`` is 200 from the start and ``/readyz`` turns 200 once
the first unit of the tier is resident. Blocks are named by lowercase hex text
of 1 to 128 characters; the store's key is that text as ASCII bytes.

    GET    /healthz              200 {"status": "ok"}
    GET    /readyz               503 until the first unit is resident (and after SIGTERM, on a failed fill, or
                                 in a --workers worker whose pool is lost), then 200
    PUT    /v1/blocks/{key}      201 stored, 200 already there, 413 too large, 507 no room, 400 bad request
    GET    /v1/blocks/{key}      200 the bytes stored, 404 unknown
    DELETE /v1/blocks/{key}      204, 404 unknown
    POST   /v1/lookup            {"keys": [...]} -> {"hits": n}: how many leading keys are stored
    GET    /v1/stats             tier and store statistics as JSON
    GET    /metrics              Prometheus text format

Every error is JSON ``{"error": "..."}``. SIGTERM or SIGINT: ``/readyz`` turns
503, then (after ``--drain-seconds``, default 0, of serving on) stop accepting,
give the requests in flight up to ``--grace-seconds`` (default 10) to finish,
answer those still running 503 and close every connection left, close the
store and the tier, exit 0 (after SIGINT, end by SIGINT: a shell shows 130).
A second signal ends the drain, or the grace, at once. ``--plain-dict``
serves the same API from a dict of bytes (the baseline of
``aiokvtier.server.load``).

Importing this package needs none of the ``server`` extra; ``main``
says what to install when it is missing.
"""

from __future__ import annotations

from ._command import main as main

__all__ = ["main"]
