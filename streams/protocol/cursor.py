"""Cursors for CDN collapsing (PROTOCOL.md 10.1).

The cursor is the number of 20-second intervals since 2024-10-09T00:00:00Z. When a client echoes
a cursor that is not behind the current interval, the answer moves strictly past it by a random
1-3600 seconds, so a cache keyed by cursor can never serve the same empty answer forever.
"""

from __future__ import annotations

import math
import random
import time

EPOCH_SECONDS = 1728432000  # 2024-10-09T00:00:00Z
INTERVAL_SECONDS = 20


def current_interval(now: float | None = None) -> int:
    return int(((time.time() if now is None else now) - EPOCH_SECONDS) // INTERVAL_SECONDS)


def next_cursor(client_cursor: str | None, now: float | None = None) -> str:
    interval = current_interval(now)
    if (
        client_cursor is not None
        and client_cursor.isascii()
        and client_cursor.isdigit()
        and len(client_cursor) <= 18
    ):
        echoed = int(client_cursor)
        if echoed >= interval:
            jitter = math.ceil(random.randint(1, 3600) / INTERVAL_SECONDS)
            return str(echoed + max(jitter, 1))
    return str(interval)
