"""The ASGI application of ``/v1/yjs/<service>/docs/<doc path>`` (YJS-PROTOCOL.md 5).

A document is a stream of lib0-framed updates; awareness (``?awareness=<name>``) is a stream of
its own. Reads, writes and live delivery are the base protocol's (``streams.http``), addressed
to those internal streams; this module adds the Yjs rules on top: snapshot discovery and reads,
checks of document updates (awareness bytes pass through unchecked), documents that cannot be
closed, awareness streams created on demand, cascading deletes, per-service secrets,
compaction triggers, and the Yjs JSON error body.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging

from django.conf import settings

from access import auth
from access.auth import authenticate
from access.grants import Grant, Operation, Principal, doc_resource
from streams import services
from streams.errors import (
    BadRequest,
    Conflict,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    ServiceUnavailable,
)
from streams.http import app as streams_app
from streams.http import handlers, render
from streams.http.request import Receive, Request, Scope, Send, request_for
from streams.http.responses import Response
from streams.http.sending import ResponseSender
from streams.protocol.headers import AppendHeaders, is_true, media_type, parse_append_headers
from streams.store import reads
from streams.store.types import AppendResult
from yjs import compaction, engine, replicas, store
from yjs.engine import EngineTimeout, EngineUnavailable, Refused
from yjs.framing import FramingError, TooManyFrames, read_frames
from yjs.paths import (
    SNAPSHOT,
    SNAPSHOT_SUFFIX,
    DocRef,
    parse_awareness_name,
    parse_doc_url,
    parse_snapshot_key,
    snapshot_key,
)
from yjs.updates import INLINE_CHECK_BYTES, INLINE_CHECK_UPDATES, MAX_UPDATES, check_updates

logger = logging.getLogger(__name__)

METHOD_OPERATIONS = {
    "GET": Operation.READ,
    "HEAD": Operation.READ,
    "POST": Operation.APPEND,
    "PUT": Operation.MANAGE,
    "DELETE": Operation.MANAGE,
}


class YjsError(ProtocolError):
    """An error with a Yjs error code (YJS-PROTOCOL.md 10)."""

    def __init__(self, status: int, code: str, message: str, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.status = status
        self.code = code


# Base protocol errors as Yjs codes; a 404's meaning depends on what was looked up.
_CODES = {
    "BAD_REQUEST": "INVALID_REQUEST",
    "METHOD_NOT_ALLOWED": "INVALID_REQUEST",
    "NOT_FOUND": "DOCUMENT_NOT_FOUND",
    "GONE": "OFFSET_EXPIRED",
}


def error_response(error: ProtocolError) -> Response:
    """The single place where errors of the Yjs endpoint become answers: the spec's JSON body
    ``{"error": {"code", "message"}}`` with any headers the error carries."""
    code = _CODES.get(error.code, error.code)
    body = json.dumps({"error": {"code": code, "message": error.message}}).encode()
    headers = {"Content-Type": "application/json", "Cache-Control": "no-store"}
    headers.update(error.headers)
    return Response(error.status, headers, body)


async def _principal(
    given: str, query: dict[str, list[str]], service: str, *, rate_limited: bool = True
) -> Principal:
    """Who sends a request with ``Authorization: <given>``. A service with a secret
    (YJS_SERVICE_SECRETS) takes ``Bearer <secret>`` for everything on its documents; other
    credentials are judged as on every endpoint (in open mode, such a service still needs its
    secret)."""
    secret = settings.YJS_SERVICE_SECRETS.get(service)
    if secret and hmac.compare_digest(given.encode(), f"Bearer {secret}".encode()):
        everything = frozenset(Operation)
        return Principal("service", id=service, grants=(Grant(f"yjs/{service}/", everything),))
    principal = await authenticate(given or None, query, rate_limited=rate_limited)
    if secret and principal.kind == "open":
        raise YjsError(
            401,
            "UNAUTHORIZED",
            "missing or wrong service secret",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


async def _handle(
    scope: Scope, receive: Receive, send: ResponseSender, origin: str | None
) -> Response | None:
    request = request_for(scope, receive, path="")
    doc = parse_doc_url(request.raw_path)
    given = request.header("authorization") or ""
    judged_at = auth.generation()
    request.principal = await _principal(given, request.query, doc.service)
    if request.method == "GET":
        judge = functools.partial(_principal, given, request.query, doc.service, rate_limited=False)
        request.standing = auth.Standing(request.principal, judge, judged_at)
    request.resource = doc_resource(doc.service, doc.doc_path)
    # One check for everything a method does to a document or its awareness (the base
    # protocol's services check again, at no cost, what they are asked).
    operation = METHOD_OPERATIONS.get(request.method)
    if operation is None:
        raise _method_not_allowed(request)
    request.principal.require(request.resource, operation)
    awareness = request.query_value("awareness")
    if awareness is not None:
        name = parse_awareness_name(awareness)
        request.path = doc.awareness_stream(name)
        return await _awareness(request, send, origin, doc, name)
    request.path = doc.updates_stream
    return await _document(request, send, origin, doc)


async def yjs_app(scope: Scope, receive: Receive, send: Send) -> None:
    await streams_app.serve(scope, receive, send, _handle, render_error=error_response)


# -- documents --------------------------------------------------------------------------------


async def _document(
    request: Request, send: ResponseSender, origin: str | None, doc: DocRef
) -> Response | None:
    match request.method:
        case "GET":
            offset = request.query_value("offset")
            if offset == SNAPSHOT:
                return await _discover_snapshot(request, doc)
            if offset is not None and offset.endswith(SNAPSHOT_SUFFIX):
                return await _read_snapshot(doc, offset)
            return await streams_app.handle_get(request, send, origin)
        case "PUT":
            return render.created(request, await store.create_document(doc))
        case "POST":
            body, updates = await _update_body(request, doc)
            wanted = parse_append_headers(request.header)
            await _require_octet_stream(wanted, doc)
            append = services.byte_append(
                path=request.path,
                principal=request.principal,
                resource=request.resource,
                body=body,
                content_type=wanted.content_type,
                producer=wanted.producer,
                stream_seq=wanted.stream_seq,
            )
            result = await replicas.append_checked(request.path, append, updates, len(body))
            compaction.after_append(result.stream_id, result.next_offset)
            return render.appended(result, producer=wanted.producer is not None, stored_data=True)
        case "HEAD":
            return await handlers.head(request)
        case "DELETE":
            if not await store.delete_document(doc):
                raise NotFound("document does not exist")
            return Response(204, {"Cache-Control": "no-store"})
    raise _method_not_allowed(request)


async def _discover_snapshot(request: Request, doc: DocRef) -> Response:
    """307 to the current snapshot, or to offset=-1 without one (YJS-PROTOCOL.md 5.2)."""
    covers = await store.snapshot_pointer(doc)
    offset = snapshot_key(covers) if covers is not None else "-1"
    location = f"{request.raw_path}?offset={offset}"
    return Response(307, {"Location": location, "Cache-Control": "private, max-age=5"})


async def _read_snapshot(doc: DocRef, offset: str) -> Response:
    """The snapshot's encodeStateAsUpdate bytes; reading updates continues at
    Stream-Next-Offset (YJS-PROTOCOL.md 5.3)."""
    try:
        covers = parse_snapshot_key(offset)
    except BadRequest:
        raise BadRequest(f"invalid snapshot offset {offset[:80]!r}") from None
    data = await store.snapshot_data(doc, covers)
    if data is None:
        await store.snapshot_pointer(doc)  # DOCUMENT_NOT_FOUND when the document is gone
        raise YjsError(404, "SNAPSHOT_NOT_FOUND", "snapshot not found; retry offset=snapshot")
    headers = {
        "Content-Type": store.OCTET_STREAM,
        "Stream-Next-Offset": str(covers),
        "Cache-Control": "private, max-age=60",
    }
    return Response(200, headers, data)


async def _refuse_close(request: Request) -> None:
    """A document or awareness stream is never closed: a departing client's close is refused
    (400), and the stream stays open. A close of something that does not exist is still a 404
    (YJS-PROTOCOL.md 5.5, 5.9)."""
    if is_true(request.header("stream-closed")):
        await reads.stream_meta(request.path, touch=False)
        raise BadRequest(
            "Yjs documents and awareness streams cannot be closed; nothing was changed"
        )


async def _update_body(request: Request, doc: DocRef) -> tuple[bytes, list[bytes]]:
    """The POST body of a document and its updates: complete lib0 frames (YJS-PROTOCOL.md 7.2)
    of Yjs updates that compaction can merge (yjs.updates.check_updates), at most MAX_UPDATES
    of them (413). Whether they join the document is checked when appending (yjs.replicas).
    A body is refused only after the document is known to exist: a POST to a missing document
    is a 404 whatever its body (the base protocol's precedence, docs/gaps.md). That costs a
    query on refusals only, and before the off-loop check of a large body (no checking work
    for a missing document)."""
    await _refuse_close(request)
    body = await request.body(settings.DS_MAX_REQUEST_BYTES)
    try:
        if len(body) > INLINE_CHECK_BYTES:
            await _require_document(doc)
            updates = await asyncio.to_thread(_updates_of, body)  # up to 64 MiB of frames
        else:
            updates = _updates_of(body)
        if len(body) > INLINE_CHECK_BYTES or len(updates) > INLINE_CHECK_UPDATES:
            await _checked_by_engine(updates)
        else:
            check_updates(updates)
    except (BadRequest, PayloadTooLarge):
        await _require_document(doc)
        raise
    return body, updates


async def _require_octet_stream(wanted: AppendHeaders, doc: DocRef) -> None:
    """A document's updates are bytes (YJS-PROTOCOL.md 5.5): another content type is the
    base protocol's 409, answered before the POST is queued for its check (a refused append
    would cost the check's copy of the document a rebuild)."""
    given = wanted.content_type
    if given is not None and media_type(given) != store.OCTET_STREAM:
        await _require_document(doc)
        raise Conflict("Content-Type does not match the stream's content type")


def _updates_of(body: bytes) -> list[bytes]:
    if not body:
        raise BadRequest("empty update")
    try:
        return read_frames(body, limit=MAX_UPDATES)
    except TooManyFrames:
        raise PayloadTooLarge(f"more than {MAX_UPDATES} updates in one body") from None
    except FramingError as exc:
        raise BadRequest(f"body is not lib0-framed updates: {exc}") from None


async def _checked_by_engine(updates: list[bytes]) -> None:
    """``check_updates`` in the engine's process (yjs.engine: pycrdt holds Python's lock, for
    seconds on large updates): a 400 when they fail it or take past its deadline, a 503 when
    it is unavailable."""
    try:
        await engine.run(engine.checks_engine(), "check_updates", updates)
    except Refused as exc:
        raise BadRequest(str(exc)) from None
    except EngineTimeout as exc:
        raise BadRequest(f"the updates could not be checked within {exc} s") from None
    except EngineUnavailable as exc:
        logger.warning("Yjs engine: %s", exc)
        raise ServiceUnavailable("Yjs checks are unavailable; retry") from None


# -- awareness --------------------------------------------------------------------------------


async def _awareness(
    request: Request, send: ResponseSender, origin: str | None, doc: DocRef, name: str
) -> Response | None:
    try:
        match request.method:
            case "GET":
                return await streams_app.handle_get(request, send, origin)
            case "HEAD":
                return await handlers.head(request)
            case "PUT":
                await _require_document(doc)
                created = await store.create_awareness(doc, name)
                return Response(201 if created else 200, {"Cache-Control": "no-store"})
            case "POST":
                await _refuse_close(request)
                return await _broadcast(request, await _awareness_body(request, doc), doc, name)
            case "DELETE":
                return await handlers.delete(request)
    except NotFound:
        # Without the document that is what is missing (YJS-PROTOCOL.md 5.9); otherwise the
        # awareness stream is (never created, deleted, or expired).
        await _require_document(doc)
        raise YjsError(404, "STREAM_NOT_FOUND", f"awareness stream {name!r} not found") from None
    raise _method_not_allowed(request)


async def _awareness_body(request: Request, doc: DocRef) -> bytes:
    """An awareness POST's body, stored as sent: the server passes awareness bytes through
    without interpreting them (YJS-PROTOCOL.md 7.4, 12.4; docs/gaps.md), within the request
    body limit. Only an empty body is refused (400, or 404 without the document)."""
    body = await request.body(settings.DS_MAX_REQUEST_BYTES)
    if not body:
        await _require_document(doc)
        raise BadRequest("empty awareness update")
    return body


async def _broadcast(request: Request, body: bytes, doc: DocRef, name: str) -> Response:
    """Append an awareness update, creating the stream first when it does not exist (never
    created, or expired after its TTL) as long as the document exists (YJS-PROTOCOL.md 5.7)."""
    wanted = parse_append_headers(request.header)
    try:
        result = await _store(request, body, wanted)
    except NotFound:
        await _require_document(doc)
        await store.create_awareness(doc, name)
        result = await _store(request, body, wanted)
    return render.appended(result, producer=wanted.producer is not None, stored_data=True)


async def _store(request: Request, body: bytes, wanted: AppendHeaders) -> AppendResult:
    """The base protocol's append of a body to the request's stream."""
    return await services.append(
        path=request.path,
        principal=request.principal,
        resource=request.resource,
        body=body,
        content_type=wanted.content_type,
        close=wanted.close,
        producer=wanted.producer,
        stream_seq=wanted.stream_seq,
    )


async def _require_document(doc: DocRef) -> None:
    try:
        await store.snapshot_pointer(doc)
    except NotFound:
        raise YjsError(404, "DOCUMENT_NOT_FOUND", "document does not exist") from None


def _method_not_allowed(request: Request) -> MethodNotAllowed:
    return MethodNotAllowed(
        f"method {request.method} is not allowed", headers={"Allow": streams_app.ALLOW}
    )
