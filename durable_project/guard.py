"""What every request to a Django-served URL (admin, REST API, pages) passes before Django.

Django's ASGI handler reads the whole request body, spooling it to a temporary file, before
any view or limit sees it, and waits for it as long as the client likes. This guard reads the
body first, with the same rules as the protocol endpoints: at most
``DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes (413 as soon as it is known to be larger), arriving at
64 KiB per ``DS_BODY_READ_TIMEOUT_SECS`` (408). A body sent to the REST API (``/v1/``) is
read only once its credentials are known good (401 at the head otherwise, as the protocol
endpoints answer: probe 10b). It also refuses URLs with NUL characters, which no URL of the
site uses and PostgreSQL cannot store, and URLs that are not UTF-8 once percent-decoded
(Django reads such bytes as U+FFFD: ``/v1/state/streams/x%FF`` and ``x%EF%BF%BD`` named one
state stream, probe 9b); 400 both.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, unquote_to_bytes

from django.conf import settings

from access.auth import authenticate
from access.grants import credentials_required
from streams import lifecycle
from streams.errors import BadRequest, ProtocolError
from streams.http.request import ClientDisconnected, Receive, Scope, Send, read_body
from streams.http.responses import Response, error_response, send_response
from streams.http.sending import BodyWatch, ResponseSender

ASGIApp = Any


def guarded(app: ASGIApp) -> ASGIApp:
    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        body_watch = BodyWatch(receive, headers)
        api = scope.get("path", "").startswith("/v1/")
        try:
            _check_url(scope)
            lifecycle.require_checked()
            if body_watch.pending and api:
                await _require_credentials(headers, scope)
            length = headers.get(b"content-length")
            body = await read_body(
                body_watch,
                length.decode("latin-1") if length is not None else None,
                settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
            )
        except ClientDisconnected:
            return
        except ProtocolError as error:
            # Refused before its body was read: the connection closes after the answer.
            sender = ResponseSender(send, scope, body_watch)
            await send_response(sender, _api_error(error) if api else error_response(error), None)
            return
        await app(scope, _replay(body, receive), send)

    return guard


def _api_error(error: ProtocolError) -> Response:
    """A refusal as the REST API words its own (``streams.rest.exception_handler``)."""
    body = json.dumps({"detail": error.message, "code": error.code}).encode()
    headers = error_response(error).headers | {"Content-Type": "application/json"}
    return Response(error.status, headers, body)


def _check_url(scope: Scope) -> None:
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string", b"")
    try:
        path = unquote_to_bytes(raw.split(b"?", 1)[0]).decode("utf-8")
        arguments = unquote_to_bytes(query.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the URL is not UTF-8 once percent-decoded") from None
    if "\x00" in path or "\x00" in arguments:
        raise BadRequest("NUL characters are not allowed in URLs")


async def _require_credentials(headers: dict[bytes, bytes], scope: Scope) -> None:
    """Credentials good for the REST API, judged as its views will judge them (not counted
    against a rate limit twice); none at all in ``keys`` mode is a 401."""
    authorization = headers.get(b"authorization")
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    principal = await authenticate(
        authorization.decode("latin-1") if authorization is not None else None,
        query,
        rate_limited=False,
    )
    if not (principal.authenticated or principal.unrestricted):
        raise credentials_required()


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body, already read, as the first message; then the client's own (a disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
