"""A minimal request object over an ASGI HTTP scope, for the lean protocol endpoints.

Django's request machinery is deliberately not used on the hot path (DESIGN.md, Request path).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote_to_bytes

from django.conf import settings
from django.http.request import split_domain_port, validate_host

from access.grants import ANONYMOUS, Principal
from streams import metrics
from streams.errors import (
    BadRequest,
    HeadersTooLarge,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
)
from streams.protocol.headers import ascii_digits

if TYPE_CHECKING:
    from access.auth import Standing

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Scope = dict[str, Any]

MAX_PATH_BYTES = 1024
# A request body must bring this much (or end) within each DS_BODY_READ_TIMEOUT_SECS, as an
# answer's client must take as much (durable_project.protocol.SEND_PROGRESS_BYTES).
BODY_PROGRESS_BYTES = 64 * 1024
# All request headers together; HTTP servers commonly allow 8-64 KiB.
MAX_HEADER_BYTES = 64 * 1024
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class ClientDisconnected(Exception):
    """The client went away while we were reading its request."""


@dataclass(slots=True)
class Request:
    method: str
    # The stream path: the percent-decoded part of the URL path after the route prefix.
    path: str
    # The URL path as sent (still percent-encoded), for Location headers.
    raw_path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    scope: Scope
    receive: Receive
    # Who sends it (access control); the endpoint authenticates before handling.
    principal: Principal = ANONYMOUS
    # What access control calls the target when it is not the stream at ``path`` (a Yjs
    # document: ``access.grants``).
    resource: str | None = None
    # Its credentials, to be judged again while it goes on answering (a live read: set by the
    # endpoints for GET); None: judged once, at the start.
    standing: Standing | None = None

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def client(self) -> str | None:
        """Whom limits per client count this request against: its credentials' holder, or
        without any (open mode) the address it comes from (behind a proxy, as the proxy
        tells it: uvicorn's ``--forwarded-allow-ips``). None for a Yjs service's secret: the
        operator's own backend, or every client of the service at once."""
        if self.principal.kind == "service":
            return None
        if self.principal.holder is not None:
            return self.principal.holder
        peer = self.scope.get("client")
        return f"address:{peer[0]}" if peer else "address:unknown"

    def query_value(self, name: str) -> str | None:
        values = self.query.get(name)
        if not values:
            return None
        if len(values) > 1:
            raise BadRequest(f"query parameter {name!r} given more than once")
        return values[0]

    async def body(self, limit: int) -> bytes:
        """The whole request body; 413 as soon as it passes ``limit`` bytes."""
        return await read_body(self.receive, self.header("content-length"), limit)


# Bytes of request bodies this process holds while they arrive (read_body), and the size up to
# which a body is read whatever that total: small appends go on when large bodies fill it.
_arriving = 0
SMALL_BODY_BYTES = 1024 * 1024


async def read_body(receive: Receive, content_length: str | None, limit: int) -> bytes:
    """A request body of at most ``limit`` bytes (413 as soon as it is known to be larger),
    arriving at ``BODY_PROGRESS_BYTES`` (or its end) per ``DS_BODY_READ_TIMEOUT_SECS`` at
    least (408 otherwise: a client that sent a byte within each timeout held its connection,
    and so a descriptor, for as long as it liked; 40,000 of them took every descriptor of both
    processes: probe 9a). A body past ``SMALL_BODY_BYTES`` is refused (503, retry) while the
    bodies arriving in this process hold ``DS_ARRIVING_BODIES_BYTES``: a client holding large
    bodies open held them all (probe 7c: 24 bodies of 64 MiB, 1 GiB more per worker)."""
    declared = int(content_length) if content_length and ascii_digits(content_length) else None
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    if declared is not None and declared > SMALL_BODY_BYTES:
        _check_room(declared)
    chunks: list[bytes] = []
    size = 0
    timeout = settings.DS_BODY_READ_TIMEOUT_SECS
    loop = asyncio.get_running_loop()
    deadline, progress = loop.time() + timeout, 0
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body arrived slower than {BODY_PROGRESS_BYTES} bytes per "
                    f"{timeout:g}s"
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            if chunk:
                if size + len(chunk) > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
                if size + len(chunk) > SMALL_BODY_BYTES:
                    _check_room(len(chunk))
                _count_arriving(len(chunk))
                size += len(chunk)
                chunks.append(chunk)
                progress += len(chunk)
                if progress >= BODY_PROGRESS_BYTES:
                    deadline, progress = loop.time() + timeout, 0
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        _count_arriving(-size)


def _check_room(more: int) -> None:
    if _arriving + more > settings.DS_ARRIVING_BODIES_BYTES:
        raise ServiceUnavailable("the server is receiving too many large request bodies")


def _count_arriving(change: int) -> None:
    global _arriving
    _arriving += change
    metrics.ARRIVING_BODY_BYTES.set(_arriving)


_host_verdicts: dict[bytes | None, bool] = {}


def check_host(headers: list[tuple[bytes, bytes]]) -> None:
    """The Host header must name this server (``ALLOWED_HOSTS``, as Django checks it for the
    pages it serves): URLs the server builds (Location) come from it. More than one is
    refused (RFC 9112 3.2): combined, they would put a host nobody checked in a URL."""
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) > 1:
        raise BadRequest("more than one Host header")
    host = hosts[0] if hosts else None
    verdict = _host_verdicts.get(host)
    if verdict is None:
        text = host.decode("latin-1") if host else ""
        domain, port = split_domain_port(text)
        # A port that is none (Host: 127.0.0.1:99999999999 was taken, and put in Location).
        valid_port = not port or (port.isdigit() and 0 < int(port) <= 65535)
        verdict = bool(domain) and valid_port and validate_host(domain, settings.ALLOWED_HOSTS)
        if len(_host_verdicts) < 1024:
            _host_verdicts[host] = verdict
    if not verdict:
        raise BadRequest("the Host header names a host this server does not serve")


def _decode_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    if sum(len(name) + len(value) for name, value in raw) > MAX_HEADER_BYTES:
        raise HeadersTooLarge(f"request headers exceed {MAX_HEADER_BYTES} bytes")
    for name, value in raw:
        key = name.decode("latin-1").lower()
        # Without the whitespace around it, which is HTTP's (space and tab: RFC 9110 5.5), and
        # only that: str.strip() also took NEL and no-break space away (probe 9b).
        text = value.decode("latin-1").strip(" \t")
        if key not in headers:
            headers[key] = text
        elif _single_valued(key):
            raise BadRequest(f"header {key} given more than once")
        else:
            # Repeated headers combine as a comma-separated list (RFC 9110 5.3).
            headers[key] = f"{headers[key]}, {text}"
    return headers


def _single_valued(key: str) -> bool:
    """Headers with one value: the protocol's own, a body's type and credentials. Combined
    as lists, two ``Stream-Closed: true`` were no close, and ``Stream-Seq: 5`` with
    ``Stream-Seq: 1`` the sequence ``5, 1`` (probe 9b)."""
    return key.startswith(("stream-", "producer-")) or key in ("content-type", "authorization")


def stream_path(encoded: str) -> str:
    """Decode and validate the stream path part of a URL (PROTOCOL.md 12.2: no traversal).

    Rejects empty paths and segments, ``.`` and ``..`` segments (also when percent-encoded),
    control characters, invalid UTF-8, and the reserved ``__ds`` prefix (PROTOCOL.md 6).
    """
    try:
        path = unquote_to_bytes(encoded).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("stream path is not valid UTF-8") from None
    return check_stream_path(path)


def check_stream_path(path: str) -> str:
    """The rules of ``stream_path`` for a path already decoded (a stream named in a JSON
    body: subscriptions)."""
    if not path:
        raise BadRequest("stream path is empty")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise BadRequest(f"stream path is longer than {MAX_PATH_BYTES} bytes")
    if _CONTROL_CHARS.search(path):
        raise BadRequest("stream path contains control characters")
    segments = path.split("/")
    if any(segment in ("", ".", "..") for segment in segments):
        raise BadRequest("stream path has an empty, '.' or '..' segment")
    if segments[0] == "__ds":
        raise BadRequest("paths under '__ds' are reserved for protocol control APIs")
    return path


def build_request(scope: Scope, receive: Receive, prefix: str) -> Request:
    """The request to a stream URL ``<prefix><stream path>``."""
    encoded = _encoded_path(scope)
    if not encoded.startswith(prefix):
        raise BadRequest("not a stream URL")
    return request_for(scope, receive, stream_path(encoded[len(prefix) :]), raw_path=encoded)


def request_for(
    scope: Scope, receive: Receive, path: str, *, raw_path: str | None = None
) -> Request:
    """A request addressed to the stream at ``path`` (already validated), keeping the URL,
    query and headers it came with; endpoints built on streams (Yjs) map their URLs this way."""
    query_string = scope.get("query_string", b"").decode("latin-1")
    try:
        query = parse_qs(query_string, keep_blank_values=True, strict_parsing=False)
    except ValueError:
        raise BadRequest("malformed query string") from None
    return Request(
        method=scope["method"].upper(),
        path=path,
        raw_path=_encoded_path(scope) if raw_path is None else raw_path,
        query=query,
        headers=_decode_headers(scope.get("headers", [])),
        scope=scope,
        receive=receive,
    )


def _encoded_path(scope: Scope) -> str:
    """The URL path as sent, still percent-encoded."""
    raw = scope.get("raw_path")
    encoded = raw.decode("latin-1") if raw else scope["path"]
    return encoded.split("?", 1)[0]
