"""The ASGI application of ``/v1/stream/<path>``, and ``serve``, the request loop every lean
endpoint shares (the Yjs endpoint too): CORS preflight, error mapping, and watching for the
client leaving.

Channels' ``AsyncHttpConsumer`` does not notice a client that disconnects during a long
response (channels issues 1249, 1747), so these are plain ASGI callables: a GET runs as a task,
and a watcher cancels it on ``http.disconnect`` so an abandoned long-poll or SSE releases its
resources at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from streams.errors import BadRequest, Forbidden, MethodNotAllowed, ProtocolError
from streams.extensions import READ_ONLY_PATHS
from streams.http import handlers, live_reads
from streams.http.request import (
    ClientDisconnected,
    Receive,
    Request,
    Scope,
    Send,
    build_request,
)
from streams.http.responses import (
    ALLOWED_METHODS,
    Response,
    error_response,
    preflight,
    send_response,
)
from streams.store import maintenance

logger = logging.getLogger(__name__)

# Handles one request; returns the answer, or None when it answered itself (SSE).
Handler = Callable[[Scope, Receive, Send, str | None], Awaitable[Response | None]]
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
    if method == "OPTIONS":
        requested = headers.get(b"access-control-request-headers")
        answer = preflight(requested.decode("latin-1") if requested else None)
        await send_response(send, answer, origin)
        return
    maintenance.ensure_started()

    async def run() -> None:
        try:
            response = await handle(scope, receive, send, origin)
        except ClientDisconnected:
            return
        except ProtocolError as error:
            response = render_error(error)
        except Exception:
            logger.exception("unhandled error for %s %s", method, scope.get("path"))
            response = render_error(ProtocolError("internal server error"))
        if response is not None:
            await send_response(send, response, origin, head=method == "HEAD")

    if method == "GET":
        await _run_watching_disconnect(run(), receive)
    else:
        await run()


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


async def handle_get(request: Request, send: Send, origin: str | None) -> Response | None:
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
            return await handlers.append(request)
        case "HEAD":
            return await handlers.head(request)
        case "DELETE":
            return await handlers.delete(request)
    raise MethodNotAllowed(f"method {request.method} is not allowed", headers={"Allow": ALLOW})


async def _handle_stream(
    scope: Scope, receive: Receive, send: Send, origin: str | None
) -> Response | None:
    request = build_request(scope, receive, handlers.STREAM_ROUTE)
    if request.method == "GET":
        return await handle_get(request, send, origin)
    if request.path in READ_ONLY_PATHS and request.method in ("PUT", "POST", "DELETE"):
        raise Forbidden("this stream is maintained by the server and is read-only")
    return await handle_other(request)


async def stream_app(scope: Scope, receive: Receive, send: Send) -> None:
    await serve(scope, receive, send, _handle_stream)
