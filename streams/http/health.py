"""Probes for load balancers and orchestrators, and metrics, served without Django.

* ``/healthz`` (liveness): the process answers. It touches no database, so a database outage
  never gets healthy processes restarted.
* ``/readyz`` (readiness): the parts a request needs work: ``database`` (a fresh connection
  answers), ``pool`` (this process can borrow a pooled connection), ``listen`` (the LISTEN
  connection of live delivery is up and heard from recently). 200 when all are ``ok``, else
  503 naming the failing parts.
* ``/metrics``: Prometheus metrics of every worker of this server (``streams.metrics``); in
  ``keys`` mode it needs credentials with ``read`` on the resource ``metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import psycopg
from django.conf import settings

from access.auth import authenticate
from access.grants import Operation
from streams import lifecycle, metrics
from streams.errors import MethodNotAllowed, ProtocolError
from streams.http.request import Receive, Scope, Send
from streams.http.responses import Response, error_response, send_response
from streams.live import hub
from streams.store.pool import conninfo, get_pool

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_SECS = 2.0
# How long a readiness verdict is reused (seconds), and the probe that made it (readiness).
READY_REUSE_SECS = 1.0
_probe: asyncio.Future[tuple[int, dict[str, Any]]] | None = None
_probed_at = 0.0
# The exposition being rendered, shared by the scrapes that wait for it (_exposition).
_rendering: asyncio.Future[tuple[bytes, str]] | None = None
# The resource a grant names to read the metrics (access.grants).
METRICS_RESOURCE = "metrics"


async def health_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if _refused_method(scope):
        await send_response(send, error_response(_READ_ONLY), None)
        return
    if scope["path"].rstrip("/") == "/readyz":
        status, body = await readiness()
    else:
        status, body = 200, {"status": "ok"}
    headers = {"Content-Type": "application/json", "Cache-Control": "no-store"}
    response = Response(status, headers, json.dumps(body).encode())
    await send_response(send, response, None, head=scope["method"] == "HEAD")


async def _exposition() -> tuple[bytes, str]:
    """The metrics' exposition, rendered in a thread, one at a time per process: scrapes that
    arrive while one renders share its text (32 connections asking at once took the default
    thread pool, which decodes large bodies and checks tokens too, and made another client's
    appends 17 times slower: probe 10e). None is reused once rendered: a scrape sees what
    happened before the rendering it shares began."""
    global _rendering
    rendering = _rendering
    if rendering is None or rendering.done():
        rendering = _rendering = asyncio.ensure_future(asyncio.to_thread(metrics.exposition))
    # Shielded: a scraper that leaves does not cancel the others' rendering.
    return await asyncio.shield(rendering)


async def readiness() -> tuple[int, dict[str, Any]]:
    """The verdict of one probe at a time per process, reused for ``READY_REUSE_SECS`` from
    its start: ``/readyz`` needs no credentials, and a probe opens a database connection of
    its own (a client asking a thousand times at once opened a thousand)."""
    global _probe, _probed_at
    probe = _probe
    stale = time.monotonic() - _probed_at > READY_REUSE_SECS
    if probe is None or (probe.done() and (stale or probe.cancelled() or probe.exception())):
        probe = _probe = asyncio.ensure_future(_probe_parts())
        _probed_at = time.monotonic()
    # Shielded: a client that leaves does not cancel the others' probe.
    return await asyncio.shield(probe)


async def _probe_parts() -> tuple[int, dict[str, Any]]:
    parts = ("database", "pool", "listen", "schema")
    verdicts = await asyncio.gather(
        _database(), _pool(), _listen(), _schema(), return_exceptions=True
    )
    checks = {
        part: _failing(part, verdict) if isinstance(verdict, BaseException) else verdict
        for part, verdict in zip(parts, verdicts, strict=True)
    }
    failing = [name for name, verdict in checks.items() if verdict != "ok"]
    body: dict[str, Any] = {"status": "unavailable" if failing else "ok", **checks}
    if failing:
        body["failing"] = failing
    return (503 if failing else 200), body


async def _database() -> str:
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_SECS):
            conn = await psycopg.AsyncConnection.connect(conninfo(), autocommit=True)
            async with conn:
                await conn.execute("SELECT 1")
    except (TimeoutError, psycopg.Error) as exc:
        return _failing("database", exc)
    return "ok"


async def _pool() -> str:
    try:
        pool = await get_pool()
        async with pool.connection(timeout=PROBE_TIMEOUT_SECS) as conn:
            await conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return _failing("pool", exc)
    return "ok"


async def _schema() -> str:
    """Whether the database's SQL was found to be this code's (not yet, while the check
    waits for a database that was unreachable at start: streams.lifecycle)."""
    return "failing: not checked yet" if lifecycle.schema_unchecked else "ok"


def _failing(part: str, exc: BaseException) -> str:
    """What a failing part says: the kind of error, its message only in the log (anyone may
    ask ``/readyz``, and a connection error names the database's host and port)."""
    logger.warning("readiness: %s failing: %s", part, str(exc).strip()[:500])
    return f"failing: {type(exc).__name__}"


async def _listen() -> str:
    await hub.start()
    if not hub.listening:
        return "failing: not connected"
    silent = time.monotonic() - hub.last_heard
    if silent > 3 * settings.DS_LISTEN_HEARTBEAT_SECS:
        return f"failing: nothing heard for {silent:.0f}s"
    return "ok"


_READ_ONLY = MethodNotAllowed("only GET and HEAD", headers={"Allow": "GET, HEAD, OPTIONS"})


def _refused_method(scope: Scope) -> bool:
    """Probes and metrics are read: methods that write are 405 (they answered 200 to
    DELETE); OPTIONS is answered as before."""
    return scope["method"] not in ("GET", "HEAD", "OPTIONS")


async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if _refused_method(scope):
        await send_response(send, error_response(_READ_ONLY), None)
        return
    headers = dict(scope.get("headers", []))
    authorization = headers.get(b"authorization")
    try:
        principal = await authenticate(
            authorization.decode("latin-1") if authorization is not None else None, {}
        )
        principal.require(METRICS_RESOURCE, Operation.READ)
    except ProtocolError as error:
        await send_response(send, error_response(error), None)
        return
    body, content_type = await _exposition()
    response = Response(200, {"Content-Type": content_type, "Cache-Control": "no-store"}, body)
    await send_response(send, response, None, head=scope["method"] == "HEAD")
