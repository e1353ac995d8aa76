"""Answers of the protocol endpoints, built from service results (PROTOCOL.md 5).

Shared by the stream endpoint and the Yjs endpoint, which answer the same results the same way.
"""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import quote

from django.conf import settings

from streams.http.request import Request
from streams.http.responses import Response
from streams.protocol import json_mode
from streams.protocol.headers import RETENTION_MAX_AGE, RETENTION_MAX_BYTES
from streams.store.types import (
    AppendResult,
    CreateResult,
    ReadResult,
    Retention,
    StreamMeta,
    TrimResult,
)

NO_STORE = "no-store"
# PROTOCOL.md 10.1: historical chunks never change, so caches may keep them; shared caches
# only with DS_HTTP__CACHE_SCOPE public (the default in open mode alone).
# How long a cache may keep a chunk of history, and serve it stale while it asks again.
CACHE_SECS = 60
STALE_SECS = 300


def created(request: Request, result: CreateResult) -> Response:
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


def appended(result: AppendResult, *, producer: bool, stored_data: bool) -> Response:
    """The answer to an append. A producer's new data is 200; a duplicate or a close-only is
    204, as is every append without producer headers (PROTOCOL.md 5.2.1, 5.3)."""
    headers = {"Stream-Next-Offset": str(result.next_offset), "Cache-Control": NO_STORE}
    if result.closed:
        headers["Stream-Closed"] = "true"
    if not producer:
        return Response(204, headers)
    # A close of a stream already closed has no epoch or sequence to echo (a probe saw "None").
    if result.producer_epoch is not None and result.producer_seq is not None:
        headers["Producer-Epoch"] = str(result.producer_epoch)
        headers["Producer-Seq"] = str(result.producer_seq)
    return Response(204 if result.duplicate or not stored_data else 200, headers)


def info(meta: StreamMeta, retention: Retention | None = None) -> Response:
    """The answer to HEAD (PROTOCOL.md 5.5), with where the stream starts and the retention
    policy that applies to it (``retention``; docs/gaps.md, Retention)."""
    headers = {
        "Content-Type": meta.content_type,
        "Stream-Next-Offset": str(meta.tail),
        "Stream-Start-Offset": str(meta.start),
        "Cache-Control": NO_STORE,
        **_expiry_headers(meta.ttl_seconds, meta.expires_at),
    }
    if retention is not None and retention.max_age is not None:
        headers[RETENTION_MAX_AGE] = str(retention.max_age)
    if retention is not None and retention.max_bytes is not None:
        headers[RETENTION_MAX_BYTES] = str(retention.max_bytes)
    if meta.closed:
        headers["Stream-Closed"] = "true"
    return Response(200, headers)


def trimmed(result: TrimResult) -> Response:
    """The answer to a trim: where the stream starts now, and its tail."""
    return Response(
        204,
        {
            "Stream-Start-Offset": str(result.start),
            "Stream-Next-Offset": str(result.tail),
            "Cache-Control": NO_STORE,
        },
    )


def deleted() -> Response:
    return Response(204, {"Cache-Control": NO_STORE})


def data(
    meta: StreamMeta,
    result: ReadResult,
    *,
    cursor: str | None = None,
    if_none_match: str | None = None,
) -> Response:
    """Messages read (catch-up or long-poll). A matching ``If-None-Match`` is a 304, whose
    body is never built."""
    headers = _data_headers(meta, result, cursor)
    if if_none_match is not None and _matches(headers["ETag"], if_none_match):
        del headers["Content-Type"]
        return Response(304, headers)
    return Response(200, headers, body_parts(meta, result))


def at_tail(meta: StreamMeta, status: int, *, cursor: str | None = None) -> Response:
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


def body_of(meta: StreamMeta, payload: bytes) -> bytes:
    """The body of a read whose messages are ``payload`` (ReadResult.payload)."""
    return json_mode.render(payload) if meta.is_json else payload


def body_parts(meta: StreamMeta, result: ReadResult) -> bytes | list[bytes | memoryview]:
    """The body of a read, in pieces when it has several (sent in blocks of about a MiB:
    streams.http.responses.send_response)."""
    if len(result.parts) <= 1:
        return body_of(meta, result.payload)
    if meta.is_json:
        return [b"[", *result.parts, b"]"]
    return list(result.parts)


def absolute_url(request: Request) -> str:
    """The URL the request was sent to (for Location headers), with what a URL may not hold
    as it is (``"<>`` and the like, which the parser lets through) percent-encoded; escapes
    already there are kept."""
    host = request.header("host") or "localhost"
    scheme = request.scope.get("scheme", "http")
    path = quote(request.raw_path.encode("latin-1"), safe=_URL_PATH_CHARACTERS)
    return f"{scheme}://{host}{path}"


# RFC 3986's unreserved characters, sub-delims, ":", "@", "/" and "%" (escapes kept).
_URL_PATH_CHARACTERS = "-._~!$&'()*+,;=:@/%"


def _matches(etag: str, if_none_match: str) -> bool:
    """``If-None-Match`` with the weak comparison RFC 9110 13.1.2 asks for (``W/`` ignored),
    ``*`` matching any representation."""
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return etag in tags or "*" in tags


def _data_headers(
    meta: StreamMeta, result: ReadResult, cursor: str | None = None
) -> dict[str, str]:
    closed = ":c" if result.closed_at_tail else ""
    # Compaction changes what a range of compacted history holds (docs/gaps.md, Retention).
    compacted = f":k{meta.compacted_seq}" if result.start.seq < meta.compacted_seq else ""
    etag = f'"{meta.id}:{result.start}:{result.next_offset}{closed}{compacted}"'
    headers = {
        "Content-Type": meta.content_type,
        "Stream-Next-Offset": str(result.next_offset),
        "ETag": etag,
        # A chunk that reaches the tail of an open stream may grow; only history is cacheable.
        "Cache-Control": NO_STORE if result.up_to_date else _cacheable(meta),
    }
    if result.up_to_date:
        headers["Stream-Up-To-Date"] = "true"
    if result.closed_at_tail:
        headers["Stream-Closed"] = "true"
    elif cursor is not None:
        headers["Stream-Cursor"] = cursor
    return headers


def _cacheable(meta: StreamMeta) -> str:
    """Cache-Control of history: a minute, and five more stale while revalidating, but never
    past the stream's expiry (PROTOCOL.md 5.6: derived from TTL and expiry; a read renews a
    TTL, so the stream lives that long from now)."""
    max_age, stale = CACHE_SECS, STALE_SECS
    lifetimes = [meta.ttl_seconds] if meta.ttl_seconds is not None else []
    if meta.expires_at is not None:
        lifetimes.append(int((meta.expires_at - datetime.now(UTC)).total_seconds()))
    if lifetimes:
        left = max(0, min(lifetimes))
        max_age = min(max_age, left)
        stale = min(stale, left - max_age)
    return f"{settings.DS_CACHE_SCOPE}, max-age={max_age}, stale-while-revalidate={stale}"


def _expiry_headers(ttl_seconds: int | None, expires_at: datetime | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if ttl_seconds is not None:
        headers["Stream-TTL"] = str(ttl_seconds)
    if expires_at is not None:
        headers["Stream-Expires-At"] = expires_at.isoformat().replace("+00:00", "Z")
    return headers
