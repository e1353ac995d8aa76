"""Lock conflicts: a statement aborted by a deadlock or a serialization failure.

Every statement of the store runs in a transaction of its own (autocommit), so such an abort
undid all of it and running it again is safe. Lock order (``sql/functions.sql``, Lock order)
keeps them rare: what remains is retried a few times, then answered 503 with Retry-After
(``failures.refusal_for``), never 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from psycopg import errors

logger = logging.getLogger(__name__)

RETRIES = 5
LOCK_CONFLICTS = (errors.DeadlockDetected, errors.SerializationFailure)

T = TypeVar("T")


async def retried(attempt: Callable[[], Awaitable[T]], what: str) -> T:
    """``attempt()`` (borrowing its own connection), again after a lock conflict, at most
    RETRIES times in all; the last conflict is raised."""
    for number in range(1, RETRIES + 1):
        try:
            return await attempt()
        except LOCK_CONFLICTS:
            if number == RETRIES:
                raise
            logger.warning("retrying %s after a lock conflict (attempt %d)", what, number)
            await asyncio.sleep(0.005 * number)
    raise AssertionError("unreachable")
