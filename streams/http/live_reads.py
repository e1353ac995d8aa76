"""Live reads: long-poll (PROTOCOL.md 5.7) and SSE (5.8).

Both subscribe to the stream's changes BEFORE reading (``streams.live``), read, and only then
wait, so nothing committed in between is missed. While waiting they hold no database
connection. A stream that is closed at the reader's offset ends the wait at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from django.conf import settings

from streams.errors import BadRequest, ProtocolError
from streams.http.handlers import body_of, data_response, tail_response
from streams.http.request import Request, Send
from streams.http.responses import Response, encode_headers
from streams.live import Subscription, hub
from streams.protocol import cursor as cursors
from streams.protocol import sse
from streams.protocol.headers import is_text_for_sse
from streams.protocol.offsets import Offset, parse_read_offset
from streams.store import reads
from streams.store.types import ReadResult, StreamMeta


async def _open(request: Request) -> tuple[StreamMeta, Offset]:
    """The stream (renewing its TTL: PROTOCOL.md 5.1) and the validated start offset."""
    if "offset" not in request.query:
        raise BadRequest("live reads need an offset (-1 for the beginning, now for the tail)")
    start = parse_read_offset(request.query["offset"])
    meta = await reads.stream_meta(request.path, touch=True)
    offset = meta.tail if start.at_tail else start.offset
    assert offset is not None
    reads.check_offset(meta, offset)
    return meta, offset


async def long_poll(request: Request) -> Response:
    meta, offset = await _open(request)
    cursor = cursors.next_cursor(request.query_value("cursor"))
    deadline = time.monotonic() + settings.DS_LONG_POLL_TIMEOUT_SECS
    async with hub.subscribe(meta.id) as subscription:
        subscription.arm()
        meta, result = await reads.reread(
            meta, offset, settings.DS_MAX_READ_BYTES, settings.DS_MAX_READ_MESSAGES
        )
        while True:
            if result.count:
                return data_response(meta, result, cursor=cursor)
            if meta.closed:
                return tail_response(meta, 204)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await subscription.wait(remaining):
                return tail_response(meta, 204, cursor=cursor)
            subscription.arm()
            meta, result = await next_read(meta, offset)


async def next_read(meta: StreamMeta, offset: Offset) -> tuple[StreamMeta, ReadResult]:
    """What a woken reader reads next: data kept in memory from ``offset`` on (no database
    round trip; streams.live), or else a re-read of the store."""
    delivery = hub.local_delivery(
        meta.id, offset, settings.DS_MAX_READ_BYTES, settings.DS_MAX_READ_MESSAGES
    )
    if delivery is None:
        return await reads.reread(
            meta, offset, settings.DS_MAX_READ_BYTES, settings.DS_MAX_READ_MESSAGES
        )
    closed = delivery.closed and delivery.up_to_date
    fresh = replace(meta, tail=delivery.end, closed=closed) if delivery.up_to_date else meta
    result = ReadResult(
        payload=reads.separator(meta).join(delivery.messages),
        count=len(delivery.messages),
        start=offset,
        next_offset=delivery.end,
        up_to_date=delivery.up_to_date,
        closed_at_tail=closed,
    )
    return fresh, result


async def server_sent_events(request: Request, send: Send, origin: str | None) -> None:
    meta, offset = await _open(request)
    async with hub.subscribe(meta.id) as subscription:
        # The first read happens before the response starts, so a bad offset is still a 400.
        subscription.arm()
        meta, first = await reads.reread(
            meta, offset, settings.DS_MAX_READ_BYTES, settings.DS_MAX_READ_MESSAGES
        )
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        base64_data = not is_text_for_sse(meta.media_type)
        if base64_data:
            headers["Stream-Sse-Data-Encoding"] = "base64"
        start = {"type": "http.response.start", "status": 200}
        await send(start | {"headers": encode_headers(headers, origin, None)})

        async def emit(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        session = SseSession(meta, offset, emit, base64_data, request.query_value("cursor"))
        # Deleted or expired while followed: the event stream just ends.
        with contextlib.suppress(ProtocolError):
            await session.run(subscription, first)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class SseSession:
    """One SSE connection: catch up, then follow, until the stream closes, goes away, or the
    reconnect interval ends the connection (PROTOCOL.md 10.2)."""

    def __init__(
        self,
        meta: StreamMeta,
        offset: Offset,
        emit: Callable[[bytes], Awaitable[None]],
        base64_data: bool,
        client_cursor: str | None,
    ) -> None:
        self.meta = meta
        self.offset = offset
        self.emit = emit
        self.base64_data = base64_data
        self.client_cursor = client_cursor
        interval = settings.DS_SSE_RECONNECT_INTERVAL_SECS
        self.ends_at = time.monotonic() + interval if interval > 0 else float("inf")

    async def run(self, subscription: Subscription, result: ReadResult) -> None:
        """Follow the stream from ``result``, the read made (armed) before the response began."""
        sent_control = False
        while True:
            if result.count:
                self.offset = result.next_offset
                # Data and its control event go out in one write (clients and the conformance
                # suite expect the pair together).
                data = sse.data_event(
                    body_of(self.meta, result.payload), base64_encoded=self.base64_data
                )
                closed = result.closed_at_tail
                await self.emit(data + self._control(up_to_date=result.up_to_date, closed=closed))
                sent_control = True
                if closed:
                    return
            else:
                if self.meta.closed or not sent_control:
                    # At the tail: say so once (at once for offset=now); a closed stream ends.
                    await self.emit(self._control(up_to_date=True, closed=self.meta.closed))
                    sent_control = True
                    if self.meta.closed:
                        return
                if not await self._wait(subscription):
                    return
            subscription.arm()
            self.meta, result = await next_read(self.meta, self.offset)

    async def _wait(self, subscription: Subscription) -> bool:
        """Wait for a change; False when the connection should end (the reconnect interval
        passed, or the process is shutting down). An idle connection gets a keep-alive
        comment every DS_SSE_KEEPALIVE_SECS and goes on waiting: it costs the database nothing
        (a stalled notification channel is the LISTEN heartbeat's business: streams.live)."""
        while True:
            remaining = self.ends_at - time.monotonic()
            if remaining <= 0:
                return False
            if await subscription.wait(min(remaining, settings.DS_SSE_KEEPALIVE_SECS)):
                return True
            if subscription.ended or time.monotonic() >= self.ends_at:
                return False
            await self.emit(sse.COMMENT_KEEPALIVE)

    def _control(self, *, up_to_date: bool, closed: bool) -> bytes:
        return sse.control_event(
            next_offset=str(self.offset),
            cursor=cursors.next_cursor(self.client_cursor),
            up_to_date=up_to_date,
            closed=closed,
        )
