"""Requests shaped to hurt the server below the application: at the HTTP framing, before any
handler runs (the production command's protocol, durable_project/protocol.py, and the host
check of every route). Each is answered with a 4xx, changes nothing, and leaves the worker
serving everyone else."""

from __future__ import annotations

import socket
import time

import httpx

from tests.conftest import ServerProcess


def _exchange(server: ServerProcess, request: bytes, *, timeout: float = 30) -> bytes:
    """Send ``request`` on a connection of its own; everything the server answered before it
    closed the connection (or ``timeout`` passed)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_more_than_one_host_header_is_refused(server: ServerProcess) -> None:
    """RFC 9112 3.2: a request with two Host headers is a 400, whichever comes first; the
    protocol endpoints used to check the last one and build Location from both, so that a
    host nobody checked ended up in the URL the server gave out."""
    path = f"hostile/hosts-{time.time_ns()}"
    for first, second in ((b"evil.example", b"127.0.0.1"), (b"127.0.0.1", b"evil.example")):
        for method, target in ((b"PUT", f"/v1/stream/{path}".encode()),
                               (b"GET", b"/v1/streams"), (b"GET", b"/admin/login/")):  # fmt: skip
            answer = _exchange(
                server,
                method + b" " + target + b" HTTP/1.1\r\nHost: " + first + b"\r\nHost: "
                + second + b"\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n"
                b"Connection: close\r\n\r\n",
            )  # fmt: skip
            assert _status(answer) == 400, (method, target, first, answer[:200])
            assert b"evil.example" not in answer.lower().split(b"\r\n\r\n")[0]
    assert httpx.get(server.stream_url(path)).status_code == 404
