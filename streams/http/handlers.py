"""One handler per protocol operation (STYLE.md: thin handlers).

Each parses its request, makes one store call (a live read loops over them), and builds the
answer. Business rules live in the store's SQL functions; wire rules in ``streams.protocol``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings

from streams.errors import BadRequest, Conflict, StreamClosed, ValidationStale
from streams.extensions import validate_json_append
from streams.http.request import Request, stream_path
from streams.http.responses import Response
from streams.protocol import headers as h
from streams.protocol import json_mode
from streams.protocol.offsets import parse, parse_read_offset
from streams.store import group_commit, reads, writes
from streams.store.types import (
    AppendRequest,
    AppendResult,
    CreateRequest,
    CreateResult,
    ForkSpec,
    ReadResult,
    StreamMeta,
)

T = TypeVar("T")

STREAM_ROUTE = "/v1/stream/"
# Appends revalidated this many times at most when a stream's validation rules change under
# them (streams.extensions).
VALIDATION_ATTEMPTS = 3
NO_STORE = "no-store"
# Request bodies larger than this are decoded off the event loop (off_loop).
INLINE_WORK_BYTES = 64 * 1024
# PROTOCOL.md 10.1: historical chunks never change, so shared caches may keep them.
CACHEABLE = "public, max-age=60, stale-while-revalidate=300"


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)``, in a worker thread when it handles more than ``INLINE_WORK_BYTES``:
    decoding a large JSON body takes long enough to stall every other request of this
    process if it ran on the event loop."""
    if size <= INLINE_WORK_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


def _expiry_headers(ttl_seconds: int | None, expires_at: object) -> dict[str, str]:
    headers: dict[str, str] = {}
    if ttl_seconds is not None:
        headers["Stream-TTL"] = str(ttl_seconds)
    if expires_at is not None:
        headers["Stream-Expires-At"] = expires_at.isoformat().replace("+00:00", "Z")  # type: ignore[attr-defined]
    return headers


def _fork_spec(request: Request) -> ForkSpec | None:
    source = request.header("stream-forked-from")
    offset = request.header("stream-fork-offset")
    sub_offset = request.header("stream-fork-sub-offset")
    if source is None:
        if offset is not None or sub_offset is not None:
            raise BadRequest(
                "Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From"
            )
        return None
    source = source.strip()
    source = source.removeprefix(STREAM_ROUTE)
    sub = 0
    if sub_offset is not None:
        sub_text = sub_offset.strip()
        if not h.ascii_digits(sub_text) or len(sub_text) > 15:
            raise BadRequest("Stream-Fork-Sub-Offset must be a non-negative integer")
        sub = int(sub_text)
    return ForkSpec(
        source_path=stream_path(source.lstrip("/")),
        offset=parse(offset.strip()) if offset is not None else None,
        sub_offset=sub,
    )


async def create(request: Request) -> Response:
    """PUT: create a stream or a fork, idempotently (PROTOCOL.md 5.1, 4.2)."""
    ttl_header = request.header("stream-ttl")
    expires_header = request.header("stream-expires-at")
    if ttl_header is not None and expires_header is not None:
        raise BadRequest("send Stream-TTL or Stream-Expires-At, not both")
    ttl = h.parse_ttl(ttl_header) if ttl_header is not None else None
    expires_at = h.parse_expires_at(expires_header) if expires_header is not None else None
    content_type = request.header("content-type")
    body_media: str | None = None
    if content_type is not None:
        content_type = content_type.strip()
        body_media = h.media_type(content_type)
    fork = _fork_spec(request)
    body = await request.body(settings.DS_MAX_REQUEST_BYTES)

    if body_media is None and fork is not None and body:
        body_media = (await reads.stream_meta(fork.source_path, touch=False)).media_type
    if body_media is None:
        body_media = h.DEFAULT_CONTENT_TYPE
    if h.is_json(body_media):
        messages = await off_loop(
            len(body), json_mode.messages_for_create, body, settings.DS_MAX_APPEND_MESSAGES
        )
    else:
        messages = [body] if body else []

    result = await writes.create_stream(
        CreateRequest(
            path=request.path,
            content_type=content_type or (None if fork else h.DEFAULT_CONTENT_TYPE),
            ttl_seconds=ttl,
            expires_at=expires_at,
            closed=h.is_true(request.header("stream-closed")),
            messages=messages,
            fork=fork,
        ),
        max_stream_bytes=settings.DS_MAX_STREAM_BYTES,
    )
    return created_response(request, result)


def created_response(request: Request, result: CreateResult) -> Response:
    """The answer to a create: 201 with Location when new, 200 when it existed."""
    headers = {
        "Content-Type": result.content_type,
        "Stream-Next-Offset": str(result.tail),
        "Cache-Control": NO_STORE,
    }
    if result.closed:
        headers["Stream-Closed"] = "true"
    if result.created:
        headers["Location"] = absolute_url(request)
    return Response(201 if result.created else 200, headers)


async def append(request: Request) -> Response:
    """POST: append, optionally close, optionally as an idempotent producer (PROTOCOL.md 5.2)."""
    response, _ = await append_body(request, await request.body(settings.DS_MAX_REQUEST_BYTES))
    return response


async def append_body(request: Request, body: bytes) -> tuple[Response, AppendResult]:
    """An append whose body was already read (the Yjs endpoint checks it first)."""
    close = h.is_true(request.header("stream-closed"))
    producer = h.parse_producer(
        request.header("producer-id"),
        request.header("producer-epoch"),
        request.header("producer-seq"),
    )
    values: list[Any] | None = None
    if body:
        content_type = request.header("content-type")
        if not content_type:
            raise BadRequest("Content-Type is required with a body")
        body_media: str | None = h.media_type(content_type)
        if h.is_json(body_media):
            values, messages = await _json_messages(request.path, body_media, body)
        else:
            messages = [body]
    elif close:
        body_media, messages = None, []
    else:
        raise BadRequest("empty body (only a close with Stream-Closed: true may be empty)")

    append_request = AppendRequest(
        path=request.path,
        media_type=body_media,
        messages=messages,
        close=close,
        producer=producer,
        stream_seq=_stream_seq(request.header("stream-seq")),
    )
    result = await _append_validated(append_request, values)
    headers = {"Stream-Next-Offset": str(result.next_offset), "Cache-Control": NO_STORE}
    if result.closed:
        headers["Stream-Closed"] = "true"
    if producer is not None:
        headers["Producer-Epoch"] = str(result.producer_epoch)
        headers["Producer-Seq"] = str(result.producer_seq)
        # New data from a producer is 200; a duplicate or a close-only is 204 (5.2.1, 5.3).
        status = 204 if result.duplicate or not messages else 200
        return Response(status, headers), result
    return Response(204, headers), result


def _stream_seq(value: str | None) -> str | None:
    return None if value is None else h.bounded("Stream-Seq", value, h.MAX_STREAM_SEQ_BYTES)


async def _append_validated(request: AppendRequest, values: list[Any] | None) -> AppendResult:
    """Append after the stream's extra validation of JSON messages (streams.extensions); if the
    rules changed meanwhile, validate again against the new ones."""
    for attempt in range(VALIDATION_ATTEMPTS):
        if values is not None:
            request.validation_version = await validate_json_append(
                request.path, values, request.messages, refresh=attempt > 0
            )
        try:
            return await group_commit.append(request)
        except ValidationStale:
            if attempt == VALIDATION_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


async def _json_messages(path: str, body_media: str, body: bytes) -> tuple[list[Any], list[bytes]]:
    """Validate and flatten a JSON append. A body that is not valid JSON is a 400, unless the
    stream would refuse the append anyway: missing (404), closed or of another type (409)
    answer first (PROTOCOL.md 5.2, error precedence)."""
    try:
        return await off_loop(
            len(body), json_mode.flatten_append, body, settings.DS_MAX_APPEND_MESSAGES
        )
    except BadRequest:
        meta = await reads.stream_meta(path, touch=False)
        if meta.closed:
            raise StreamClosed(str(meta.tail)) from None
        if meta.media_type != body_media:
            raise Conflict("Content-Type does not match the stream's content type") from None
        raise


async def head(request: Request) -> Response:
    """HEAD: metadata only; does not renew a sliding TTL (PROTOCOL.md 5.5)."""
    meta = await reads.stream_meta(request.path, touch=False)
    headers = {
        "Content-Type": meta.content_type,
        "Stream-Next-Offset": str(meta.tail),
        "Cache-Control": NO_STORE,
        **_expiry_headers(meta.ttl_seconds, meta.expires_at),
    }
    if meta.closed:
        headers["Stream-Closed"] = "true"
    return Response(200, headers)


async def delete(request: Request) -> Response:
    """DELETE: remove, or soft-delete while forks read through it (PROTOCOL.md 5.4)."""
    await writes.delete_stream(request.path)
    return Response(204, {"Cache-Control": NO_STORE})


async def read(request: Request) -> Response:
    """GET without ``live``: a catch-up read (PROTOCOL.md 5.6)."""
    start = parse_read_offset(request.query.get("offset", []))
    meta = await reads.stream_meta(request.path, touch=True)
    if start.at_tail:
        return tail_response(meta, 200)
    assert start.offset is not None
    result = await reads.read_range(
        meta, start.offset, settings.DS_MAX_READ_BYTES, settings.DS_MAX_READ_MESSAGES
    )
    headers = _data_headers(meta, result)
    if_none_match = request.header("if-none-match")
    if if_none_match is not None and headers["ETag"] in _etags(if_none_match):
        # Not modified: the body is never built.
        del headers["Content-Type"]
        return Response(304, headers)
    return Response(200, headers, body_of(meta, result.payload))


def _etags(header: str) -> set[str]:
    return {tag.strip() for tag in header.split(",")}


def body_of(meta: StreamMeta, payload: bytes) -> bytes:
    """The body of a read whose messages are ``payload`` (ReadResult.payload)."""
    return json_mode.render(payload) if meta.is_json else payload


def data_response(meta: StreamMeta, result: ReadResult, *, cursor: str | None = None) -> Response:
    return Response(200, _data_headers(meta, result, cursor), body_of(meta, result.payload))


def _data_headers(
    meta: StreamMeta, result: ReadResult, cursor: str | None = None
) -> dict[str, str]:
    etag = f'"{meta.id}:{result.start}:{result.next_offset}{":c" if result.closed_at_tail else ""}"'
    headers = {
        "Content-Type": meta.content_type,
        "Stream-Next-Offset": str(result.next_offset),
        "ETag": etag,
        # A chunk that reaches the tail of an open stream may grow; only history is cacheable.
        "Cache-Control": CACHEABLE if not result.up_to_date else NO_STORE,
    }
    if result.up_to_date:
        headers["Stream-Up-To-Date"] = "true"
    if result.closed_at_tail:
        headers["Stream-Closed"] = "true"
    elif cursor is not None:
        headers["Stream-Cursor"] = cursor
    return headers


def tail_response(meta: StreamMeta, status: int, *, cursor: str | None = None) -> Response:
    """An answer at the tail with no data: ``offset=now`` (200) or a long-poll timeout (204)."""
    headers = {
        "Content-Type": meta.content_type,
        "Stream-Next-Offset": str(meta.tail),
        "Stream-Up-To-Date": "true",
        "Cache-Control": NO_STORE,
    }
    if meta.closed:
        headers["Stream-Closed"] = "true"
    elif cursor is not None:
        headers["Stream-Cursor"] = cursor
    return Response(status, headers, body_of(meta, b"") if status == 200 else b"")


def absolute_url(request: Request) -> str:
    """The URL the request was sent to (for Location headers)."""
    host = request.header("host") or "localhost"
    scheme = request.scope.get("scheme", "http")
    return f"{scheme}://{host}{request.raw_path}"
