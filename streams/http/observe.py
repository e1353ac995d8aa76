"""Every request, observed the same way whichever application answers it (``durable_project.asgi``
wraps each route): a request id, a count by route family, method and status, a duration, and one
log line.

The request id comes from ``X-Request-Id`` (when it is a short token) or is generated; it is
returned in the response and carried by the log lines of the work the request causes
(``durable_project.logs``). The log line names the method, route, path (never the query, which
may carry a signed URL's signature), status and duration: never a body or a credential.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings

from durable_project.logs import request_id
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
        status = 0
        started = time.perf_counter()

        async def send_observed(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = message | {"headers": [*message.get("headers", ()), rid_header]}
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
            if settings.DS_LOG_REQUESTS:
                request_log.info(
                    "%s %s %s",
                    scope["method"],
                    scope["path"],
                    status or 499,
                    extra={"route": family, "status": status or 499,
                           "duration_ms": round(seconds * 1000, 2)},
                )  # fmt: skip
            request_id.reset(token)

    return application


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
