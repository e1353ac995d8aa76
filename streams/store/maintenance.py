"""Background upkeep of a server process: the periodic sweep of expired streams.

Expiry is enforced on access (the SQL functions treat an expired stream as gone); the sweep
only reclaims streams nobody touches. Every process sweeps; ``FOR UPDATE SKIP LOCKED`` keeps
them out of each other's way.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings

from streams import metrics
from streams.store.failures import log_failure
from streams.store.pool import connection

logger = logging.getLogger(__name__)

SWEEP_BATCH = 200

_task: asyncio.Task[None] | None = None


def ensure_started() -> None:
    global _task
    if (_task is None or _task.done()) and settings.DS_EXPIRY_SWEEP_INTERVAL_SECS > 0:
        _task = asyncio.get_running_loop().create_task(_sweep_forever(), name="ds-expiry-sweep")


def stop() -> None:
    if _task is not None:
        _task.cancel()


async def sweep_once() -> int:
    total = 0
    while True:
        async with connection() as conn:
            cur = await conn.execute("SELECT ds_sweep_expired(%s)", (SWEEP_BATCH,))
            row = await cur.fetchone()
        swept = row[0] if row else 0
        total += swept
        if swept < SWEEP_BATCH:
            metrics.EXPIRY_SWEEPS.inc()
            metrics.EXPIRED_STREAMS.inc(total)
            return total


async def _sweep_forever() -> None:
    while True:
        await asyncio.sleep(settings.DS_EXPIRY_SWEEP_INTERVAL_SECS)
        try:
            swept = await sweep_once()
            if swept:
                logger.info("swept %d expired streams", swept)
        except Exception as exc:  # noqa: BLE001 - logged (log_failure); tried again later
            log_failure(logger, "expiry sweep", exc)
