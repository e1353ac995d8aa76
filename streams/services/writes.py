"""Services that change streams: create (and fork), append (and close), delete."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from django.conf import settings

from access.grants import Operation, Principal, stream_resource
from streams import extensions, live
from streams.errors import BadRequest, Conflict, ProtocolError, StreamClosed, ValidationStale
from streams.protocol import headers as h
from streams.protocol import json_mode
from streams.protocol.headers import ProducerTuple
from streams.protocol.offsets import Offset
from streams.services import retention
from streams.store import create_commit, group_commit, reads, writes
from streams.store.types import (
    AppendRequest,
    AppendResult,
    CreateRequest,
    CreateResult,
    ForkSpec,
    Retention,
)

T = TypeVar("T")

# Request bodies larger than this are decoded off the event loop (off_loop).
INLINE_WORK_BYTES = 64 * 1024
# Appends revalidated this many times at most when a stream's validation rules change under
# them (streams.extensions).
VALIDATION_ATTEMPTS = 3


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)``, in a worker thread when it handles more than ``INLINE_WORK_BYTES``:
    decoding a large JSON body takes long enough to stall every other request of this
    process if it ran on the event loop."""
    if size <= INLINE_WORK_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def create_stream(
    *,
    path: str,
    principal: Principal,
    content_type: str | None,
    ttl_seconds: int | None = None,
    expires_at: datetime | None = None,
    closed: bool = False,
    body: bytes = b"",
    fork: ForkSpec | None = None,
    retention: Retention | None = None,
    resource: str | None = None,
) -> CreateResult:
    """Create a stream or a fork, idempotently (PROTOCOL.md 5.1, 4.2). ``content_type`` None
    means not given: a fork's source's type, else ``application/octet-stream``. A fork needs
    ``read`` on its source as well as ``manage`` on itself. ``retention``: the stream's own
    retention policy (a fork without one inherits its source's)."""
    principal.require(resource or stream_resource(path), Operation.MANAGE)
    if fork is not None:
        principal.require(stream_resource(fork.source_path), Operation.READ)
    body_media = h.media_type(content_type) if content_type is not None else None
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
    return await create_commit.create(
        CreateRequest(
            path=path,
            content_type=content_type or (None if fork else h.DEFAULT_CONTENT_TYPE),
            ttl_seconds=ttl_seconds,
            expires_at=expires_at,
            closed=closed,
            messages=messages,
            fork=fork,
            created_by=principal.label,
            retention=retention,
        )
    )


async def append(
    *,
    path: str,
    principal: Principal,
    body: bytes,
    content_type: str | None,
    close: bool = False,
    producer: ProducerTuple | None = None,
    stream_seq: str | None = None,
    resource: str | None = None,
) -> AppendResult:
    """Append (and optionally close), optionally as an idempotent producer (PROTOCOL.md 5.2).
    Returns after the commit; raises the request's own refusal."""
    principal.require(resource or stream_resource(path), Operation.APPEND)
    values: list[Any] | None = None
    body_media: str | None = None
    if body:
        if not content_type:
            raise BadRequest("Content-Type is required with a body")
        body_media = h.media_type(content_type)
        if h.is_json(body_media):
            values, messages = await _json_messages(path, body_media, body)
        else:
            messages = [body]
    elif close:
        messages = []
    else:
        raise BadRequest("empty body (only a close with Stream-Closed: true may be empty)")
    request = AppendRequest(
        path=path,
        media_type=body_media,
        messages=messages,
        close=close,
        producer=producer,
        stream_seq=stream_seq,
    )
    for attempt in range(VALIDATION_ATTEMPTS):
        if values is not None:
            # The stream's extra rules (streams.extensions); if they change meanwhile, the
            # store refuses the append as stale and it is validated again.
            request.validation_version = await extensions.validate_json_append(
                path, values, messages, refresh=attempt > 0
            )
        try:
            return await group_commit.append(request)
        except ValidationStale:
            if attempt == VALIDATION_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def byte_append(
    *,
    path: str,
    principal: Principal,
    body: bytes,
    content_type: str | None,
    producer: ProducerTuple | None = None,
    stream_seq: str | None = None,
    resource: str | None = None,
) -> AppendRequest:
    """The request of an append of ``body`` as one message of a byte stream, for
    ``append_together`` (a body of another content type than the stream's is refused by the
    store, 409)."""
    principal.require(resource or stream_resource(path), Operation.APPEND)
    if not content_type:
        raise BadRequest("Content-Type is required with a body")
    if not body:
        raise BadRequest("empty body")
    return AppendRequest(
        path=path,
        media_type=h.media_type(content_type),
        messages=[body],
        close=False,
        producer=producer,
        stream_seq=stream_seq,
    )


# Appends to one stream weighing more than this in all (``append_weight``) are not written in
# one batch.
TOGETHER_MAX_WEIGHT = group_commit.MAX_BATCH_BYTES
append_weight = group_commit.weight


async def append_together(requests: list[AppendRequest]) -> list[AppendResult | ProtocolError]:
    """Appends to one stream (``byte_append``) written together, in one batch when the store's
    bounds allow, after a check that judged them all against one validation version of the
    stream (``validation_version``; yjs.replicas). Each request's result or refusal, in
    order; ValidationStale when the stream's version moved on."""
    return await group_commit.append_together(requests)


async def _json_messages(path: str, body_media: str, body: bytes) -> tuple[list[Any], list[bytes]]:
    """Decode and flatten a JSON append. A body that is not valid JSON is a 400, unless the
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


async def delete_stream(*, path: str, principal: Principal, resource: str | None = None) -> None:
    """Remove a stream, or soft-delete it while forks read through it (PROTOCOL.md 5.4). What
    nobody reads any more (a soft-deleted stream's rows its forks do not read, a source's
    rows a deleted fork read) is purged in the background (streams.services.retention)."""
    principal.require(resource or stream_resource(path), Operation.MANAGE)
    await writes.delete_stream(path)
    retention.schedule_purge()


def _publish(batch: list[AppendRequest], results: list[AppendResult | ProtocolError]) -> None:
    """After a group-commit batch committed: wake this process's readers at once, handing
    watched streams' data to them (other processes hear the NOTIFY), and tell the append
    listeners about streams with extra rules (streams.extensions)."""
    stored = [
        (request, result)
        for request, result in zip(batch, results, strict=True)
        if isinstance(result, AppendResult) and not result.duplicate
    ]
    if not stored:
        return
    last = stored[-1][1]  # every request of a batch is for one stream
    appended = []
    if live.hub.watches(last.stream_id):
        for request, result in stored:
            end = result.next_offset
            start = Offset(end.seq - len(request.messages), end.pos - request.size)
            appended.append(live.Appended(start, end, tuple(request.messages), result.closed))
    live.hub.publish(last.stream_id, last.next_offset.seq, last.closed, appended)
    # Extensions validate JSON appends only (a byte append's version is its caller's check).
    if any(
        request.validation_version is not None and h.is_json(request.media_type or "")
        for request, _ in stored
    ):
        extensions.appended(last.stream_id)


group_commit.on_commit(_publish)
