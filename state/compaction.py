"""Compaction of registered state streams: a stream that records every change to a table grows
without bound, while its state stays small. Compaction keeps, per ``(type, key)``, only the
latest change event, drops deletes older than a tombstone period, and respects ``reset``, so
a client reading from ``-1`` still materializes exactly the current state (the rules and why
they hold: ``ds_state_compaction_plan`` in ``sql/state.sql``; docs/gaps.md, Retention).

* Offsets never change: kept events keep theirs; a reader resuming from an offset whose event
  was compacted away continues at the next kept one (``streams.store.reads``). A reader
  resuming before a dropped delete would miss it: such offsets answer 410.
* The materialized state (``/v1/state/entities``) is not touched: it already reflects the
  compacted range, which ends at the materialized offset.
* One compaction per stream at a time across every process (a PostgreSQL advisory lock, held
  on a connection of the compaction's own, so the request pool is never short of one).
* The plan is one read-only statement. The stream's row lock is taken once, briefly, to
  publish the compaction bounds; events are then deleted in bounded batches, each its own short
  transaction, without that lock: appends go on meanwhile.
* Triggered by a periodic sweep in every server process (``DS_STATE__COMPACTION_INTERVAL_SECS``)
  for streams with ``compaction`` on and enough new events, and by ``manage.py compact_state``.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from django.conf import settings

from streams.store.failures import log_failure, unavailable
from streams.store.pool import connection, conninfo

logger = logging.getLogger(__name__)

# Advisory locks are (class, key) pairs; this class is "state compaction", the key a stream id.
LOCK_CLASS = 0x53_74_43  # "StC"

# Progress of one compaction: (what happened, details), for compact_state.
Progress = Callable[[str, str], None]


@dataclass(frozen=True)
class Compacted:
    """What one compaction did: events in the compacted range [floor, horizon) before it,
    kept and deleted; bytes deleted; whether deletes were dropped for their age."""

    stream_id: int
    horizon: int
    floor: int
    kept: int
    deleted: int
    deleted_bytes: int
    dropped_deletes: bool
    seconds: float


async def compact(
    stream_id: int, *, progress: Progress | None = None, batch: int | None = None
) -> Compacted | None:
    """Compact one registered state stream now. None when another process is compacting it,
    it is not (any more) a state stream, or a fork made meanwhile reads what would change
    (the next sweep comes back)."""
    batch = batch or settings.DS_RETENTION_PURGE_BATCH_ROWS
    started = time.monotonic()
    async with await psycopg.AsyncConnection.connect(conninfo(), autocommit=True) as conn:
        cur = await conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (LOCK_CLASS, stream_id))
        locked = await cur.fetchone()
        if not locked or not locked[0]:
            return None
        # The server's state takes in everything appended so far: the horizon is its offset.
        await conn.execute("SELECT ds_state_catch_up(%s, NULL, true)", (stream_id,))
        cur = await conn.execute(
            "SELECT r.tombstone_seconds FROM ds_state_stream AS r WHERE r.stream_id = %s",
            (stream_id,),
        )
        registration = await cur.fetchone()
        if registration is None:
            return None
        tombstone = (
            registration[0] if registration[0] is not None else settings.DS_STATE_TOMBSTONE_SECS
        )
        async with conn.transaction():  # one snapshot: the entities are the state at the horizon
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            cur = await conn.execute(
                "SELECT horizon, floor, keep, dropped_delete, r.version"
                " FROM ds_state_compaction_plan(%s, %s), ds_state_stream AS r"
                " WHERE r.stream_id = %s",
                (stream_id, tombstone, stream_id),
            )
            plan = await cur.fetchone()
        if plan is None:
            return None
        # The plan is the registration's (version): the deletes stop once it changed.
        horizon, floor, keep, dropped_delete, version = plan
        if progress is not None:
            progress("planned", f"keep {len(keep)} events of [{floor}, {horizon})")
        cur = await conn.execute(
            "SELECT ds_state_compaction_begin(%s, %s, %s, %s, %s)",
            (stream_id, horizon, floor, dropped_delete, version),
        )
        began = await cur.fetchone()
        if not began or not began[0]:
            return None
        deleted, deleted_bytes = 0, 0
        for start in range(floor, horizon, batch):
            end = min(start + batch, horizon)
            lows, highs = _gaps(keep, start, end)
            if not lows:
                continue
            cur = await conn.execute(
                "SELECT deleted, bytes FROM ds_state_compact_delete(%s, %s::bigint[],"
                " %s::bigint[], %s)",
                (stream_id, lows, highs, version),
            )
            row = await cur.fetchone()
            assert row is not None
            if row[0] < 0:  # registered again meanwhile: the plan is not its own
                break
            deleted += row[0]
            deleted_bytes += row[1]
            if progress is not None and row[0]:
                progress("deleted", f"{deleted} events up to {end}")
        await conn.execute(
            "SELECT ds_state_compaction_end(%s, %s, %s)", (stream_id, deleted, deleted_bytes)
        )
    return Compacted(
        stream_id=stream_id,
        horizon=horizon,
        floor=floor,
        kept=_count_between(keep, floor, horizon),
        deleted=deleted,
        deleted_bytes=deleted_bytes,
        dropped_deletes=dropped_delete is not None,
        seconds=time.monotonic() - started,
    )


def _gaps(keep: list[int], start: int, end: int) -> tuple[list[int], list[int]]:
    """The ranges of seq in [start, end) between the kept ones (sorted): what to delete."""
    lows: list[int] = []
    highs: list[int] = []
    position = start
    for seq in keep[bisect.bisect_left(keep, start) : bisect.bisect_left(keep, end)]:
        if seq > position:
            lows.append(position)
            highs.append(seq)
        position = seq + 1
    if position < end:
        lows.append(position)
        highs.append(end)
    return lows, highs


def _count_between(keep: list[int], low: int, high: int) -> int:
    return bisect.bisect_left(keep, high) - bisect.bisect_left(keep, low)


# The periodic sweep ------------------------------------------------------------------------

_sweeper: asyncio.Task[None] | None = None


def ensure_sweeper() -> None:
    global _sweeper
    interval = settings.DS_STATE_COMPACTION_INTERVAL_SECS
    if (_sweeper is None or _sweeper.done()) and interval > 0:
        _sweeper = asyncio.get_running_loop().create_task(_sweep(interval), name="ds-compaction")


def stop() -> None:
    if _sweeper is not None:
        _sweeper.cancel()


async def due() -> list[int]:
    """Compacted state streams with enough new events (each marked in its time index)."""
    async with connection() as conn:
        cur = await conn.execute(
            "SELECT ds_state_compaction_due(%s, %s)",
            (settings.DS_STATE_COMPACTION_MIN_EVENTS, settings.DS_STATE_COMPACTION_INTERVAL_SECS),
        )
        return [row[0] for row in await cur.fetchall()]


async def _sweep(interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            streams = await due()
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
            log_failure(logger, "compaction sweep", exc)
            continue
        for stream_id in streams:
            # One stream's failure is its own: the streams after it are still compacted (a
            # message no compaction could read once stopped every later stream's, for good).
            try:
                result = await compact(stream_id)
            except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
                log_failure(logger, f"compaction of state stream {stream_id}", exc)
                if unavailable(exc):
                    break  # the others would fail alike: the next sweep tries again
                continue
            if result is not None and result.deleted:
                logger.info(
                    "compacted state stream %s: %d events deleted, %d kept, in %.1fs",
                    stream_id,
                    result.deleted,
                    result.kept,
                    result.seconds,
                )
