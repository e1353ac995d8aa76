"""Sinks run inside every server process, and published streams are read-only for clients.

Each process follows every active sink: one task per sink, subscribed to the sink's stream
like a live reader (``streams.live``), so any append, from this process, another one or a
table's trigger, wakes it. Woken, it runs ``ds_sink_run`` (``sql/tablesync.sql``) until the
sink reaches the stream's tail. All processes may try at once: the sink's row lock
(``FOR UPDATE SKIP LOCKED``) lets one apply and the others step aside, and the one applying
runs again if woken meanwhile. A process killed mid-run leaves nothing half done (the run is
one transaction); the others retry a sink they found busy after ``BUSY_RETRY_SECS`` and every
sink every ``DS_TABLESYNC_SWEEP_INTERVAL_SECS``, so a sink never waits for a notification
that was lost.

The list of sinks and of published streams is reloaded when either changes (a trigger
notifies "tablesync:" on the live-delivery channel), when the LISTEN connection reconnects,
and every sweep interval. Published streams are written by their table only: their paths join
``streams.extensions.READ_ONLY_PATHS`` (clients get 403 for PUT, POST and DELETE).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg
from django.conf import settings

from streams import extensions
from streams.errors import ServiceUnavailable
from streams.live import hub
from streams.store.failures import log_failure
from streams.store.pool import background_connection, connection

logger = logging.getLogger(__name__)

# A sink found busy (another process applying it) is tried again after this long, so a
# process killed while applying delays its sinks by about this much.
BUSY_RETRY_SECS = 1.0
# A sink that failed (its table gone, a permission missing) is retried after a delay that
# doubles up to this.
MAX_BACKOFF_SECS = 60.0

_followers: dict[int, asyncio.Task[None]] = {}
_published_paths: set[str] = set()
_supervisor: asyncio.Task[None] | None = None
_reload: asyncio.Event | None = None
# The error last logged per sink, so a sink that keeps failing logs once, not every retry.
_logged_errors: dict[int, str] = {}


def listen_for_changes() -> None:
    hub.add_handler("tablesync", _changed)
    hub.add_reconnect_hook(lambda: _changed(""))


def _changed(payload: str) -> None:
    if _reload is not None:
        _reload.set()


def ensure_started() -> None:
    """Start following sinks (idempotent; in the event loop)."""
    global _supervisor, _reload
    if _supervisor is None or _supervisor.done():
        _reload = asyncio.Event()
        _supervisor = asyncio.get_running_loop().create_task(_supervise(), name="ds-tablesync")


async def stop() -> None:
    tasks = [t for t in (_supervisor, *_followers.values()) if t is not None]
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    _followers.clear()


async def _supervise() -> None:
    assert _reload is not None
    while True:
        _reload.clear()
        try:
            await _reload_once()
        except ServiceUnavailable:
            logger.warning("table sync: the database is unavailable; retrying")
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
            log_failure(logger, "table sync: loading sinks and publications", exc)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_sweep_secs()):
                await _reload.wait()


def _sweep_secs() -> float:
    return max(float(settings.DS_TABLESYNC_SWEEP_INTERVAL_SECS), 0.1)


async def _reload_once() -> None:
    async with connection() as conn:
        cur = await conn.execute("SELECT id, stream_id FROM ds_stream_sink WHERE state = 'active'")
        sinks: dict[int, int] = dict(await cur.fetchall())
        cur = await conn.execute(
            "SELECT s.path FROM ds_table_publication AS p JOIN ds_stream AS s ON s.id = p.stream_id"
        )
        published = {row[0] for row in await cur.fetchall()}
    extensions.READ_ONLY_PATHS.difference_update(_published_paths - published)
    extensions.READ_ONLY_PATHS.update(published)
    _published_paths.clear()
    _published_paths.update(published)
    for sink_id in list(_followers):
        if sink_id not in sinks:
            _followers.pop(sink_id).cancel()
    loop = asyncio.get_running_loop()
    for sink_id, stream_id in sinks.items():
        task = _followers.get(sink_id)
        if task is None or task.done():
            _followers[sink_id] = loop.create_task(
                _follow(sink_id, stream_id), name=f"ds-sink-{sink_id}"
            )


async def run_sink(sink_id: int) -> int | None:
    """Apply the sink up to its stream's tail, a batch per transaction; returns the messages
    applied, or None when another process was applying it."""
    batch = int(settings.DS_TABLESYNC_SINK_BATCH_MESSAGES)
    total = 0
    while True:
        async with background_connection() as conn:
            cur = await conn.execute("SELECT ds_sink_run(%s, %s)", (sink_id, batch))
            row = await cur.fetchone()
        applied = row[0] if row else 0
        if applied < 0:
            return total or None
        total += applied
        if applied < batch:
            return total


async def _follow(sink_id: int, stream_id: int) -> None:
    backoff = 0.0
    async with hub.subscribe(stream_id) as subscription:
        while not subscription.ended:
            subscription.arm()
            wait = _sweep_secs()
            try:
                if await run_sink(sink_id) is None:
                    wait = BUSY_RETRY_SECS
                backoff = 0.0
                _logged_errors.pop(sink_id, None)
            except ServiceUnavailable:
                wait = BUSY_RETRY_SECS
            except psycopg.Error as exc:  # the sink itself failed: record, back off, retry
                backoff = min(max(backoff * 2, 1.0), MAX_BACKOFF_SECS)
                wait = backoff
                await _record_failure(sink_id, exc)
            except Exception:
                logger.exception("sink %s: unexpected failure (retrying)", sink_id)
                backoff = min(max(backoff * 2, 1.0), MAX_BACKOFF_SECS)
                wait = backoff
            await subscription.wait(wait)


async def _record_failure(sink_id: int, exc: Exception) -> None:
    text = str(exc).strip() or type(exc).__name__
    if _logged_errors.get(sink_id) != text:
        _logged_errors[sink_id] = text
        logger.warning("sink %s failed (retrying): %s", sink_id, text)
    with contextlib.suppress(psycopg.Error, ServiceUnavailable):
        async with connection() as conn:
            await conn.execute(
                "UPDATE ds_stream_sink SET last_error = %s, last_error_at = now() WHERE id = %s",
                (text[:2000], sink_id),
            )
