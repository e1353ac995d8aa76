"""The life of a server process (ASGI lifespan): what starts with it and how it ends.

Start-up opens the database pool, starts listening for stream changes and starts the
background work of every app (the expiry sweep, the state sweep: ``on_startup``). Servers
without lifespan events (daphne under ``runserver``) start the same work on the first request.

Shutdown (SIGTERM or SIGINT) must not wait for clients: uvicorn stops accepting connections,
then waits for open ones to finish before it sends the lifespan shutdown event, and a live
reader never finishes by itself (an SSE stream may be open for a minute, or forever). So the
signal itself ends every live reader at once: long-polls answer 204, SSE streams end after
what they are sending, and new readers end after their first read. Other requests finish
normally, bounded by uvicorn's ``--timeout-graceful-shutdown``. Then lifespan shutdown stops
the background work, the LISTEN connection and the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from django.conf import settings
from psycopg_pool import PoolTimeout

from streams import metrics
from streams.errors import ServiceUnavailable
from streams.http.observe import request_lines
from streams.live import hub
from streams.services import retention
from streams.store import maintenance
from streams.store.failures import log_failure
from streams.store.pool import close_pool, count_connections, get_pool
from streams.store.schema import SchemaMismatch, digest, verify_installed

logger = logging.getLogger(__name__)

Starter = Callable[[], None]
# The pool's gauges are refreshed this often (seconds).
POOL_GAUGE_SECS = 5.0
# How often (seconds) the process checks that the database's SQL is still its code's.
SCHEMA_RECHECK_SECS = 5.0
Stopper = Callable[[], Any]

_starters: list[Starter] = []
# Whether the check of the database's SQL waits for the database to answer (it was
# unreachable at start), or found it is not this code's: the process is not ready
# (streams.http.health), and requests are answered 503 without touching the database.
schema_unchecked = False
# What requests are answered while it is so.
UNCHECKED = ServiceUnavailable("the server has not yet checked its database; retry later")
# Whether the process is shutting down (SIGTERM, SIGINT, or the lifespan's shutdown).
shutting_down = False
# The answer to a request the server cut short as it stopped (uvicorn cancels what is left
# once --timeout-graceful-shutdown has passed) before any of it could be done
# (streams.http.app.serve).
STOPPING = ServiceUnavailable("the server is stopping; retry")
# Tasks of this module's own (periodic work, the late schema check), cancelled at shutdown.
_background: set[asyncio.Task[None]] = set()
_stoppers: list[Stopper] = [metrics.forget_process, request_lines.flush]


def _periodic(name: str, interval: float, work: Callable[[], Awaitable[Any]]) -> Starter:
    """A starter of a background task running ``work`` every ``interval`` seconds."""
    task: asyncio.Task[None] | None = None

    async def forever() -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await work()
            except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again later
                log_failure(logger, name, exc)

    def start() -> None:
        nonlocal task
        if interval > 0 and (task is None or task.done()):
            task = asyncio.get_running_loop().create_task(forever(), name=name)
            _background.add(task)
            task.add_done_callback(_background.discard)

    return start


def on_startup(start: Starter, stop: Stopper | None = None) -> None:
    """Run ``start()`` (idempotent, in the event loop) when the process starts, and
    ``stop()`` (may be a coroutine function) when it ends."""
    _starters.append(start)
    if stop is not None:
        _stoppers.append(stop)


@functools.cache
def _code_digest() -> str:
    return digest()


async def _recheck_schema() -> None:
    """Stop the process if the database's SQL is no longer this code's: another version's
    ``migrate`` replaced it while this process served (probe 10u: an older version's, and
    this one went on serving with the older rules; a newer version's, in a rolling deploy,
    and the older processes answered 500s). Requests are refused meanwhile (503), and a
    process started again refuses to start, saying which version to run."""
    global schema_unchecked
    if schema_unchecked:
        return  # not checked yet: the late check (_verify_later) is the one to make
    pool = await get_pool()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT digest FROM ds_sql_install")
        row = await cur.fetchone()
        if row is not None and row[0] == _code_digest():
            return
        try:
            # Against the SQL this process started with: the files may be another version's
            # by now (a deploy that replaced the code, its processes not restarted yet: review).
            await verify_installed(conn, _code_digest())
        except SchemaMismatch as exc:
            schema_unchecked = True
            logger.critical("refusing to serve: the database changed under this process: %s", exc)
            os.kill(os.getpid(), signal.SIGTERM)


async def _count_pool() -> None:
    count_connections()


async def _flush_metrics() -> None:
    await asyncio.to_thread(metrics.flush)


on_startup(maintenance.ensure_started, maintenance.stop)
on_startup(
    _periodic("ds-retention-sweep", settings.DS_RETENTION_SWEEP_INTERVAL_SECS, retention.sweep)
)
on_startup(_periodic("ds-pool-gauges", POOL_GAUGE_SECS, _count_pool))
on_startup(_periodic("ds-schema-recheck", SCHEMA_RECHECK_SECS, _recheck_schema))
on_startup(_periodic("ds-metrics-flush", metrics.FLUSH_SECS, _flush_metrics))


# Requests check that the background work runs (a server without the ASGI lifespan starts it
# this way, and a task that crashed is restarted) at most this often (seconds): each starter
# looks at its settings and its task, 10-15 us a request when done every time.
CHECK_SECS = 1.0
_checked_at = -math.inf


def ensure_started() -> None:
    """Start (or restart, after a crash) every app's background work: at once the first time,
    then at most every CHECK_SECS."""
    global _checked_at
    now = time.monotonic()
    if now - _checked_at < CHECK_SECS or schema_unchecked:
        # Nothing runs against a database not known to be this code's (review: the sweeps
        # and webhook wakes met one never migrated with tracebacks); it starts once checked.
        return
    _checked_at = now
    for start in _starters:
        start()


async def startup() -> None:
    try:
        await _verify_schema(timeout=5)
    except PoolTimeout:
        # The database is unreachable: start anyway (requests answer 503 until it is back),
        # and check as soon as it answers.
        global schema_unchecked
        schema_unchecked = True
        logger.warning("database unreachable at start-up; its SQL is checked once it answers")
        _background.add(asyncio.get_running_loop().create_task(_verify_later()))
    # Listening before requests come, but not waiting for a database just found unreachable:
    # the process answered nothing, not even /healthz, for 5 s more (probe 10f).
    await hub.start(wait=not schema_unchecked)
    ensure_started()
    _end_readers_on_signals()
    logger.info("server process started")


async def _verify_schema(*, timeout: float) -> None:
    global schema_unchecked
    pool = await get_pool()
    async with pool.connection(timeout=timeout) as conn:
        await verify_installed(conn, _code_digest())
    schema_unchecked = False


def require_checked() -> None:
    """Raise ``UNCHECKED`` (503) while the database's SQL is not known to be this code's: a
    request run then met a database never migrated as a 500 (probe 10f)."""
    if schema_unchecked:
        raise UNCHECKED


async def _verify_later() -> None:
    """The check start-up could not make, made once the database answers. Anything but a
    verdict is tried again: a failure that ended this task left the process serving a
    database it never checked (probe 10f: one that was never migrated, a 500 for every
    request, and ready all the same)."""
    while True:
        try:
            await _verify_schema(timeout=30)
            logger.info("the database's SQL is this code's")
            ensure_started()
            return
        except PoolTimeout:
            continue
        except SchemaMismatch:
            # schema_unchecked stays set: no request reaches that database meanwhile.
            logger.critical("refusing to serve", exc_info=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
            log_failure(logger, "checking the database's SQL", exc)
            await asyncio.sleep(1)


def begin_shutdown() -> None:
    """End every live reader now (see the module docstring)."""
    global shutting_down
    shutting_down = True
    logger.info("shutting down: ending live readers")
    hub.close_readers()


async def shutdown() -> None:
    begin_shutdown()
    for task in _background:
        task.cancel()
    for stop in _stoppers:
        with contextlib.suppress(Exception):
            result = stop()
            if asyncio.iscoroutine(result):
                await result
    await hub.stop()
    await close_pool()


def _end_readers_on_signals() -> None:
    """Chain a handler in front of the server's own for SIGTERM and SIGINT (uvicorn installs
    its handlers before the lifespan starts; they stay in charge of stopping the server)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handle(sig: int, frame: FrameType | None, previous: Any = previous) -> None:
            loop.call_soon_threadsafe(begin_shutdown)
            if callable(previous):
                previous(sig, frame)

        try:
            signal.signal(signum, handle)
        except ValueError:  # not the main thread: the server handles signals itself
            return


def with_lifespan(app: Any) -> Any:
    """``app`` plus the ASGI lifespan protocol."""

    async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await startup()
                except Exception as exc:
                    logger.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    return application
