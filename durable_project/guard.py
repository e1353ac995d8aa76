"""What every request to a Django-served URL (admin, REST API, pages) passes before Django.

Django's ASGI handler reads the whole request body, spooling it to a temporary file, before
any view or limit sees it, and waits for it as long as the client likes. This guard reads the
body first, with the same rules as the protocol endpoints: at most
``DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes (413 as soon as it is known to be larger) and each part
within ``DS_BODY_READ_TIMEOUT_SECS`` (408). It also refuses NUL characters in the path and
query string (400), which no URL of the site uses and PostgreSQL cannot store.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_to_bytes

from django.conf import settings

from streams.errors import BadRequest, ProtocolError
from streams.http.request import ClientDisconnected, Receive, Scope, Send, read_body
from streams.http.responses import error_response, send_response

ASGIApp = Any


def guarded(app: ASGIApp) -> ASGIApp:
    async def guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        try:
            _check_url(scope)
            headers = dict(scope.get("headers", []))
            length = headers.get(b"content-length")
            body = await read_body(
                receive,
                length.decode("latin-1") if length is not None else None,
                settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
            )
        except ClientDisconnected:
            return
        except ProtocolError as error:
            await send_response(send, error_response(error), None)
            return
        await app(scope, _replay(body, receive), send)

    return guard


def _check_url(scope: Scope) -> None:
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string", b"")
    if b"\x00" in unquote_to_bytes(raw) or b"\x00" in unquote_to_bytes(query):
        raise BadRequest("NUL characters are not allowed in URLs")


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
