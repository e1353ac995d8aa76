"""The one way the lean endpoints' response messages reach the client: under a write deadline.

An ASGI server writes what it is sent into the connection's buffer, and its next ``send``
waits for the client to take it (uvicorn's flow control). A client that stops reading, or
reads a byte now and then, would keep that ``send`` waiting for as long as it liked, and with
it the read being answered (megabytes per connection) and the SSE session, whose reconnect
interval (PROTOCOL.md 5.8, 10.2) is only checked between events. So every message must be
taken within ``DS_SEND_TIMEOUT_SECS`` (an SSE session's: also by the end of its interval);
otherwise the connection is aborted.

Aborted, not closed: an application that raises after its response began gets its connection
``close()``d by uvicorn, which waits for the buffer to drain: with a client that never reads,
the connection and the bytes it buffered stayed, as before (measured). Aborting drops the
buffer at once; with ``SO_LINGER`` 0 the kernel drops what it held too and resets the
connection instead of retrying it as an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from typing import Any, cast

from django.conf import settings

from streams.http.request import ClientDisconnected, Receive, Send

logger = logging.getLogger(__name__)

_LINGER_RESET = struct.pack("ii", 1, 0)


class ClientTooSlow(ClientDisconnected):
    """The client did not take a response message in time; its connection was cut."""


class ResponseSender:
    """The ``send`` of one request, bounded: ``await sender(message)`` returns once the server
    took the message, or raises ``ClientTooSlow`` after cutting the connection. Notes whether
    the response began (``started``), which an error then can no longer replace."""

    __slots__ = ("_receive", "_send", "path", "started")

    def __init__(self, send: Send, receive: Receive, path: str = "") -> None:
        self._send = send
        self._receive = receive
        self.path = path
        self.started = False

    async def __call__(self, message: dict[str, Any], *, until: float | None = None) -> None:
        """Send ``message`` within ``DS_SEND_TIMEOUT_SECS``, and by ``until`` (a
        ``time.monotonic()`` deadline) when given."""
        timeout = settings.DS_SEND_TIMEOUT_SECS
        if until is not None:
            timeout = min(timeout, until - time.monotonic())
        # Noted before the send: a start the server failed on may have begun the response.
        self.started = self.started or message["type"] == "http.response.start"
        try:
            async with asyncio.timeout(max(timeout, 0)):
                await self._send(message)
        except TimeoutError:
            self.abort()
            raise ClientTooSlow from None

    def abort(self) -> None:
        """Cut the connection, dropping what it buffered."""
        transport = _transport(self._receive)
        logger.info("cut a connection that did not take its response in time: %s", self.path)
        if transport is None:
            # Another server than uvicorn: it closes the connection of an application that
            # ended without completing its response, as best it can.
            return
        with contextlib.suppress(OSError, AttributeError, TypeError):
            transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET
            )
        transport.abort()


async def send_by(send: Send, message: dict[str, Any], until: float) -> None:
    """``send(message)``, by ``until`` too when ``send`` is a ``ResponseSender`` (the one
    ``serve`` made; the Yjs endpoint passes it on typed as a plain ``Send``)."""
    if isinstance(send, ResponseSender):
        await send(message, until=until)
    else:
        await send(message)


def _transport(receive: Receive) -> asyncio.Transport | None:
    """The connection's transport, which ASGI does not expose: uvicorn's HTTP/1.1 protocols
    (and durable_project.protocol, built on them) call the application with ``receive`` bound
    to the request's cycle, which holds it. tests/http/test_slow_readers.py pins this."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    # uvloop's transports are not asyncio.Transport subclasses: known by what they do.
    if callable(getattr(transport, "abort", None)):
        return cast(asyncio.Transport, transport)
    return None
