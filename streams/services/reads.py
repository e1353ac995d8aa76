"""Services that read streams: metadata, catch-up reads and live reads (PROTOCOL.md 5.5-5.8).

Live reads subscribe to the stream's changes BEFORE reading (``streams.live``), read, and only
then wait, so nothing committed in between is missed. While waiting they hold no database
connection.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from django.conf import settings

from access.grants import Operation, Principal, stream_resource
from streams import held_answers, live_readers, metrics
from streams.live import Subscription, hub
from streams.protocol.offsets import Offset, ReadStart
from streams.store import reads
from streams.store.types import ReadResult, StreamMeta


async def stream_info(
    *, path: str, principal: Principal, resource: str | None = None
) -> StreamMeta:
    """A stream's metadata; does not renew a sliding TTL (HEAD, PROTOCOL.md 5.5)."""
    principal.require(resource or stream_resource(path), Operation.READ)
    meta = await reads.stream_meta(path, touch=False)
    stream_ids.note(path, meta.id)
    return meta


async def read(
    *, path: str, principal: Principal, start: ReadStart, resource: str | None = None
) -> tuple[StreamMeta, ReadResult | None]:
    """A catch-up read (PROTOCOL.md 5.6): the stream (TTL renewed) and what it holds from
    ``start``; no result for ``offset=now``."""
    principal.require(resource or stream_resource(path), Operation.READ)
    if start.at_tail:
        return await reads.stream_meta(path, touch=True), None
    limit = _read_bytes(None)
    with held_answers.reading(limit):
        meta, result = await reads.read_from(
            path, start.offset, limit, settings.DS_MAX_READ_MESSAGES
        )
    stream_ids.note(path, meta.id)
    metrics.CATCH_UP_BYTES.inc(result.size)
    return meta, result


async def first_read(
    meta: StreamMeta, offset: Offset, max_bytes: int | None = None
) -> tuple[StreamMeta, ReadResult]:
    """The read of a live reader right after it subscribed (armed): from the store, at most
    ``max_bytes`` (and DS_MAX_READ_BYTES; always at least one message)."""
    limit = _read_bytes(max_bytes)
    with held_answers.reading(limit):
        return await reads.reread(meta, offset, limit, settings.DS_MAX_READ_MESSAGES)


async def next_read(
    meta: StreamMeta, offset: Offset, max_bytes: int | None = None
) -> tuple[StreamMeta, ReadResult]:
    """What a woken reader reads next: data kept in memory from ``offset`` on (no database
    round trip; streams.live), or else a re-read of the store; at most ``max_bytes``, as
    ``first_read``."""
    delivery = hub.local_delivery(
        meta.id, offset, _read_bytes(max_bytes), settings.DS_MAX_READ_MESSAGES
    )
    if delivery is None:
        return await first_read(meta, offset, max_bytes)
    closed = delivery.closed and delivery.up_to_date
    fresh = replace(meta, tail=delivery.end, closed=closed) if delivery.up_to_date else meta
    result = ReadResult(
        parts=_with_separators(delivery.messages, reads.separator(meta)),
        count=len(delivery.messages),
        start=offset,
        next_offset=delivery.end,
        up_to_date=delivery.up_to_date,
        closed_at_tail=closed,
    )
    return fresh, result


def _read_bytes(max_bytes: int | None) -> int:
    """What a read may carry: ``max_bytes`` asked for by the caller, never more than the
    server's DS_MAX_READ_BYTES, and little while the process holds its budget of answers
    (streams.held_answers)."""
    limit = settings.DS_MAX_READ_BYTES
    return held_answers.read_limit(limit if max_bytes is None else min(max_bytes, limit))


def _with_separators(messages: list[bytes], separator: bytes) -> tuple[bytes, ...]:
    if not separator or len(messages) < 2:
        return tuple(messages)
    return (separator.join(messages),)


@contextlib.asynccontextmanager
async def live_read(
    *,
    path: str,
    principal: Principal,
    client: str | None,
    start: ReadStart,
    mode: str,
    resource: str | None = None,
    max_bytes: int | None = None,
) -> AsyncIterator[tuple[Subscription, StreamMeta, ReadResult]]:
    """Begin a live read (``mode``: long-poll or sse, PROTOCOL.md 5.7, 5.8): subscribed to
    the stream's changes and armed, the stream (TTL renewed) and its data from ``start`` (at
    the tail: none; at most ``max_bytes``, as ``first_read``), the start validated (400,
    410). The subscription and the reader's count last while the block runs; ``client``'s
    live reads and the process's are limited (``streams.live_readers``: 429, 503).

    One statement reads the stream and its data, after subscribing: the subscription needs the
    stream's id, which this process remembers from earlier reads of the path (``stream_ids``).
    Otherwise, and when the path names another stream than the one remembered (deleted and
    created again), the read learns the id from the stream's metadata, subscribes to it and
    reads the data after that."""
    principal.require(resource or stream_resource(path), Operation.READ)
    with live_readers.admitted(client, mode):
        known = stream_ids.get(path)
        if known is not None:
            async with hub.subscribe(known) as subscription:
                subscription.arm()
                meta, result = await _open_read(path, start, max_bytes)
                if meta.id == known:
                    yield subscription, meta, result
                    return
            offset = result.start
        else:
            meta = await reads.stream_meta(path, touch=True)
            offset = start.offset or (meta.tail if start.at_tail else meta.start)
        stream_ids.note(path, meta.id)
        async with hub.subscribe(meta.id) as subscription:
            subscription.arm()
            meta, result = await first_read(meta, offset, max_bytes)
            yield subscription, meta, result


async def long_poll(
    *,
    path: str,
    principal: Principal,
    client: str | None,
    start: ReadStart,
    resource: str | None = None,
) -> tuple[StreamMeta, ReadResult | None]:
    """A long-poll (PROTOCOL.md 5.7): the data at ``start``, or, when there is none, whatever
    comes within the long-poll timeout; None when the wait ended without any (timeout, the
    stream closed at the reader's offset, or the process shutting down)."""
    deadline = time.monotonic() + settings.DS_LONG_POLL_TIMEOUT_SECS
    async with live_read(
        path=path,
        principal=principal,
        client=client,
        start=start,
        mode="long-poll",
        resource=resource,
    ) as (subscription, meta, result):
        # Past the stream's Stream-Expires-At (and a margin, so the store's clock agrees) the
        # wait ends in a 404 (a 204 said an expired stream was up to date: probe 10f).
        expiry = expiry_deadline(meta) + EXPIRY_MARGIN_SECS
        meta, found = await _wait_for_data(subscription, meta, result, min(deadline, expiry))
    if found is None and expiry <= deadline:
        meta = await reads.stream_meta(path, touch=False)  # NotFound now
    return meta, found


# How long past a stream's expiry (seconds) a long-poll ends, to find it gone.
EXPIRY_MARGIN_SECS = 0.05


def expiry_deadline(meta: StreamMeta) -> float:
    """When (``time.monotonic()``) the stream's absolute expiry comes; inf without one. A
    live reader waits no longer (a sliding TTL does not pass while readers wait:
    ``ds_is_expired``)."""
    if meta.expires_at is None:
        return math.inf
    return time.monotonic() + (meta.expires_at.timestamp() - time.time())


async def _open_read(
    path: str, start: ReadStart, max_bytes: int | None
) -> tuple[StreamMeta, ReadResult]:
    """The first read of a live reader: the stream (TTL renewed) and its data from ``start``
    (at the tail: none), the start validated (400, 410)."""
    if start.at_tail:
        meta = await reads.stream_meta(path, touch=True)
        return meta, reads.nothing_at(meta, meta.tail)
    limit = _read_bytes(max_bytes)
    with held_answers.reading(limit):
        return await reads.read_from(path, start.offset, limit, settings.DS_MAX_READ_MESSAGES)


async def _wait_for_data(
    subscription: Subscription, meta: StreamMeta, result: ReadResult, deadline: float
) -> tuple[StreamMeta, ReadResult | None]:
    """A long-poll's wait after its first read (``result``), until data comes or the
    deadline passes; the subscription armed before that read."""
    offset = result.start
    while True:
        if result.count:
            return meta, result
        if meta.closed:
            return meta, None
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not await subscription.wait(remaining):
            return meta, None
        subscription.arm()
        meta, result = await next_read(meta, offset)


class StreamIds:
    """The id of the stream at each path this process read lately, at most ``limit`` of them
    (the oldest noted forgotten first): a hint, which the statement it saves confirms."""

    __slots__ = ("_ids", "limit")

    def __init__(self, limit: int) -> None:
        self._ids: dict[str, int] = {}
        self.limit = limit

    def get(self, path: str) -> int | None:
        return self._ids.get(path)

    def note(self, path: str, stream_id: int) -> None:
        ids = self._ids
        if ids.get(path) == stream_id:
            return
        if path not in ids and len(ids) >= self.limit:
            del ids[next(iter(ids))]
        ids[path] = stream_id


# At most 4,096 paths of at most 1 KiB (streams.http.request.MAX_PATH_BYTES): a few MiB.
stream_ids = StreamIds(4096)
