"""The ASGI application of ``/v1/stream/<path>``, and ``serve``, the request loop every lean
endpoint shares (the Yjs endpoint too): CORS preflight, error mapping, and watching for the
client leaving. (A client that stops reading is cut off by the production protocol's write
deadline: durable_project.protocol.)

Channels' ``AsyncHttpConsumer`` does not notice a client that disconnects during a long
response (channels issues 1249, 1747), so these are plain ASGI callables: a GET runs as a task,
and a watcher cancels it on ``http.disconnect`` so an abandoned long-poll or SSE releases its
resources at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from access import auth
from access.auth import authenticate
from streams import held_answers, lifecycle
from streams.errors import (
    BadRequest,
    Forbidden,
    MethodNotAllowed,
    ProtocolError,
    ServiceUnavailable,
)
from streams.extensions import READ_ONLY_PATHS
from streams.http import handlers, live_reads
from streams.http.request import (
    ClientDisconnected,
    Receive,
    Request,
    Scope,
    Send,
    build_request,
    check_host,
)
from streams.http.responses import (
    ALLOWED_METHODS,
    BLOCK_BYTES,
    Response,
    error_response,
    preflight,
    send_response,
)
from streams.http.sending import BodyWatch, ResponseSender
from streams.store.failures import refusal_for
from streams.store.pool import is_connection_failure

logger = logging.getLogger(__name__)

# Handles one request; returns the answer, or None when it answered itself (SSE).
Handler = Callable[[Scope, Receive, ResponseSender, str | None], Awaitable[Response | None]]
ErrorRenderer = Callable[[ProtocolError], Response]

# The Allow header of a 405, here and at the Yjs endpoint: what a preflight allows.
ALLOW = ALLOWED_METHODS


async def serve(
    scope: Scope,
    receive: Receive,
    send: Send,
    handle: Handler,
    render_error: ErrorRenderer = error_response,
) -> None:
    if scope["type"] != "http":
        return
    headers = dict(scope.get("headers", []))
    origin_bytes = headers.get(b"origin")
    origin = origin_bytes.decode("latin-1") if origin_bytes else None
    method = scope["method"].upper()
    # Every message of the answer goes through it (streams.http.sending).
    receive = BodyWatch(receive, headers)
    sender = ResponseSender(send, scope, receive)
    if method == "OPTIONS":
        requested = headers.get(b"access-control-request-headers")
        answer = preflight(requested.decode("latin-1") if requested else None)
        with contextlib.suppress(ClientDisconnected):
            await send_response(sender, answer, origin)
        return
    lifecycle.ensure_started()

    async def run() -> None:
        try:
            check_host(scope.get("headers", []))
            lifecycle.require_checked()
            response = await handle(scope, receive, sender, origin)
        except ClientDisconnected:
            return
        except asyncio.CancelledError:
            # Cut short by a stopping server (--timeout-graceful-shutdown): a 503 to retry,
            # where uvicorn would answer 500 and log a traceback (probe 10f), but only when
            # nothing of the request can have been done: a read, or a write whose body had
            # not all arrived. A write with its body may already be in a transaction that
            # commits after this (group commit's writers are not the request's: review), so
            # its outcome is unknown, and uvicorn says so.
            if sender.started or not lifecycle.shutting_down:
                raise
            unread = receive.pending and method in ("POST", "PUT")  # they read it first
            if not (unread or method in ("GET", "HEAD")):
                raise
            response = render_error(lifecycle.STOPPING)
        except ProtocolError as error:
            response = None if sender.started else render_error(error)
        except Exception as exc:  # noqa: BLE001 - the last line: one answer, never a crash
            unexpected = _unexpected(exc, method, scope.get("path", ""))
            response = None if sender.started else render_error(unexpected)
        if sender.started:
            if response is None:
                # A response that began (SSE) cannot be replaced by an error: it just ends.
                await _end_body(sender)
            return
        if response is not None:
            # Held until its last block is handed to the connection (or the client left); one
            # of a single block is handed over at once (no bookkeeping on appends' answers).
            held = response.length if response.length > BLOCK_BYTES else 0
            with contextlib.suppress(ClientDisconnected), held_answers.holding(held):
                await send_response(sender, response, origin, head=method == "HEAD")

    if method == "GET":
        await _run_watching_disconnect(run(), receive)
    else:
        await run()


def _unexpected(exc: Exception, method: str, path: str) -> ProtocolError:
    """The answer to an exception no layer turned into a protocol error: the database being
    unreachable is a 503, a value the store refused is the request's fault (4xx), anything
    else is a bug (500, logged with its traceback)."""
    if is_connection_failure(exc):
        logger.warning("database unreachable for %s %s: %s", method, path, exc)
        return ServiceUnavailable("the database is unavailable; retry later")
    refusal = refusal_for(exc)
    if refusal is not None:
        logger.warning("store refused %s %s: %s", method, path, str(exc).strip()[:200])
        return refusal
    logger.error("unhandled error for %s %s", method, path, exc_info=exc)
    return ProtocolError("internal server error")


async def _end_body(send: Send) -> None:
    with contextlib.suppress(Exception):
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _run_watching_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run a GET while listening for ``http.disconnect``; cancel the GET when it comes."""
    handler = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                handler.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await handler
    except asyncio.CancelledError:
        if not handler.cancelled():
            raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def handle_get(request: Request, send: ResponseSender, origin: str | None) -> Response | None:
    """GET: a catch-up read, a long-poll, or an SSE stream (which answers itself)."""
    live = request.query_value("live")
    if live == "sse":
        await live_reads.server_sent_events(request, send, origin)
        return None
    if live == "long-poll":
        return await live_reads.long_poll(request)
    if live in (None, "", "false"):
        return await handlers.read(request)
    raise BadRequest(f"unknown live mode {live!r} (use long-poll or sse)")


async def handle_other(request: Request) -> Response:
    """PUT, POST, HEAD, DELETE."""
    match request.method:
        case "PUT":
            return await handlers.create(request)
        case "POST":
            if request.header(handlers.TRIM_BEFORE) is not None:
                return await handlers.trim(request)
            return await handlers.append(request)
        case "HEAD":
            return await handlers.head(request)
        case "DELETE":
            return await handlers.delete(request)
    raise MethodNotAllowed(f"method {request.method} is not allowed", headers={"Allow": ALLOW})


async def _handle_stream(
    scope: Scope, receive: Receive, send: ResponseSender, origin: str | None
) -> Response | None:
    request = build_request(scope, receive, handlers.STREAM_ROUTE)
    authorization = request.header("authorization")
    judged_at = auth.generation()
    request.principal = await authenticate(authorization, request.query)
    if request.method == "GET":
        judge = functools.partial(authenticate, authorization, request.query, rate_limited=False)
        request.standing = auth.Standing(request.principal, judge, judged_at)
        return await handle_get(request, send, origin)
    if request.path in READ_ONLY_PATHS and request.method in ("PUT", "POST", "DELETE"):
        raise Forbidden("this stream is maintained by the server and is read-only")
    return await handle_other(request)


async def stream_app(scope: Scope, receive: Receive, send: Send) -> None:
    await serve(scope, receive, send, _handle_stream)
