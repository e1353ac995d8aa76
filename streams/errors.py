"""The one exception hierarchy of the base protocol (DESIGN.md, Errors).

Each error carries its HTTP status, a short code, a message for humans and any headers the
protocol requires on that answer (``Stream-Closed``, ``Producer-Expected-Seq``...). The HTTP
layer maps them to a response in exactly one place (``streams.http.responses.error_response``).
"""

from __future__ import annotations


class ProtocolError(Exception):
    status = 500
    code = "INTERNAL_ERROR"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(ProtocolError):
    status = 400
    code = "BAD_REQUEST"


class NotFound(ProtocolError):
    status = 404
    code = "NOT_FOUND"


class MethodNotAllowed(ProtocolError):
    status = 405
    code = "METHOD_NOT_ALLOWED"


class Forbidden(ProtocolError):
    status = 403
    code = "FORBIDDEN"


class Conflict(ProtocolError):
    status = 409
    code = "CONFLICT"


class Gone(ProtocolError):
    status = 410
    code = "GONE"


class OffsetGone(Gone):
    """A read (or fork) from before the stream's earliest retained position (PROTOCOL.md 5.6):
    410 with ``Stream-Start-Offset``, where the stream now starts (docs/gaps.md, Retention)."""

    def __init__(self, start_offset: str, message: str = "") -> None:
        super().__init__(
            message or f"offset is before the earliest retained position {start_offset}",
            headers={"Stream-Start-Offset": start_offset},
        )


class PayloadTooLarge(ProtocolError):
    status = 413
    code = "PAYLOAD_TOO_LARGE"


class Unauthorized(ProtocolError):
    """No credentials, or credentials that are unknown, expired or revoked (401)."""

    status = 401
    code = "UNAUTHORIZED"


class RequestTimeout(ProtocolError):
    """The client did not send its request body in time (408)."""

    status = 408
    code = "REQUEST_TIMEOUT"


class HeadersTooLarge(ProtocolError):
    status = 431
    code = "HEADERS_TOO_LARGE"


class TooManyRequests(ProtocolError):
    """A rate limit was reached (PROTOCOL.md 12.5): nothing was done; retry after a while."""

    status = 429
    code = "RATE_LIMITED"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class ServiceUnavailable(ProtocolError):
    """The server cannot do the work right now (the database is unreachable, shutting down);
    nothing was done, and the client may retry after ``Retry-After`` seconds."""

    status = 503
    code = "UNAVAILABLE"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class StreamClosed(Conflict):
    """An append to a closed stream (PROTOCOL.md 5.2): 409 with ``Stream-Closed: true`` and the
    final offset, so clients can tell it from other conflicts without reading the body."""

    def __init__(self, final_offset: str) -> None:
        super().__init__(
            "stream is closed",
            headers={"Stream-Closed": "true", "Stream-Next-Offset": final_offset},
        )


class ValidationStale(ServiceUnavailable):
    """The stream's extra append validation changed while an append was being validated; the
    server revalidates and retries, and answers 503 only if that keeps happening."""

    def __init__(self) -> None:
        super().__init__("the stream's validation rules changed; retry the request")
