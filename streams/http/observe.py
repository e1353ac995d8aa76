"""Every request, observed the same way whichever application answers it (``durable_project.asgi``
wraps each route): a request id, a count by route family, method and status, a duration, and one
log line.

The request id comes from ``X-Request-Id`` (when it is a short token) or is generated; it is
returned in the response and carried by the log lines of the work the request causes
(``durable_project.logs``). The log line names the method, route, path (never the query, which
may carry a signed URL's signature), status and duration: never a body or a credential.

Request lines are written a moment after their request (``RequestLines``): a request only
notes its figures, and the records are made and handed to the ``ds.request`` logger's
handlers together, at most ``LINE_DELAY_SECS`` later. Made one by one on the request's path,
they cost 60 us of a worker's CPU per request (measured, docs/benchmarks.md): a tenth of an
append.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings

from durable_project.logs import (
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    printable,
    request_id,
)
from streams import metrics
from streams.http.request import Receive, Scope, Send

ASGIApp = Callable[[Scope, Receive, Send], Any]
request_log = logging.getLogger("ds.request")

_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def observed(app: ASGIApp, route: str | Callable[[str], str]) -> ASGIApp:
    """``app``, observed; ``route`` names its route family (or a function of the path does)."""

    async def application(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = _request_id(scope)
        token = request_id.set(rid)
        rid_header = (b"x-request-id", rid.encode())
        hsts = _hsts_header(scope)
        status = 0
        answered = 0.0  # when the answer began (time.time()); 0 until then
        started = time.perf_counter()

        async def send_observed(message: dict[str, Any]) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
                answered = time.time()
                headers = [*message.get("headers", ()), rid_header]
                if hsts is not None and all(name.lower() != hsts[0] for name, _ in headers):
                    headers.append(hsts)
                message = message | {"headers": headers}
                try:
                    await send(message)
                except Exception:
                    # A head the server could not send (a header value the server refuses):
                    # the client got no answer, and the fault is the server's (probe 10e).
                    status = 500
                    raise
                return
            await send(message)

        try:
            await app(scope, receive, send_observed)
        finally:
            seconds = time.perf_counter() - started
            family = route if isinstance(route, str) else route(scope["path"])
            method = metrics.method_label(scope["method"])
            # 499: the client left before an answer (nginx's convention).
            metrics.REQUESTS.labels(family, method, str(status or 499)).inc()
            if b"live=" not in scope.get("query_string", b""):
                metrics.REQUEST_SECONDS.labels(family, method).observe(seconds)
            if settings.DS_LOG_REQUESTS and request_log.isEnabledFor(logging.INFO):
                request_lines.note(rid, scope["method"], printable(scope["path"]), status or 499,
                                   family, seconds, answered or time.time())  # fmt: skip
            request_id.reset(token)

    return application


def _hsts_header(scope: Scope) -> tuple[bytes, bytes] | None:
    """Strict-Transport-Security for an answer over HTTPS (as uvicorn's proxy headers tell)
    when ``DJANGO_HSTS_SECONDS`` asks for it: Django's pages had it, the protocol endpoints,
    where keys and signed URLs travel, did not (probe 10h)."""
    seconds = settings.SECURE_HSTS_SECONDS
    if not seconds or scope.get("scheme") != "https":
        return None
    return b"strict-transport-security", f"max-age={seconds}".encode()


# What a request line says: request id, method, path, status, route family, duration (s), and
# when it was answered (time.time() as the answer began; as the request ended if none began).
_Line = tuple[str, str, str, int, str, float, float]

# Request lines wait at most this long (seconds) before they are logged.
LINE_DELAY_SECS = 0.05
# ...or until this many are waiting.
LINE_BATCH = 256


class RequestLines:
    """The request lines of this process, logged in batches through ``ds.request``.

    ``note()`` keeps a line's figures; ``flush()`` makes each a ``LogRecord`` (with the time and
    request id of its request) and hands it to the logger, whose filters and handlers decide
    as configured. A flush is scheduled on the event loop of the first line waiting; a line
    noted outside an event loop, a full batch, and the end of the process flush at once. At
    most ``LINE_DELAY_SECS`` of lines are lost if the process is killed (-9)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lines: list[_Line] = []
        # The loop a flush is scheduled on, until it runs (a loop closed first never runs it).
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def note(
        self,
        rid: str,
        method: str,
        path: str,
        status: int,
        family: str,
        seconds: float,
        when: float,
    ) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread
            loop = None
        with self._lock:
            self._lines.append((rid, method, path, status, family, seconds, when))
            waiting = len(self._lines)
            pending = self._flush_loop
            schedule = loop is not None and (pending is None or pending.is_closed())
            if schedule:
                self._flush_loop = loop
        if waiting >= LINE_BATCH or loop is None:
            self.flush()
        elif schedule and loop is not None:
            loop.call_later(LINE_DELAY_SECS, self.flush)

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            self._flush_loop = None
        if lines and self._write_directly(lines):
            return
        for rid, method, path, status, family, seconds, when in lines:
            record = self._logger.makeRecord(
                self._logger.name, logging.INFO, "(unknown file)", 0, "%s %s %s",
                (method, path, status), None,
                extra={"route": family, "status": status,
                       "duration_ms": round(seconds * 1000, 2), "request_id": rid},
            )  # fmt: skip
            record.created = when
            record.msecs = (when - int(when)) * 1000
            self._logger.handle(record)

    def _write_directly(self, lines: list[_Line]) -> bool:
        """With logging as the project configures it (the ``ds`` logger's one console
        handler and formatter: durable_project/settings.py), the lines are formatted as that
        handler would and written at once: a record per line, handled one by one, cost 20 us
        a line (docs/benchmarks.md). Anything else configured: False, and they go through
        logging."""
        handler = _sole_console_handler(self._logger)
        if handler is None:
            return False
        formatter = handler.formatter
        assert isinstance(formatter, TextFormatter | JsonFormatter)
        text = "".join(
            formatter.request_line(
                when, self._logger.name, rid, f"{method} {path} {status}",
                {"route": family, "status": status, "duration_ms": round(seconds * 1000, 2)},
            ) + handler.terminator
            for rid, method, path, status, family, seconds, when in lines
        )  # fmt: skip
        try:
            with handler.lock or contextlib.nullcontext():
                handler.stream.write(text)
                handler.flush()
        except Exception:  # noqa: BLE001 - then each line through logging, which reports it
            return False
        return True


def _sole_console_handler(logger: logging.Logger) -> logging.StreamHandler[Any] | None:
    """The handler every INFO record of ``logger`` goes to, if it is the only one and a plain
    console handler with one of the project's formatters and no filter but the request id's
    (which request lines need not: they carry their id)."""
    if logger.handlers or logger.filters or not logger.propagate:
        return None
    parent = logger.parent
    if parent is None or parent.filters or parent.propagate or len(parent.handlers) != 1:
        return None
    handler = parent.handlers[0]
    if type(handler) is not logging.StreamHandler or handler.level > logging.INFO:
        return None
    if type(handler.formatter) not in (TextFormatter, JsonFormatter):
        return None
    if any(type(f) is not RequestIdFilter for f in handler.filters):
        return None
    return handler


request_lines = RequestLines(request_log)
# Before logging's own exit handler (registered earlier, so run later) closes the handlers.
atexit.register(request_lines.flush)


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return value.decode()
    # Unique without a system call per request: this process's random prefix and a counter.
    return f"{_PREFIX}{next(_numbers) & 0xFFFFFFFF:08x}"


_PREFIX = os.urandom(4).hex()
_numbers = itertools.count()


# Route families of the URLs Django serves (labels must stay few: never a path).
_DJANGO_ROUTES = (
    ("/v1/state/", "state"),
    ("/v1/streams", "catalog"),
    ("/v1/auth/", "auth"),
    ("/v1/schema", "docs"),
    ("/v1/docs", "docs"),
    ("/admin/", "admin"),
    ("/static/", "static"),
)


def django_route(path: str) -> str:
    for prefix, family in _DJANGO_ROUTES:
        if path.startswith(prefix):
            return family
    return "other"
