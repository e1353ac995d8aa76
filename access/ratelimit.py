"""Request-rate limits of API keys (PROTOCOL.md 12.5): a token bucket per key, per process.

Per process, not shared: a shared counter would cost every request a database round trip (or
a broker), more than the append it guards. With N server processes a key may therefore make
up to N times its rate in all; docs/decisions.md says why that is the trade taken.
"""

from __future__ import annotations

import math
import threading
import time

from streams.errors import TooManyRequests

# bucket name -> (tokens left, when they were counted)
_buckets: dict[str, tuple[float, float]] = {}
_lock = threading.Lock()  # Django's routes authenticate in threads, the others on the loop


def take(key_id: str, rate: float) -> None:
    """Spend one request of ``key_id``'s bucket (``rate`` per second, bursts up to ``rate``);
    429 with Retry-After when it is empty."""
    wait = spend(key_id, rate)
    if wait is not None:
        raise TooManyRequests(
            f"rate limit of {rate:g} requests per second reached", retry_after=math.ceil(wait)
        )


def spend(name: str, rate: float) -> float | None:
    """Spend one token of bucket ``name``: ``rate`` tokens a second, holding up to ``rate``
    (at least one; none at rate 0). None when spent; else the seconds until one is there."""
    capacity = max(rate, 1.0) if rate > 0 else 0.0
    with _lock:
        now = time.monotonic()
        tokens, then = _buckets.get(name, (capacity, now))
        tokens = min(capacity, tokens + (now - then) * rate)
        if tokens < 1:
            _buckets[name] = (tokens, now)
            return (1 - tokens) / rate if rate > 0 else math.inf
        _buckets[name] = (tokens - 1, now)
    return None
