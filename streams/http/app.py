"""The ASGI application of ``/v1/stream/<path>``: dispatch by method, map errors, and watch for
the client leaving.

Channels' ``AsyncHttpConsumer`` does not notice a client that disconnects during a long
response (channels issues 1249, 1747), so this is a plain ASGI callable: the handler runs as a
task, and a watcher cancels it on ``http.disconnect`` so an abandoned long-poll or SSE releases
its resources at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from streams.errors import Forbidden, MethodNotAllowed, ProtocolError
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
from streams.http.responses import Response, error_response, preflight, send_response
from streams.store import maintenance

logger = logging.getLogger(__name__)


async def stream_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    headers = dict(scope.get("headers", []))
    origin_bytes = headers.get(b"origin")
    origin = origin_bytes.decode("latin-1") if origin_bytes else None
    method = scope["method"].upper()
    if method == "OPTIONS":
        requested = headers.get(b"access-control-request-headers")
        await send_response(
            send,
            preflight(origin, requested.decode("latin-1") if requested else None),
            origin,
        )
        return
    maintenance.ensure_started()
    try:
        request = build_request(scope, receive, handlers.STREAM_ROUTE)
        if method == "GET":
            await _run_watching_disconnect(request, send, origin)
            return
        response = await _dispatch(request)
    except ClientDisconnected:
        return
    except ProtocolError as error:
        response = error_response(error)
    except Exception:
        logger.exception("unhandled error for %s %s", method, scope.get("path"))
        response = error_response(ProtocolError("internal server error"))
    await send_response(send, response, origin, head=method == "HEAD")


async def _dispatch(request: Request) -> Response:
    if request.path in READ_ONLY_PATHS and request.method in ("PUT", "POST", "DELETE"):
        raise Forbidden("this stream is maintained by the server and is read-only")
    match request.method:
        case "PUT":
            return await handlers.create(request)
        case "POST":
            return await handlers.append(request)
        case "HEAD":
            return await handlers.head(request)
        case "DELETE":
            return await handlers.delete(request)
    raise MethodNotAllowed(
        f"method {request.method} is not allowed",
        headers={"Allow": "GET, HEAD, POST, PUT, DELETE, OPTIONS"},
    )


async def _get(request: Request, send: Send, origin: str | None) -> None:
    try:
        live = request.query_value("live")
        if live == "sse":
            await live_reads.server_sent_events(request, send, origin)
            return
        if live == "long-poll":
            response = await live_reads.long_poll(request)
        elif live in (None, "", "false"):
            response = await handlers.read(request)
        else:
            raise_bad_live(live)
    except ProtocolError as error:
        response = error_response(error)
    await send_response(send, response, origin)


def raise_bad_live(value: str) -> None:
    from streams.errors import BadRequest

    raise BadRequest(f"unknown live mode {value!r} (use long-poll or sse)")


async def _run_watching_disconnect(request: Request, send: Send, origin: str | None) -> None:
    """Run a GET while listening for ``http.disconnect``; cancel the GET when it comes."""
    handler = asyncio.ensure_future(_get(request, send, origin))

    async def watch() -> None:
        while True:
            message = await request.receive()
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
