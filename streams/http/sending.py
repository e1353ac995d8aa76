"""The one way the lean endpoints' response messages reach the client, noting whether the
response began, and bounded in time where a session must end.

The write deadline itself is the production protocol's (durable_project.protocol): a
connection whose client has not taken what was written to it for ``DS_SEND_TIMEOUT_SECS`` is
aborted, on every route. An SSE session must also end when its reconnect interval does
(PROTOCOL.md 5.8, 10.2), but its interval is only checked between events: a send still
waiting then cuts the connection at once, through the protocol's ``CUT`` scope extension.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from durable_project.protocol import CUT
from streams.http.request import ClientDisconnected, Receive, Scope, Send

logger = logging.getLogger(__name__)


class ClientTooSlow(ClientDisconnected):
    """The client did not take a response message in time; its connection was cut."""


class BodyWatch:
    """A request's ``receive``, noting whether its body has all arrived (``pending``);
    ``headers`` are the request's, as a dict (built once by its caller)."""

    __slots__ = ("_receive", "pending")

    def __init__(self, receive: Receive, headers: dict[bytes, bytes]) -> None:
        self._receive = receive
        length = headers.get(b"content-length", b"").strip().lstrip(b"0")
        self.pending = bool(length) or b"transfer-encoding" in headers

    async def __call__(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self.pending = False
        return message


class ResponseSender:
    """The ``send`` of one request: ``await sender(message)``, and with ``until`` (a
    ``time.monotonic()`` deadline) a send not done by then cuts the connection and raises
    ``ClientTooSlow``. Notes whether the response began (``started``), which an error then can
    no longer replace. An answer begun before the request's body has all arrived (``body``:
    a refusal) closes the connection after it, rather than keep it open for the rest of a body
    nobody will read (probe 9a: a client refused went on sending a byte at a time)."""

    __slots__ = ("_body", "_scope", "_send", "started")

    def __init__(self, send: Send, scope: Scope, body: BodyWatch | None = None) -> None:
        self._send = send
        self._scope = scope
        self._body = body
        self.started = False

    async def __call__(self, message: dict[str, Any], *, until: float | None = None) -> None:
        # Noted before the send: a start the server failed on may have begun the response.
        if message["type"] == "http.response.start":
            self.started = True
            if self._body is not None and self._body.pending:
                message = message | {"headers": [*message["headers"], (b"connection", b"close")]}
        if until is None or until == math.inf:
            await self._send(message)
            return
        try:
            async with asyncio.timeout(max(until - time.monotonic(), 0)):
                await self._send(message)
        except TimeoutError:
            self.cut()
            raise ClientTooSlow from None

    def cut(self) -> None:
        """Cut the connection, dropping what it buffered. Under another server than the
        production protocol there is no way to: the application ends, and the server closes
        the connection as it does for an unfinished response."""
        extension = self._scope.get("extensions", {}).get(CUT)
        if extension is not None:
            logger.info("cut a connection whose session ended in a send: %s", self._scope["path"])
            extension["cut"]()
