"""The fuzzers' HTTP client, tally and invariants.

Requests go out as raw HTTP/1.1 bytes on a keep-alive socket, so the fuzzers can send what
ordinary clients refuse to (NUL and non-ASCII bytes in header values, duplicate headers,
unnormalised paths, unknown methods) and time every answer. Every answer passes the invariants
every fuzzer shares: no 5xx, an answer within ``REQUEST_TIMEOUT_SECS``. The tally counts every
request the fuzzers make and what came back; ``make test-fuzz`` prints it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, settings

# No request may take longer than this to be answered in full (long-polls wait about 1 s on the
# fuzz server, SSE responses are cut by the client after their first control event).
REQUEST_TIMEOUT_SECS = 10.0
# How long an SSE response is followed before the client hangs up.
SSE_READ_SECS = 3.0


def scale() -> float:
    """FUZZ_SCALE multiplies every fuzzer's example count (``make test-fuzz`` raises it)."""
    try:
        return max(float(os.environ.get("FUZZ_SCALE", "1")), 0.1)
    except ValueError:
        return 1.0


def examples(base: int) -> int:
    return max(1, round(base * scale()))


def fuzz_settings(**overrides: Any) -> settings:
    """Settings of every fuzzer: no example database (runs are independent), no deadline, and
    no shrinking unless FUZZ_SHRINK=1: shrinking replays hundreds of request sequences against
    the server, minutes of work; the failure report already names the request that failed."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("FUZZ_SHRINK") == "1":
        phases.append(Phase.shrink)
    return settings(
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        **overrides,
    )


@dataclass
class Tally:
    """What the fuzzers sent and got, for the report; thread-safe (schemathesis may thread)."""

    fuzz_requests: int = 0
    check_requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    partial_writes: list[str] = field(default_factory=list)
    slowest: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, status: int, elapsed: float, *, check: bool) -> None:
        with self.lock:
            if check:
                self.check_requests += 1
            else:
                self.fuzz_requests += 1
            self.statuses[status] += 1
            self.slowest = max(self.slowest, elapsed)

    def summary(self) -> list[str]:
        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items()))
        five = sum(n for status, n in self.statuses.items() if status >= 500)
        return [
            f"fuzz requests: {self.fuzz_requests}; verification requests (re-reads): "
            f"{self.check_requests}; total: {self.fuzz_requests + self.check_requests}",
            f"statuses: {statuses}",
            f"5xx answers: {five}; 500 answers: {self.statuses.get(500, 0)}; "
            f"partial writes: {len(self.partial_writes)}; slowest answer: {self.slowest:.2f}s",
        ]


TALLY = Tally()


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    elapsed: float

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


Header = tuple[bytes, bytes]


def describe(method: bytes, target: bytes, headers: list[Header], body: bytes | None) -> str:
    """A request as the failure report shows it (the input to reproduce)."""
    shown = body if body is None or len(body) <= 300 else body[:300] + b"...(%d bytes)" % len(body)
    shown_target = target if len(target) <= 200 else target[:200] + b"...(%d bytes)" % len(target)
    return f"{method!r} {shown_target!r} headers={headers!r} body={shown!r}"


class RawHttp:
    """HTTP/1.1 over one keep-alive socket to 127.0.0.1:port, reconnecting when needed."""

    def __init__(self, port: int, tally: Tally = TALLY) -> None:
        self.port = port
        self.tally = tally
        self.sock: socket.socket | None = None

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None

    def _socket(self) -> socket.socket:
        if self.sock is not None:
            # A keep-alive connection the server has closed meanwhile reads as EOF.
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable:
                self.close()
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            self.sock.settimeout(REQUEST_TIMEOUT_SECS)
        return self.sock

    def send(
        self,
        method: bytes | str,
        target: bytes | str,
        headers: list[Header] | None = None,
        body: bytes | None = None,
        *,
        check: bool = False,
        sse: bool = False,
        content_length: bool = True,
    ) -> Reply:
        """Send one request, wait for its whole answer (SSE: until the first control event or
        SSE_READ_SECS), check the shared invariants and tally it. ``check`` marks a
        verification re-read rather than a fuzz request."""
        method_b = method.encode("latin-1") if isinstance(method, str) else method
        target_b = target.encode("latin-1") if isinstance(target, str) else target
        headers = list(headers or [])
        names = {name.lower() for name, _ in headers}
        lines = [method_b + b" " + target_b + b" HTTP/1.1", b"Host: 127.0.0.1:%d" % self.port]
        if b"host" in names:
            lines.pop()
        lines += [name + b": " + value for name, value in headers]
        if body is not None and content_length and b"content-length" not in names:
            lines.append(b"Content-Length: %d" % len(body))
        raw = b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")
        what = describe(method_b, target_b, headers, body)
        started = time.monotonic()
        try:
            reply = self._exchange(raw, method_b, sse=sse)
        except TimeoutError:
            self.close()
            raise AssertionError(f"no answer within {REQUEST_TIMEOUT_SECS}s: {what}") from None
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            # The server closed the connection without an answer: only acceptable for input
            # the HTTP parser itself cannot read (it may just hang up), never for a valid one.
            self.close()
            reply = Reply(0, [], f"connection ended: {exc!r}".encode(), 0.0)
        elapsed = time.monotonic() - started
        reply.elapsed = elapsed
        self.tally.record(reply.status, elapsed, check=check)
        assert elapsed < REQUEST_TIMEOUT_SECS + 1, f"answer took {elapsed:.1f}s: {what}"
        if reply.status >= 500:
            message = f"{reply.status} for {what}: {reply.body[:500]!r}"
            self.tally.server_errors.append(message)
            raise AssertionError(message)
        return reply

    def _exchange(self, raw: bytes, method: bytes, *, sse: bool) -> Reply:
        sock = self._socket()
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock, method=method.decode("latin-1"))
        response.begin()
        headers = response.getheaders()
        if sse and response.status == 200:
            body = _read_sse(response)
            self.close()  # the event stream goes on; this connection cannot be reused
        else:
            body = response.read()
            if response.will_close:
                self.close()
        return Reply(response.status, headers, body, 0.0)


def _read_sse(response: http.client.HTTPResponse) -> bytes:
    """An SSE body up to its first control event (or its end, or SSE_READ_SECS)."""
    data = b""
    deadline = time.monotonic() + SSE_READ_SECS
    while time.monotonic() < deadline:
        try:
            chunk = response.read1(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
        if b"event: control" in data and data.endswith(b"\n\n"):
            break
    return data


def sse_events(body: bytes) -> list[tuple[str, str]]:
    """(event, data) pairs of an SSE body (PROTOCOL.md 5.8)."""
    events = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        kind, data = "message", []
        for line in block.decode("utf-8", "replace").split("\n"):
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(" ") else value)
        if data:
            events.append((kind, "\n".join(data)))
    return events


def json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
