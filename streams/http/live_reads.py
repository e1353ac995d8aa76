"""Live reads: long-poll (PROTOCOL.md 5.7) and SSE (5.8).

Both subscribe to the stream's changes BEFORE reading (``streams.live``), read, and only then
wait, so nothing committed in between is missed. While waiting they hold no database
connection. A stream that is closed at the reader's offset ends the wait at once.
"""

from __future__ import annotations

import asyncio
import time

from django.conf import settings

from streams.errors import BadRequest, ProtocolError
from streams.http.handlers import data_response, tail_response
from streams.http.request import Request, Send
from streams.http.responses import Response, encode_headers
from streams.live import hub
from streams.protocol import cursor as cursors
from streams.protocol import sse
from streams.protocol.headers import is_text_for_sse
from streams.protocol.offsets import Offset, ReadStart, parse_read_offset
from streams.store import reads
from streams.store.types import StreamMeta

# An idle SSE connection gets a comment this often, so proxies and clients keep it open.
SSE_KEEPALIVE_SECS = 15.0


def _live_start(request: Request) -> ReadStart:
    if "offset" not in request.query:
        raise BadRequest("live reads need an offset (-1 for the beginning, now for the tail)")
    return parse_read_offset(request.query["offset"])


async def long_poll(request: Request) -> Response:
    start = _live_start(request)
    cursor = cursors.next_cursor(request.query_value("cursor"))
    meta = await reads.stream_meta(request.path, touch=True)
    offset = meta.tail if start.at_tail else start.offset
    assert offset is not None
    reads.check_offset(meta, offset)
    deadline = time.monotonic() + settings.DS_LONG_POLL_TIMEOUT_SECS
    async with hub.subscribe(meta.id) as subscription:
        while True:
            subscription.arm()
            meta = await reads.stream_meta(request.path, touch=False)
            if offset != meta.tail:
                result = await reads.read_range(meta, offset, settings.DS_MAX_READ_BYTES)
                return data_response(meta, result, cursor=cursor)
            if meta.closed:
                return tail_response(meta, 204)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await subscription.wait(remaining):
                return tail_response(meta, 204, cursor=cursor)


async def server_sent_events(request: Request, send: Send, origin: str | None) -> None:
    start = _live_start(request)
    client_cursor = request.query_value("cursor")
    meta = await reads.stream_meta(request.path, touch=True)
    offset = meta.tail if start.at_tail else start.offset
    assert offset is not None
    reads.check_offset(meta, offset)
    base64_data = not is_text_for_sse(meta.media_type)
    headers = {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    }
    if base64_data:
        headers["Stream-Sse-Data-Encoding"] = "base64"
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": encode_headers(headers, origin, None),
        }
    )

    async def emit(chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    interval = settings.DS_SSE_RECONNECT_INTERVAL_SECS
    end_at = time.monotonic() + interval if interval > 0 else float("inf")
    try:
        async with hub.subscribe(meta.id) as subscription:
            await _sse_loop(
                request,
                meta,
                offset,
                subscription,
                emit,
                base64_data,
                client_cursor,
                end_at,
            )
    except ProtocolError:
        pass  # deleted or expired while we followed it: end the event stream
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _sse_loop(
    request: Request,
    meta: StreamMeta,
    offset: Offset,
    subscription: object,
    emit,  # type: ignore[no-untyped-def]
    base64_data: bool,
    client_cursor: str | None,
    end_at: float,
) -> None:
    sent_control = False
    while True:
        subscription.arm()  # type: ignore[attr-defined]
        meta = await reads.stream_meta(request.path, touch=False)
        if offset != meta.tail:
            result = await reads.read_range(meta, offset, settings.DS_MAX_READ_BYTES)
            offset = result.next_offset
            cursor = cursors.next_cursor(client_cursor)
            payload = (
                b"[" + b",".join(result.messages) + b"]"
                if meta.is_json
                else b"".join(result.messages)
            )
            await emit(
                sse.data_event(payload, base64_encoded=base64_data)
                + sse.control_event(
                    next_offset=str(offset),
                    cursor=cursor,
                    up_to_date=result.up_to_date,
                    closed=result.closed_at_tail,
                )
            )
            sent_control = True
            if result.closed_at_tail:
                return
            continue
        if meta.closed or not sent_control:
            await emit(
                sse.control_event(
                    next_offset=str(offset),
                    cursor=cursors.next_cursor(client_cursor),
                    up_to_date=True,
                    closed=meta.closed,
                )
            )
            sent_control = True
            if meta.closed:
                return
        remaining = end_at - time.monotonic()
        if remaining <= 0:
            return
        if not await subscription.wait(min(remaining, SSE_KEEPALIVE_SECS)):  # type: ignore[attr-defined]
            if time.monotonic() >= end_at:
                return
            await emit(sse.COMMENT_KEEPALIVE)


__all__ = ["asyncio", "long_poll", "server_sent_events"]
