"""Materialization of state streams inside the server processes, off the append path.

After an append to a registered stream commits, its process schedules that stream: one task
per stream runs ``ds_state_catch_up`` until the entities reach the tail; appends that arrive
meanwhile just mark it to run again. A periodic sweep picks up any stream left behind (a
process that stopped between commit and catch-up). The state API catches up a stream itself
before answering, so readers always see their acknowledged writes (state/api/views.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from django.conf import settings

from streams import metrics
from streams.errors import ServiceUnavailable
from streams.store.failures import log_failure
from streams.store.pool import background_connection, connection

logger = logging.getLogger(__name__)

# Messages applied per transaction: bounds how long one run holds the registration lock.
CHUNK = 20_000

_running: dict[int, asyncio.Task[None]] = {}
# When each stream first had appends not yet materialized (for ds_state_materialization_lag).
_behind_since: dict[int, float] = {}
_again: set[int] = set()
_sweeper: asyncio.Task[None] | None = None


def schedule(stream_id: int) -> None:
    """Materialize ``stream_id`` soon (an append listener; runs in the event loop)."""
    ensure_sweeper()
    _behind_since.setdefault(stream_id, time.monotonic())
    if stream_id in _running:
        _again.add(stream_id)
        return
    task = asyncio.get_running_loop().create_task(_run(stream_id), name=f"ds-state-{stream_id}")
    _running[stream_id] = task


async def catch_up(stream_id: int) -> int:
    """Apply everything up to the stream's tail now; returns the messages applied."""
    total = 0
    while True:
        async with background_connection() as conn:
            cur = await conn.execute("SELECT ds_state_catch_up(%s, %s, false)", (stream_id, CHUNK))
            row = await cur.fetchone()
        applied = row[0] if row else 0
        total += applied
        if applied < CHUNK:
            return total


async def _run(stream_id: int) -> None:
    try:
        while True:
            _again.discard(stream_id)
            behind_since = _behind_since.pop(stream_id, None)
            await catch_up(stream_id)
            if behind_since is not None:
                metrics.STATE_LAG.observe(time.monotonic() - behind_since)
            if stream_id not in _again:
                return
    except Exception as exc:  # noqa: BLE001 - the sweep retries; one stream's failure stays its own
        log_failure(logger, f"materializing state stream {stream_id}", exc)
    finally:
        _running.pop(stream_id, None)


def stop() -> None:
    if _sweeper is not None:
        _sweeper.cancel()


def ensure_sweeper() -> None:
    global _sweeper
    if (_sweeper is None or _sweeper.done()) and settings.DS_STATE_SWEEP_INTERVAL_SECS > 0:
        _sweeper = asyncio.get_running_loop().create_task(_sweep(), name="ds-state-sweep")


async def _sweep() -> None:
    while True:
        await asyncio.sleep(settings.DS_STATE_SWEEP_INTERVAL_SECS)
        try:
            async with connection() as conn:
                cur = await conn.execute("SELECT ds_state_lagging(100)")
                lagging = [row[0] for row in await cur.fetchall()]
            for stream_id in lagging:
                schedule(stream_id)
        except ServiceUnavailable:
            logger.warning("state sweep skipped: the database is unavailable")
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again
            log_failure(logger, "state sweep", exc)
