"""One handler per protocol operation (STYLE.md: thin handlers).

Each parses its request into typed values, makes one service call (``streams.services``) and
renders the answer (``streams.http.render``). Rules live in the services and the store; wire
rules in ``streams.protocol``.
"""

from __future__ import annotations

from django.conf import settings

from streams import services
from streams.errors import BadRequest
from streams.http import render
from streams.http.request import Request, stream_path
from streams.http.responses import Response
from streams.protocol import headers as h
from streams.protocol.offsets import parse, parse_read_offset
from streams.store.types import ForkSpec

STREAM_ROUTE = "/v1/stream/"


async def create(request: Request) -> Response:
    """PUT: create a stream or a fork, idempotently (PROTOCOL.md 5.1, 4.2)."""
    ttl_header = request.header("stream-ttl")
    expires_header = request.header("stream-expires-at")
    if ttl_header is not None and expires_header is not None:
        raise BadRequest("send Stream-TTL or Stream-Expires-At, not both")
    content_type = request.header("content-type")
    result = await services.create_stream(
        path=request.path,
        principal=request.principal,
        resource=request.resource,
        content_type=content_type.strip() if content_type is not None else None,
        ttl_seconds=h.parse_ttl(ttl_header) if ttl_header is not None else None,
        expires_at=h.parse_expires_at(expires_header) if expires_header is not None else None,
        closed=h.is_true(request.header("stream-closed")),
        fork=_fork_spec(request),
        body=await request.body(settings.DS_MAX_REQUEST_BYTES),
    )
    return render.created(request, result)


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
        sub_text = sub_offset.strip()
        if not h.ascii_digits(sub_text) or len(sub_text) > 15:
            raise BadRequest("Stream-Fork-Sub-Offset must be a non-negative integer")
        sub = int(sub_text)
    return ForkSpec(
        source_path=stream_path(source.strip().removeprefix(STREAM_ROUTE).lstrip("/")),
        offset=parse(offset.strip()) if offset is not None else None,
        sub_offset=sub,
    )


async def append(request: Request) -> Response:
    """POST: append, optionally close, optionally as an idempotent producer (PROTOCOL.md 5.2)."""
    wanted = h.parse_append_headers(request.header)
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


async def head(request: Request) -> Response:
    """HEAD: metadata only; does not renew a sliding TTL (PROTOCOL.md 5.5)."""
    return render.info(
        await services.stream_info(
            path=request.path, principal=request.principal, resource=request.resource
        )
    )


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
