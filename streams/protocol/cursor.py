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


# Digits of the largest cursor read as a number (leading zeros aside): far past any interval
# (10^64 intervals of 20 s), and a bound on the work of reading a client's digits.
MAX_CURSOR_DIGITS = 64


def next_cursor(client_cursor: str | None, now: float | None = None) -> str:
    interval = current_interval(now)
    if client_cursor is not None and client_cursor.isascii() and client_cursor.isdigit():
        # Leading zeros are no reason to read it otherwise (found by a probe: a cursor of 27
        # digits, most of them zeros, got a lower one back).
        digits = client_cursor.lstrip("0") or "0"
        if len(digits) <= MAX_CURSOR_DIGITS:
            echoed = int(digits)
            if echoed >= interval:
                jitter = math.ceil(random.randint(1, 3600) / INTERVAL_SECONDS)
                return str(echoed + max(jitter, 1))
    return str(interval)
