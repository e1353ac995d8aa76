"""The ASGI application of the reserved control prefix ``/v1/stream/__ds/`` (PROTOCOL.md 6, 7),
routed before the streams (``durable_project.asgi``), so no control path is ever read as a
stream (and ``streams.http.request`` refuses ``__ds`` stream paths).

Thin handlers: parse the URL and body, call one service, render JSON. Errors use the
subscription error body ``{"error": {"code", "message", ...}}``, in one renderer.

    GET          __ds/jwks.json                          the webhook signing keys (6.5)
    PUT GET DEL  __ds/subscriptions/<id>                 (6.2, 6.3)
    POST         __ds/subscriptions/<id>/streams         explicit links (6.4)
    DELETE       __ds/subscriptions/<id>/streams/<path>
    POST         __ds/subscriptions/<id>/callback        webhook callback (7.1)
    POST         __ds/subscriptions/<id>/claim|ack|release   pull-wake (7.2)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from django.conf import settings

from access.auth import authenticate
from streams.errors import MethodNotAllowed, ProtocolError
from streams.http.app import serve
from streams.http.request import Receive, Request, Scope, Send, request_for
from streams.http.responses import Response
from subscriptions import keys, services, store
from subscriptions.protocol import (
    SubscriptionError,
    invalid,
    parse_json_object,
    parse_subscription_id,
    stream_path,
)

PREFIX = "/v1/stream/__ds/"
# Subscription request bodies (configurations, acks) are small.
MAX_BODY_BYTES = 2 * 1024 * 1024

# Base protocol errors under the codes of PROTOCOL.md 6-7.
_CODES = {"BAD_REQUEST": "INVALID_REQUEST", "NOT_FOUND": "NOT_FOUND"}

Handler = Callable[[Request, list[str]], Awaitable[Response]]


def error_response(error: ProtocolError) -> Response:
    """The single place where errors of the control API become answers."""
    code = _CODES.get(error.code, error.code)
    fields = error.fields if isinstance(error, SubscriptionError) else {}
    body = {"error": {"code": code, "message": error.message, **fields}}
    headers = {"Content-Type": "application/json", "Cache-Control": "no-store"}
    headers.update(error.headers)
    if error.status in (408, 413):
        headers["Connection"] = "close"
    return Response(error.status, headers, json.dumps(body).encode())


def _json(status: int, value: Any, **headers: str) -> Response:
    return Response(
        status,
        {"Content-Type": "application/json", "Cache-Control": "no-store", **headers},
        json.dumps(value, separators=(",", ":")).encode(),
    )


async def _body(request: Request) -> dict[str, Any]:
    return parse_json_object(await request.body(MAX_BODY_BYTES))


async def _principal(request: Request) -> None:
    request.principal = await authenticate(request.header("authorization"), request.query)


def base_url(request: Request) -> str:
    """The server's URL for links in answers and callbacks: DS_SUBSCRIPTIONS__PUBLIC_URL, or
    the scheme and Host this request came with (the Host was checked against ALLOWED_HOSTS)."""
    if settings.DS_SUBSCRIPTIONS_PUBLIC_URL:
        return str(settings.DS_SUBSCRIPTIONS_PUBLIC_URL).rstrip("/")
    scheme = request.scope.get("scheme", "http")
    return f"{scheme}://{request.header('host') or 'localhost'}"


def render_subscription(view: store.SubscriptionView, base: str, kid: str | None) -> dict[str, Any]:
    """A subscription as PUT and GET answer it (PROTOCOL.md 6.3): never a signing secret."""
    webhook = None
    if view.webhook_url is not None:
        webhook = {
            "url": view.webhook_url,
            "signing": {"alg": "ed25519", "kid": kid, "jwks_url": f"{base}{PREFIX}jwks.json"},
        }
    created = view.created_at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {
        "id": view.subscription_id,
        "subscription_id": view.subscription_id,
        "type": view.type,
        "pattern": view.pattern,
        "streams": view.streams,
        "webhook": webhook,
        "wake_stream": view.wake_stream,
        "lease_ttl_ms": view.lease_ttl_ms,
        "created_at": created,
        "status": "failed" if view.failed else "active",
        "description": view.description,
    }


async def _rendered(request: Request, view: store.SubscriptionView, status: int) -> Response:
    kid = (await keys.signing_key()).kid if view.webhook_url is not None else None
    return _json(status, render_subscription(view, base_url(request), kid))


# -- handlers: one per operation -----------------------------------------------------------------


async def jwks(request: Request, _: list[str]) -> Response:
    return Response(
        200,
        {"Content-Type": "application/jwk-set+json", "Cache-Control": "public, max-age=300"},
        json.dumps(await keys.jwks()).encode(),
    )


async def put_subscription(request: Request, rest: list[str]) -> Response:
    await _principal(request)
    created, view = await services.put_subscription(
        subscription_id=rest[0],
        principal=request.principal,
        body=await _body(request),
        base_url=base_url(request),
    )
    return await _rendered(request, view, 201 if created else 200)


async def get_subscription(request: Request, rest: list[str]) -> Response:
    await _principal(request)
    view = await services.get_subscription(subscription_id=rest[0], principal=request.principal)
    return await _rendered(request, view, 200)


async def delete_subscription(request: Request, rest: list[str]) -> Response:
    await _principal(request)
    await services.delete_subscription(subscription_id=rest[0], principal=request.principal)
    return Response(204)


async def add_streams(request: Request, rest: list[str]) -> Response:
    await _principal(request)
    await services.add_streams(
        subscription_id=rest[0], principal=request.principal, body=await _body(request)
    )
    return Response(204)


async def remove_stream(request: Request, rest: list[str]) -> Response:
    await _principal(request)
    try:
        decoded = unquote_to_bytes("/".join(rest[2:])).decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the stream path is not valid UTF-8") from None
    await services.remove_stream(
        subscription_id=rest[0], principal=request.principal, path=stream_path(decoded)
    )
    return Response(204)


async def claim(request: Request, rest: list[str]) -> Response:
    await _principal(request)
    answer = await services.claim(
        subscription_id=rest[0], principal=request.principal, body=await _body(request)
    )
    return _json(200, answer)


def _report(kind: str) -> Handler:
    async def handle(request: Request, rest: list[str]) -> Response:
        result = await services.report(
            subscription_id=rest[0],
            kind=kind,
            authorization=request.header("authorization"),
            body=await _body(request),
        )
        if kind == "release":
            return Response(204)
        return _json(200, {"ok": True, "next_wake": result.next_wake})

    return handle


# -- routing -------------------------------------------------------------------------------------

# (URL shape, method) -> handler. Shapes: the segments after __ds/subscriptions/<id>.
_SUBSCRIPTION_ROUTES: dict[tuple[str, str], Handler] = {
    ("", "PUT"): put_subscription,
    ("", "GET"): get_subscription,
    ("", "DELETE"): delete_subscription,
    ("streams", "POST"): add_streams,
    ("streams/*", "DELETE"): remove_stream,
    ("callback", "POST"): _report("callback"),
    ("claim", "POST"): claim,
    ("ack", "POST"): _report("ack"),
    ("release", "POST"): _report("release"),
}


def _route(method: str, raw_path: str) -> tuple[Handler, list[str]]:
    """The handler of a URL under the control prefix, and the URL's segments after
    ``subscriptions/`` (the id decoded and checked first)."""
    if not raw_path.startswith(PREFIX):  # the prefix itself percent-encoded
        raise SubscriptionError(404, "NOT_FOUND", "no such control API under __ds/")
    rest = raw_path[len(PREFIX) :]
    if rest == "jwks.json":
        if method not in ("GET", "HEAD"):
            raise MethodNotAllowed("use GET", headers={"Allow": "GET, HEAD, OPTIONS"})
        return jwks, []
    segments = rest.split("/")
    if segments[0] != "subscriptions" or len(segments) < 2:
        raise SubscriptionError(404, "NOT_FOUND", "no such control API under __ds/")
    segments = segments[1:]
    try:
        segments[0] = parse_subscription_id(unquote_to_bytes(segments[0]).decode("utf-8"))
    except UnicodeDecodeError:
        raise invalid("the subscription id is not valid UTF-8") from None
    if len(segments) == 1:
        shape = ""
    elif segments[1] == "streams" and len(segments) > 2:
        shape = "streams/*"
    else:
        shape = "/".join(segments[1:])
    allowed = [m for (s, m) in _SUBSCRIPTION_ROUTES if s == shape]
    if not allowed:
        raise SubscriptionError(404, "NOT_FOUND", "no such subscription API")
    handler = _SUBSCRIPTION_ROUTES.get((shape, "GET" if method == "HEAD" else method))
    if handler is None:
        allow = ", ".join([*allowed, "OPTIONS"])
        raise MethodNotAllowed(f"method {method} is not allowed here", headers={"Allow": allow})
    return handler, segments


async def _handle(scope: Scope, receive: Receive, send: Send, origin: str | None) -> Response:
    request = request_for(scope, receive, path="")
    handler, segments = _route(request.method, request.raw_path)
    return await handler(request, segments)


async def control_app(scope: Scope, receive: Receive, send: Send) -> None:
    await serve(scope, receive, send, _handle, render_error=error_response)
