"""One handler per protocol operation (STYLE.md: thin handlers).

Each parses its request into typed values, makes one service call (``streams.services``) and
renders the answer (``streams.http.render``). Rules live in the services and the store; wire
rules in ``streams.protocol``.
"""

from __future__ import annotations

from django.conf import settings

from access.grants import Operation, stream_resource
from streams import services
from streams.errors import BadRequest
from streams.http import render
from streams.http.request import Request, stream_path
from streams.http.responses import Response
from streams.protocol import headers as h
from streams.protocol.offsets import NOW, parse, parse_read_offset
from streams.store.types import ForkSpec, Retention

STREAM_ROUTE = "/v1/stream/"
TRIM_BEFORE = "stream-trim-before"
# A trim has no body; what a client sends anyway is read up to this much, then refused.
TRIM_BODY_LIMIT = 1024


def _may_send_body(request: Request, operation: Operation, *, fork_of: str | None = None) -> None:
    """Judged before the body is read (the service judges again, with everything else): a
    body its sender may not send is not taken. In ``keys`` mode anyone could make a process
    hold 64 MiB bodies, or connections for as long as their bodies took, before a 401
    (probe 9a); a fork's source is judged too (review)."""
    request.principal.require(request.resource or stream_resource(request.path), operation)
    if fork_of is not None:
        request.principal.require(stream_resource(fork_of), Operation.READ)


async def create(request: Request) -> Response:
    """PUT: create a stream or a fork, idempotently (PROTOCOL.md 5.1, 4.2)."""
    ttl_header = request.header("stream-ttl")
    expires_header = request.header("stream-expires-at")
    if ttl_header is not None and expires_header is not None:
        raise BadRequest("send Stream-TTL or Stream-Expires-At, not both")
    fork = _fork_spec(request)
    _may_send_body(request, Operation.MANAGE, fork_of=fork.source_path if fork else None)
    result = await services.create_stream(
        path=request.path,
        principal=request.principal,
        resource=request.resource,
        content_type=request.header("content-type"),
        ttl_seconds=h.parse_ttl(ttl_header) if ttl_header is not None else None,
        expires_at=h.parse_expires_at(expires_header) if expires_header is not None else None,
        closed=h.is_true(request.header("stream-closed")),
        fork=fork,
        retention=_retention(request),
        body=await request.body(settings.DS_MAX_REQUEST_BYTES),
    )
    return render.created(request, result)


def _retention(request: Request) -> Retention | None:
    """The retention policy asked for at creation (extension headers: docs/gaps.md)."""
    max_age = request.header(h.RETENTION_MAX_AGE)
    max_bytes = request.header(h.RETENTION_MAX_BYTES)
    if max_age is None and max_bytes is None:
        return None
    return Retention(
        max_age=h.parse_positive(h.RETENTION_MAX_AGE, max_age, h.MAX_TTL_SECONDS)
        if max_age is not None
        else None,
        max_bytes=h.parse_positive(h.RETENTION_MAX_BYTES, max_bytes, h.MAX_SAFE_INTEGER)
        if max_bytes is not None
        else None,
    )


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
    sub = 0
    if sub_offset is not None:
        if not h.ascii_digits(sub_offset) or len(sub_offset) > 15:
            raise BadRequest("Stream-Fork-Sub-Offset must be a non-negative integer")
        sub = int(sub_offset)
    return ForkSpec(
        source_path=stream_path(source.removeprefix(STREAM_ROUTE).lstrip("/")),
        offset=parse(offset) if offset is not None else None,
        sub_offset=sub,
    )


async def append(request: Request) -> Response:
    """POST: append, optionally close, optionally as an idempotent producer (PROTOCOL.md 5.2)."""
    wanted = h.parse_append_headers(request.header)
    _may_send_body(request, Operation.APPEND)
    body = await request.body(settings.DS_MAX_REQUEST_BYTES)
    result = await services.append(
        path=request.path,
        principal=request.principal,
        resource=request.resource,
        body=body,
        content_type=wanted.content_type,
        close=wanted.close,
        producer=wanted.producer,
        stream_seq=wanted.stream_seq,
    )
    return render.appended(result, producer=wanted.producer is not None, stored_data=bool(body))


async def trim(request: Request) -> Response:
    """POST with ``Stream-Trim-Before`` and no body: drop everything before an offset
    (``now``: everything so far), for the stream's owner (an extension: docs/gaps.md)."""
    if h.is_true(request.header("stream-closed")) or request.header("producer-id") is not None:
        raise BadRequest("Stream-Trim-Before cannot be combined with an append or a close")
    if await request.body(TRIM_BODY_LIMIT):
        raise BadRequest("a trim (Stream-Trim-Before) carries no body")
    value = request.header(TRIM_BEFORE) or ""
    result = await services.trim_stream(
        path=request.path,
        principal=request.principal,
        resource=request.resource,
        before=None if value == NOW else parse(value),
    )
    return render.trimmed(result)


async def head(request: Request) -> Response:
    """HEAD: metadata only; does not renew a sliding TTL (PROTOCOL.md 5.5). Says where the
    stream starts and the retention policy that applies to it."""
    meta = await services.stream_info(
        path=request.path, principal=request.principal, resource=request.resource
    )
    return render.info(meta, await services.retention_of(meta))


async def delete(request: Request) -> Response:
    """DELETE: remove, or soft-delete while forks read through it (PROTOCOL.md 5.4)."""
    await services.delete_stream(
        path=request.path, principal=request.principal, resource=request.resource
    )
    return render.deleted()


async def read(request: Request) -> Response:
    """GET without ``live``: a catch-up read (PROTOCOL.md 5.6)."""
    meta, result = await services.read(
        path=request.path,
        principal=request.principal,
        resource=request.resource,
        start=parse_read_offset(request.query.get("offset", [])),
    )
    if result is None:
        return render.at_tail(meta, 200)
    return render.data(meta, result, if_none_match=request.header("if-none-match"))
