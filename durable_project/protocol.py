"""The HTTP/1.1 protocol of the production command: uvicorn's httptools protocol with a bounded
request head (the request line and the headers) and a write deadline, neither of which uvicorn
has.

uvicorn and httptools put a request's URL and each header value together by concatenation, as
the parts arrive: the work grows with the square of the size, on the event loop, before any
application code sees the request. One request with a 150 MiB header stalled every connection
of its worker for seconds, and uvicorn's supervisor killed the worker as unresponsive. A head
may also come as slowly as its client likes: a byte every few seconds held a connection open
for as long as the client kept sending.

So a head is refused, and its connection closed, once more than ``MAX_HEAD_BYTES`` of it have
arrived (431), and when it is not complete ``DS_HTTP__HEAD_TIMEOUT_SECS`` after it began (408).
These are bounds on the work of the framing; the routes' own limits apply below them (the
protocol endpoints answer 431 to more than 64 KiB of headers: streams.http.request).

The write deadline. uvicorn writes what the application sends into the connection's buffer and
makes the next ``send`` wait while that buffer is over its high-water mark; a client that stops
reading, or reads a byte now and then, kept that ``send`` waiting for as long as it liked, and
with it the response it was being sent (megabytes per connection: an 8 MiB catch-up read, an
SSE session). So a connection whose buffer stays full for ``DS_SERVER__SEND_TIMEOUT_SECS`` is
aborted, on every route, unless it took ``SEND_PROGRESS_BYTES`` of the buffer meanwhile: then
it gets another deadline. A slow link is not a stalled client: with one block of an answer
(1 MiB) to take per deadline, links slower than about 35 KB/s were cut off at 30 s (and
started again from the same offset, to be cut off again), while the floor now is 64 KiB per
deadline, about 2 KB/s. Aborted, not closed: a close waits for the buffer to drain, which a
client that never reads never lets happen; an abort drops the buffer at once, and with
``SO_LINGER`` 0 the kernel drops what it held too and resets the connection. The deadline lives
here, on the transport, so that it holds whatever wraps the application (tracing's middleware
wraps ``receive`` and ``send``). The application may cut a connection sooner (an SSE session
whose interval ended while a send waited: streams.http.sending) through the ASGI extension
``CUT`` in each request's scope.

Run it with ``uvicorn --http durable_project.protocol:HttpToolsProtocol`` (README, Production).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import re
import socket
import struct
import termios
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as UvicornHttpToolsProtocol

# At most this much of a request's head is read: counted as it arrives, so over by at most one
# read of the socket (256 KiB), which may begin with the end of the request before.
MAX_HEAD_BYTES = 1024 * 1024
# Requests a client may pipeline ahead of their answers (429 past them): all of them may come
# in one write, before any answer could be (about 1.4 KB of memory each while queued).
MAX_PIPELINED = 256
# The scope extension through which the application cuts its connection:
# ``scope["extensions"][CUT]["cut"]()``.
CUT = "durable_streams.cut"

# A client that took at least this much of its connection's buffer since its write deadline
# was set gets another one.
SEND_PROGRESS_BYTES = 64 * 1024

_LINGER_RESET = struct.pack("ii", 1, 0)
_INT = struct.pack("i", 0)

logger = logging.getLogger(__name__)


def _origin(scheme: bytes, authority: bytes) -> bytes:
    """A host and port as compared: lowercase, without the scheme's default port."""
    default = b":443" if scheme.lower() == b"https" else b":80"
    authority = authority.lower()
    return authority[: -len(default)] if authority.endswith(default) else authority


class HttpToolsProtocol(UvicornHttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request head over ``MAX_HEAD_BYTES`` or slower
    than ``DS_HEAD_TIMEOUT_SECS``, and cutting a connection whose client has not taken what was
    written to it for ``DS_SEND_TIMEOUT_SECS``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False  # a request's head has begun and is not complete yet
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_buffered = 0  # the buffer's size when the write deadline was set
        self._idle_timer: asyncio.TimerHandle | None = None
        # Nothing more is read from the connection (after a request asked to switch
        # protocols, or one was refused at its head), and the request's body is ignored.
        self._reading_done = False
        self._body_ignored = False
        # The client half-closed its side: what it sent is answered, then the connection closes.
        self._client_done = False
        # The answer refusing a request, written once the answers before it are out (_refuse).
        self._refusal: bytes | None = None
        # The requests of this connection whose answers are not complete yet.
        self._answering: list[Any] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A connection's first request must begin within ``DS_HEAD_TIMEOUT_SECS``: uvicorn
        sets no timer before a first byte, so a client could hold any number of connections
        that never send one (each a descriptor) for as long as it liked."""
        super().connection_made(transport)
        self._start_idle_timer()

    def on_response_complete(self) -> None:
        """The next request must begin within ``DS_HEAD_TIMEOUT_SECS`` too: uvicorn's
        keep-alive timer stops at any byte, and bytes that begin no request (an empty line)
        stopped it for good. A client that half-closed gets no more than its answers."""
        super().on_response_complete()
        if self.timeout_keep_alive_task is None or self._in_head:
            return  # a pipelined request started, or one is arriving
        # Nothing pipelined: uvicorn armed its keep-alive timer.
        if self._refusal is not None:
            self._send_refusal()
        elif self._client_done:
            self.transport.close()
        else:
            self._start_idle_timer()

    def _start_idle_timer(self) -> None:
        self._stop_idle_timer()
        if not self.transport.is_closing():
            self._idle_timer = self.loop.call_later(
                settings.DS_HEAD_TIMEOUT_SECS, self._idle_timed_out
            )

    def _idle_timed_out(self) -> None:
        self._idle_timer = None
        if not self.transport.is_closing():
            logger.info("closed a connection that began no request in time")
            self.transport.close()

    def _stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def data_received(self, data: bytes) -> None:
        if self._reading_done:
            return  # nothing after a request that asked to switch protocols is HTTP to us
        super().data_received(data)
        # Counted once the parser has had the data: a read that completed the head does not
        # count, whatever body came with it.
        if not self._in_head or self.transport.is_closing():
            self._head_bytes = 0
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, b"the request's head is too large")

    def on_message_begin(self) -> None:
        if self._reading_done:
            return  # what the parser still finds in a read after a refusal is not run
        super().on_message_begin()
        self._stop_idle_timer()
        self._in_head = True
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(
                settings.DS_HEAD_TIMEOUT_SECS, self._head_timed_out
            )

    def on_headers_complete(self) -> None:
        if self._reading_done:
            return  # a request pipelined after a refused one, in the same read (review)
        self._in_head = False
        self._head_bytes = 0
        self._stop_head_timer()
        self.scope.setdefault("extensions", {})[CUT] = {"cut": self.cut}
        refusal = self._framing_refusal()
        if refusal is not None:
            self._refuse(*refusal)
            return
        if len(self.pipeline) >= MAX_PIPELINED:
            # uvicorn queued every request of a read, without bound: 20 connections writing
            # 25,000 pipelined requests each and reading nothing took both workers' memory
            # from 119 to 828 MiB and held another client's request 15 s (probe 10b).
            self._refuse(429, b"too many requests pipelined without reading their answers")
            return
        earlier = self.cycle
        if self.parser.should_upgrade():
            self._ignore_upgrade()
        else:
            super().on_headers_complete()
        if self.cycle is not earlier:  # a request to answer (not one refused)
            self._answering = [c for c in self._answering if not c.response_complete]
            self._answering.append(self.cycle)

    def _framing_refusal(self) -> tuple[int, bytes] | None:
        """What httptools' parser lets through and RFC 9112 does not (probe 8b): a version
        other than 1.0 and 1.1 (505), a transfer coding other than chunked (501: ``gzip,
        chunked`` bodies were stored still compressed), and a request target in absolute form
        whose host is not the Host header (400: the Host header was checked and used, where
        3.2.2 says the target's host counts)."""
        version = self.parser.get_http_version()
        if version not in ("1.0", "1.1"):
            return 505, b"HTTP/1.1 and HTTP/1.0 only"
        host = b""
        for name, value in self.headers:
            if name == b"transfer-encoding":
                if version == "1.0":  # RFC 9112 6.1: faulty framing
                    return 400, b"HTTP/1.0 has no transfer codings"
                if [coding.strip().lower() for coding in value.split(b",")] != [b"chunked"]:
                    return 501, b"no transfer coding but chunked is supported"
            elif name == b"host":
                host = value
        scheme, _, rest = self.url.partition(b"://")
        if scheme.lower() in (b"http", b"https") and rest:
            authority = re.split(rb"[/?#]", rest, maxsplit=1)[0]
            if _origin(scheme, authority) != _origin(scheme, host.strip()):
                return 400, b"the request target's host is not the Host header"
        return None

    def _ignore_upgrade(self) -> None:
        """A request asking to switch protocols (``Upgrade`` with ``Connection: upgrade``, or
        CONNECT). llhttp reads nothing after its head as HTTP, and uvicorn read the body,
        arriving later, as the next request: a body that was a whole request was run (request
        smuggling behind a proxy that forwards ``Upgrade``; probe 8b). No protocol is switched
        to here: the Upgrade is ignored (RFC 9110 7.8), the request answered as any other,
        and the connection closed after it, nothing more read from it. One declaring a body is
        refused (400): llhttp stops at the upgrade, before or after the body depending on how
        it arrives."""
        self._reading_done = True
        declared = {name: value for name, value in self.headers}
        length = declared.get(b"content-length", b"0").strip()
        if b"transfer-encoding" in declared or length.strip(b"0"):
            self._refuse(400, b"a request asking to switch protocols cannot have a body here")
            return
        super().on_headers_complete()
        self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if not self._body_ignored:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._body_ignored:
            super().on_message_complete()

    def _should_upgrade(self) -> bool:
        """Never: this server speaks no other protocol. uvicorn switched to WebSockets whenever
        the websockets package was installed, and the application, having no WebSocket route,
        answered 500 with a traceback in the log (probe 8b)."""
        return False

    def _unsupported_upgrade_warning(self) -> None:
        """Nothing to say: an Upgrade is ignored (_ignore_upgrade), and uvicorn's warning for
        each one let anyone fill the log."""

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio.Protocol's signature
        """The client half-closed its side of the connection after sending its request (or
        closed it: a FIN says no more): a request that changes something, and requests
        pipelined, are answered, then the connection closes. uvicorn let the transport close
        at once: an append was committed and never answered, and a client retrying it wrote
        it twice (probe 8b). A request still being received cannot complete: it is dropped,
        and the requests before it are answered all the same (probe 10k: a partial request
        pipelined behind an append closed the connection, the append committed and never
        answered). A read's answer is not worth keeping the connection for: the connection
        closes now, as when the client goes (and a live read ends at once)."""
        self._client_done = True
        if self._in_head:
            self._in_head = False
            self._stop_head_timer()
        elif self.cycle is not None and self.cycle.more_body:
            # Queued behind a request still being answered, it never runs; running, it is the
            # only request unanswered, and connection_lost tells it its client is gone.
            partial = self.cycle
            for entry in [entry for entry in self.pipeline if entry[0] is partial]:
                self.pipeline.remove(entry)
            self._answering = [c for c in self._answering if c is not partial]
        # A FIN is also how a client that has gone away closes: a read (a long-poll, an SSE
        # connection) is told at once, as before, and its answer is not worth waiting for;
        # one that changes something, or requests pipelined behind another, are answered.
        writes = any(
            not cycle.response_complete and cycle.scope["method"] not in ("GET", "HEAD", "OPTIONS")
            for cycle in self._answering
        )
        return bool(self.pipeline) or writes

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_idle_timer()
        self._stop_head_timer()
        self._stop_write_timer()
        if self.scope is not None:
            # The extension refers back to this protocol: a cycle the collector would free late.
            self.scope.get("extensions", {}).pop(CUT, None)
        # uvicorn tells only the connection's latest request that it is gone: an answer before
        # a pipelined request, waiting for the client to take the buffer, was written to the
        # closed transport once the wait ended, a traceback ("Exception in ASGI application")
        # on every route (probe 10b). Every request not yet answered is told.
        for cycle in self._answering:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._answering.clear()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer went over its high-water mark: the client has until the
        deadline to take enough of it."""
        super().pause_writing()
        if self._write_timer is None:
            self._set_write_deadline()

    def _set_write_deadline(self) -> None:
        self._write_buffered = self._unsent()
        self._write_timer = self.loop.call_later(
            settings.DS_SEND_TIMEOUT_SECS, self._write_timed_out
        )

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def cut(self) -> None:
        """Abort the connection, dropping what it buffered (a pending ``send`` returns, and
        ``receive`` reports the client gone)."""
        self._stop_write_timer()
        if self.transport.is_closing():  # its descriptor may be another connection's by now
            self.transport.abort()
            return
        # ValueError: the socket of a connection already closed has no descriptor any more.
        with contextlib.suppress(OSError, AttributeError, TypeError, ValueError):
            self.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET
            )
        self.transport.abort()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self._write_buffered - self._unsent() >= SEND_PROGRESS_BYTES:
            self._set_write_deadline()  # taken slowly, but taken
            return
        path = self.cycle.scope.get("path", "") if self.cycle is not None else ""
        logger.info("cut a connection that did not take its response in time: %s", path)
        self.cut()

    def _unsent(self) -> int:
        """The bytes written to this connection that its client has not taken yet: in the
        transport's buffer, and in the kernel's (unsent or not acknowledged: ``SIOCOUTQ``).
        The kernel's count matters: it may hold more than a deadline's worth of a slow link
        (about 700 KB on loopback here), and takes more from the transport only once much of
        it has gone, so the transport's buffer alone can stand still while the client reads."""
        unsent = self.transport.get_write_buffer_size()
        if self.transport.is_closing():  # its descriptor may be another connection's by now
            return unsent
        with contextlib.suppress(OSError, AttributeError, TypeError, ValueError):
            sock = self.transport.get_extra_info("socket")
            queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _INT)
            unsent += struct.unpack("i", queued)[0]
        return unsent

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The request before (pipelined) is still being answered: this head cannot be
            # read on anyway until that answer ends, and is not late for it.
            self._head_timer = self.loop.call_later(
                settings.DS_HEAD_TIMEOUT_SECS, self._head_timed_out
            )
            return
        self._refuse(408, b"the request's head did not arrive in time")

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, message: bytes) -> None:
        """Answer ``status`` and close the connection, reading nothing more from it. Answers
        to requests before it (being sent, or pipelined and waiting their turn) go first: the
        refusal is written after the last of them (``on_response_complete``). It was not: the
        connection was closed under them, and a request committed and never answered is
        written twice by a client that retries it (review)."""
        self._in_head = False
        self._stop_head_timer()
        self._reading_done = self._body_ignored = True
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\n" % len(message),
            b"connection: close\r\n\r\n",
            message,
        ]
        self._refusal = b"".join(head)
        if (self.cycle is None or self.cycle.response_complete) and not self.pipeline:
            self._send_refusal()

    def _send_refusal(self) -> None:
        self._unset_keepalive_if_required()
        if not self.transport.is_closing() and self._refusal is not None:
            self.transport.write(self._refusal)
        self._refusal = None
        self.transport.close()
