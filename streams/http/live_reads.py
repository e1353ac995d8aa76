"""Live reads: long-poll (PROTOCOL.md 5.7) and SSE (5.8).

The waiting is the services' (``streams.services.reads``: subscribe before reading, so nothing
committed in between is missed; no database connection held while waiting); this module frames
the answers, and runs the SSE session, which writes events as they come.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable

from django.conf import settings

from access.auth import Standing, generation
from access.grants import Operation, stream_resource
from streams import held_answers, services
from streams.errors import BadRequest, ProtocolError
from streams.http import render
from streams.http.request import Request
from streams.http.responses import BLOCK_BYTES, Response, encode_headers, in_blocks
from streams.http.sending import ResponseSender
from streams.live import Subscription
from streams.protocol import cursor as cursors
from streams.protocol import sse
from streams.protocol.headers import is_text_for_sse
from streams.protocol.offsets import Offset, ReadStart, parse_read_offset
from streams.store.types import ReadResult, StreamMeta


def _start(request: Request) -> ReadStart:
    if "offset" not in request.query:
        raise BadRequest("live reads need an offset (-1 for the beginning, now for the tail)")
    return parse_read_offset(request.query["offset"])


def _standing(request: Request) -> Standing:
    return request.standing or Standing(request.principal, None, generation())


def _resource(request: Request) -> str:
    return request.resource or stream_resource(request.path)


async def long_poll(request: Request) -> Response:
    """GET with ``live=long-poll`` (PROTOCOL.md 5.7)."""
    cursor = cursors.next_cursor(request.query_value("cursor"))
    standing = _standing(request)
    meta, result = await services.long_poll(
        path=request.path,
        principal=request.principal,
        client=request.client(),
        start=_start(request),
        resource=request.resource,
    )
    # Its key may have been revoked, or its credentials have expired, while it waited: 401
    # then, with data or without (a 204 told a revoked key the tail: probe 10h).
    await standing.require(_resource(request), Operation.READ)
    if result is not None:
        return render.data(meta, result, cursor=cursor)
    # A timeout, or closed at the reader's offset (then without a cursor: PROTOCOL.md 5.7).
    return render.at_tail(meta, 204, cursor=cursor)


# An SSE session reads at most this much at a time, and each read is one data event (with its
# control event, PROTOCOL.md 5.8): what a client that stops reading pins while its send waits
# (streams.http.sending) is one event, not a catch-up read of DS_MAX_READ_BYTES base64-encoded
# (8 MiB: 42 MB per stalled connection, measured). A message larger than this is still one
# event: the protocol has no offset inside a message.
EVENT_READ_BYTES = 1024 * 1024


async def server_sent_events(request: Request, send: ResponseSender, origin: str | None) -> None:
    """GET with ``live=sse`` (PROTOCOL.md 5.8): answers itself, as an event stream."""
    # The first read happens before the response starts, so a bad offset is still a 400.
    async with services.live_read(
        path=request.path,
        principal=request.principal,
        client=request.client(),
        start=_start(request),
        mode="sse",
        resource=request.resource,
        max_bytes=EVENT_READ_BYTES,
    ) as (subscription, meta, first):
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        base64_data = not is_text_for_sse(meta.media_type)
        if base64_data:
            headers["Stream-Sse-Data-Encoding"] = "base64"
        start = {"type": "http.response.start", "status": 200}
        await send(start | {"headers": encode_headers(headers, origin, None)})

        async def emit(chunk: bytes) -> None:
            # In blocks, as every large answer (an event of one large message may be tens of
            # MiB: streams.http.responses.in_blocks). A send still waiting when the session's
            # time is up cuts the connection. An event of more than a block is held like a
            # catch-up answer (streams.held_answers; uncounted, a client that stopped reading
            # pinned its event outside the budget: probe 8b).
            with held_answers.holding(len(chunk) if len(chunk) > BLOCK_BYTES else 0):
                for block in in_blocks(chunk):
                    message = {"type": "http.response.body", "body": block, "more_body": True}
                    await send(message, until=session.ends_at)

        session = SseSession(
            meta, first.start, emit, base64_data, request.query_value("cursor"),
            access=(_standing(request), _resource(request)),
        )  # fmt: skip
        # Deleted or expired while followed, the database gone, or the credentials revoked or
        # expired: the event stream just ends (the client reconnects from its last offset, and
        # is answered as its credentials are then).
        with contextlib.suppress(ProtocolError):
            await session.run(subscription, first)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class SseSession:
    """One SSE connection: catch up, then follow, until the stream closes, goes away, the
    reconnect interval ends the connection (PROTOCOL.md 10.2), or its credentials stop being
    valid (revoked: judged again before each event and keep-alive; expired: the connection
    ends then)."""

    def __init__(
        self,
        meta: StreamMeta,
        offset: Offset,
        emit: Callable[[bytes], Awaitable[None]],
        base64_data: bool,
        client_cursor: str | None,
        *,
        access: tuple[Standing, str],
    ) -> None:
        self.meta = meta
        self.offset = offset
        self.emit = emit
        self.base64_data = base64_data
        self.client_cursor = client_cursor
        self.standing, self.resource = access
        interval = settings.DS_SSE_RECONNECT_INTERVAL_SECS
        self.ends_at = time.monotonic() + interval if interval > 0 else float("inf")
        expires_at = self.standing.principal.expires_at
        if expires_at is not None:
            self.ends_at = min(self.ends_at, time.monotonic() + expires_at - time.time())
        # The stream's own Stream-Expires-At: the connection ends then, and the client's
        # reconnect hears 404 (it stayed open, with keep-alives, past it: probe 10f).
        self.ends_at = min(self.ends_at, services.expiry_deadline(meta))

    async def run(self, subscription: Subscription, result: ReadResult) -> None:
        """Follow the stream from ``result``, the read made (armed) before the response began."""
        sent_control = False
        while True:
            if sent_control and time.monotonic() >= self.ends_at:
                # The interval ended during a long catch-up: the client goes on from the last
                # control event, over a new connection.
                return
            if result.count:
                self.offset = result.next_offset
                # Data and its control event go out in one write (clients and the conformance
                # suite expect the pair together).
                data = self._data(result)
                closed = result.closed_at_tail
                await self.emit(data + self._control(up_to_date=result.up_to_date, closed=closed))
                sent_control = True
                if closed:
                    return
                # Caught up: wait for the next change (the subscription was armed before this
                # read, so nothing since is missed). Reading again at once would find nothing
                # new and cost a database round trip per reader per append.
                if result.up_to_date and not await self._wait(subscription):
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
            self.meta, result = await services.next_read(self.meta, self.offset, EVENT_READ_BYTES)
            await self.standing.require(self.resource, Operation.READ)

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
            await self.standing.require(self.resource, Operation.READ)
            await self.emit(sse.COMMENT_KEEPALIVE)

    def _data(self, result: ReadResult) -> bytes:
        return _encoded(
            ("data", self.meta.id, result.start, result.next_offset, self.base64_data),
            lambda: sse.data_event(
                render.body_of(self.meta, result.payload), base64_encoded=self.base64_data
            ),
        )

    def _control(self, *, up_to_date: bool, closed: bool) -> bytes:
        cursor = cursors.next_cursor(self.client_cursor)
        offset = self.offset
        return _encoded(
            ("control", self.meta.id, offset, cursor, up_to_date, closed),
            lambda: sse.control_event(
                next_offset=str(offset), cursor=cursor, up_to_date=up_to_date, closed=closed
            ),
        )


# Events encoded for one reader, kept for the others: readers of one stream are woken by the
# same append, at the same offset, and send the same bytes (PROTOCOL.md 5.8: the data of a
# range of messages, and a control event of offset and cursor, never change). At most
# MAX_EVENTS of them, of at most MAX_EVENT_BYTES in all: forgotten all at once when full.
_EVENTS: dict[tuple[object, ...], bytes] = {}
MAX_EVENTS = 512
MAX_EVENT_BYTES = 32 * 1024 * 1024
_event_bytes = 0


def _encoded(key: tuple[object, ...], encode: Callable[[], bytes]) -> bytes:
    global _event_bytes
    event = _EVENTS.get(key)
    if event is None:
        event = encode()
        if len(_EVENTS) >= MAX_EVENTS or _event_bytes + len(event) > MAX_EVENT_BYTES:
            _EVENTS.clear()
            _event_bytes = 0
        if len(event) <= MAX_EVENT_BYTES:
            _EVENTS[key] = event
            _event_bytes += len(event)
    return event
