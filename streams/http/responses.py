"""Responses of the lean endpoints: headers every answer carries, and the one place where
protocol errors become HTTP answers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from django.conf import settings

from streams.errors import ProtocolError
from streams.http.request import Send

# Headers a browser client must be able to read (CORS). Lower-case to match what fetch sees.
EXPOSED_HEADERS = ", ".join(
    [
        "Stream-Next-Offset",
        "Stream-Cursor",
        "Stream-Up-To-Date",
        "Stream-Closed",
        "Stream-TTL",
        "Stream-Expires-At",
        "Stream-Start-Offset",
        "Stream-Retention-Max-Age",
        "Stream-Retention-Max-Bytes",
        "Stream-Sse-Data-Encoding",
        "Producer-Epoch",
        "Producer-Seq",
        "Producer-Expected-Seq",
        "Producer-Received-Seq",
        "ETag",
        "Location",
        "Content-Type",
        "Content-Length",
    ]
)
ALLOWED_METHODS = "GET, HEAD, POST, PUT, DELETE, OPTIONS"
ALLOWED_REQUEST_HEADERS = ", ".join(
    [
        "Content-Type",
        "Authorization",
        "If-None-Match",
        "Stream-TTL",
        "Stream-Expires-At",
        "Stream-Seq",
        "Stream-Closed",
        "Stream-Forked-From",
        "Stream-Fork-Offset",
        "Stream-Fork-Sub-Offset",
        "Stream-Retention-Max-Age",
        "Stream-Retention-Max-Bytes",
        "Stream-Trim-Before",
        "Producer-Id",
        "Producer-Epoch",
        "Producer-Seq",
    ]
)

# Browser security headers (PROTOCOL.md 12.7), on every answer including errors. A stream's
# data is a client's, served on the server's own origin with the content type its writer
# chose: opened in a browser (a signed read URL is a plain link), an HTML or SVG stream would
# run its scripts with the session of whoever opened it. The sandbox gives such a document an
# origin of its own and no scripts; fetch, EventSource and the clients ignore it.
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-resource-policy", b"cross-origin"),
    (b"content-security-policy", b"sandbox; default-src 'none'"),
]


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    # One body, or its pieces in order (a large read: streams.http.render.body_parts).
    body: bytes | list[bytes | memoryview] = b""

    @property
    def length(self) -> int:
        return len(self.body) if isinstance(self.body, bytes) else sum(map(len, self.body))


def cors_headers(origin: str | None) -> list[tuple[bytes, bytes]]:
    allowed = settings.DS_CORS_ORIGINS
    if "*" in allowed:
        value = "*"
    elif origin is not None and origin in allowed:
        value = origin
    else:
        return [(b"vary", b"Origin")]
    headers = [
        (b"access-control-allow-origin", value.encode("latin-1")),
        (b"access-control-expose-headers", EXPOSED_HEADERS.encode()),
    ]
    if value != "*":
        headers.append((b"vary", b"Origin"))
    return headers


def preflight(requested_headers: str | None) -> Response:
    """Answer to a CORS preflight (OPTIONS)."""
    headers = {
        "Access-Control-Allow-Methods": ALLOWED_METHODS,
        "Access-Control-Allow-Headers": requested_headers or ALLOWED_REQUEST_HEADERS,
        "Access-Control-Max-Age": "86400",
        "Allow": ALLOWED_METHODS,
    }
    return Response(204, headers)


def error_response(error: ProtocolError) -> Response:
    """The single place where protocol errors are mapped to HTTP answers: the status and
    headers the error carries, a short plain-text body, and nothing cacheable."""
    headers = {"Content-Type": "text/plain; charset=utf-8", "Cache-Control": "no-store"}
    headers.update(error.headers)
    return Response(error.status, headers, error.message.encode("utf-8") + b"\n")


def encode_headers(
    response_headers: dict[str, str], origin: str | None, body_length: int | None
) -> list[tuple[bytes, bytes]]:
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in response_headers.items()
    ]
    if body_length is not None:
        headers.append((b"content-length", str(body_length).encode()))
    headers.extend(SECURITY_HEADERS)
    headers.extend(cors_headers(origin))
    return headers


async def send_response(
    send: Send, response: Response, origin: str | None, *, head: bool = False
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": encode_headers(
                response.headers,
                origin,
                None if head or response.status in (204, 304) else response.length,
            ),
        }
    )
    body = b"" if head or response.status in (204, 304) else response.body
    if isinstance(body, bytes) and len(body) <= BLOCK_BYTES:
        await send({"type": "http.response.body", "body": body})
        return
    # In blocks, also a body made in one piece (a JSON catch-up's aggregate): the write
    # deadline (durable_project.protocol) asks a client to take what is buffered for it in
    # time, and that is one block, not what is left of the whole answer.
    blocks = iter(in_blocks(body)) if isinstance(body, bytes) else _blocks(body)
    block = next(blocks)
    for following in blocks:
        await send({"type": "http.response.body", "body": block, "more_body": True})
        block = following
    await send({"type": "http.response.body", "body": block, "more_body": False})


# A large answer goes out in blocks of this many bytes (its pieces joined, or cut).
BLOCK_BYTES = 1024 * 1024


def in_blocks(body: bytes) -> Iterable[bytes]:
    """``body`` as it goes out: in blocks of ``BLOCK_BYTES`` when it is larger (copies of its
    parts), else whole (no generator: this runs for every SSE event)."""
    return (body,) if len(body) <= BLOCK_BYTES else _blocks([body])


def _blocks(pieces: list[bytes | memoryview] | list[bytes]) -> Iterator[bytes]:
    """``pieces`` joined into blocks of ``BLOCK_BYTES`` (the last one shorter; at least one
    block), each made as the one before it is sent (the caller holds one ahead): a read's copy
    for sending is a block or two, not all of it, and a piece larger than a block is cut. Each
    body message costs the ASGI server a pass through its send path and the kernel a write:
    sent one by one, the 64 pieces of a 4 MiB read of 64 KiB messages took 17% longer than a
    join of them costs (docs/benchmarks.md)."""
    group: list[memoryview] = []
    size = 0
    made = False
    for piece in pieces:
        view = memoryview(piece)
        while len(view) and len(view) >= BLOCK_BYTES - size:
            room = BLOCK_BYTES - size
            group.append(view[:room])
            view = view[room:]
            yield b"".join(group)
            made = True
            group, size = [], 0
        if len(view):
            group.append(view)
            size += len(view)
    if group or not made:
        yield b"".join(group)
