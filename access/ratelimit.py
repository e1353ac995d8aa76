"""Request-rate limits of API keys (PROTOCOL.md 12.5): a token bucket per key, per process.

Per process, not shared: a shared counter would cost every request a database round trip (or
a broker), more than the append it guards. With N server processes a key may therefore make
up to N times its rate in all; docs/decisions.md says why that is the trade taken.
"""

from __future__ import annotations

import math
import time

from streams.errors import TooManyRequests

# key id -> (tokens left, when they were counted)
_buckets: dict[str, tuple[float, float]] = {}


def take(key_id: str, rate: float) -> None:
    """Spend one request of ``key_id``'s bucket (``rate`` per second, bursts up to ``rate``);
    429 with Retry-After when it is empty."""
    now = time.monotonic()
    tokens, then = _buckets.get(key_id, (rate, now))
    tokens = min(rate, tokens + (now - then) * rate)
    if tokens < 1:
        _buckets[key_id] = (tokens, now)
        wait = (1 - tokens) / rate
        raise TooManyRequests(
            f"rate limit of {rate:g} requests per second reached", retry_after=math.ceil(wait)
        )
    _buckets[key_id] = (tokens - 1, now)
