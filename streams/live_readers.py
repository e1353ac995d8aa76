"""How many live reads (long-polls waiting, SSE connections) this process holds, per client
and in all, and the refusal of one more past either limit.

A live read keeps its connection, and so a descriptor, for up to the long-poll timeout or the
SSE reconnect interval. Unbounded, one client (an API key, or in open mode an address) could
hold every descriptor of a process and leave none for other clients' connections, the
database pool or files. Past ``DS_LIVE__MAX_PER_CLIENT`` a client is answered 429; past
``DS_LIVE__MAX_READERS`` the process is full and a new live read is answered 503 (another
process, or the same one a moment later, may take it); both with ``Retry-After``, before any
database work. Per process, as the rate limits are (``access.ratelimit``): with N processes a
client may hold N times its share.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from streams import metrics
from streams.errors import ServiceUnavailable, TooManyRequests

# Live reads held per client; a client is forgotten when its last one ends.
_by_client: dict[str, int] = {}
_total = 0


@contextmanager
def admitted(client: str | None, mode: str) -> Iterator[None]:
    """Count a live read of ``client`` (``mode``: long-poll or sse; None: counted in the
    process's total only) while it waits or streams; refused past the limits."""
    global _total
    held = _by_client.get(client, 0) if client is not None else 0
    if client is not None and 0 < settings.DS_LIVE_MAX_PER_CLIENT <= held:
        metrics.LIVE_REFUSALS.labels("client").inc()
        raise TooManyRequests(
            f"this client already holds {held} live reads on this server process", retry_after=1
        )
    if 0 < settings.DS_LIVE_MAX_READERS <= _total:
        metrics.LIVE_REFUSALS.labels("process").inc()
        raise ServiceUnavailable("this server process holds all the live reads it may")
    if client is not None:
        _by_client[client] = held + 1
    _total += 1
    gauge = metrics.LIVE_READERS.labels(mode)
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()
        _total -= 1
        if client is not None:
            left = _by_client.pop(client) - 1
            if left:
                _by_client[client] = left
