"""Requests shaped to hurt the server below the application: at the HTTP framing, before any
handler runs (the production command's protocol, durable_project/protocol.py, and the host
check of every route). Each is answered with a 4xx, changes nothing, and leaves the worker
serving everyone else."""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psycopg

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


def _send_head(server: ServerProcess, head: bytes, filler: int, piece: int = 256 * 1024) -> bytes:
    """Send ``head`` then ``filler`` bytes of one header's value, piece by piece, as long as the
    server reads them; the answer, whatever it was and whenever it came."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        sent = 0
        try:
            while sent < filler:
                sock.sendall(b"a" * min(piece, filler - sent))
                sent += piece
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection: its answer may still be there to read
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def test_a_huge_request_head_is_refused_as_it_arrives(server: ServerProcess) -> None:
    """A header of 16 MiB, to a route that sets no header limit of its own (/healthz), is
    refused once its first MiB has arrived (431, durable_project.protocol): uvicorn read all
    of it, with work growing with the square of its size (150 MiB stalled the worker until it
    was killed). Heads under the bound pass, and a body sent with its head does not count."""
    huge = _send_head(server, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ", 16 << 20)
    assert huge and _status(huge) == 431, huge[:200]
    large = _send_head(server, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ", 200_000)
    assert _status(large) == 200, large[:200]
    path = f"hostile/body-{time.time_ns()}"
    body = b"b" * 3_000_000
    created = _exchange(
        server,
        f"PUT /v1/stream/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body,
    )
    assert _status(created) == 201, created[:200]
    assert len(httpx.get(server.stream_url(path), params={"offset": "-1"}).content) == len(body)


def test_a_request_head_that_never_ends_is_refused(start_server: Any) -> None:
    """A head sent a byte at a time, never complete, is answered 408 and its connection
    closed once DS_HTTP__HEAD_TIMEOUT_SECS (1 s here) have passed since it began: it used to
    hold the connection for as long as the client went on sending. The worker serves others
    meanwhile."""
    server = start_server(env={"DS_HTTP__HEAD_TIMEOUT_SECS": "1"})
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        deadline = time.monotonic() + 20
        answer = b""
        sock.settimeout(0.3)
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"z")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            answer += chunk
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200
    assert answer and _status(answer) == 408, answer[:200]


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length (it may come in more than one piece)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length.group(1)):
        body += sock.recv(65536)
    return answer


def test_a_connection_that_never_sends_a_byte_is_closed(start_server: Any) -> None:
    """A connection whose first request does not begin within DS_HTTP__HEAD_TIMEOUT_SECS (2 s
    here) is closed, and so is one whose next request does not: before, uvicorn set no timer
    until a first byte came, and 400 connections that sent nothing were all still open 70 s
    later (found by a soak probe), each holding a descriptor. A connection that sends its
    request in time is served as usual."""
    server = start_server(env={"DS_HTTP__HEAD_TIMEOUT_SECS": "2"})
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(5)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as prompt:
            prompt.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _status(_read_answer(prompt)) == 200
            # An empty line stopped uvicorn's keep-alive timer and began no request (found
            # by review): the next request must begin in time all the same.
            prompt.sendall(b"\r\n")
            silent.append(prompt.dup())
        for sock in silent:
            assert sock.recv(1) == b""  # closed by the server, without an answer
    finally:
        for sock in silent:
            sock.close()


def test_readiness_probes_share_one_database_connection(
    server: ServerProcess, pg: psycopg.Connection[Any]
) -> None:
    """``/readyz`` needs no credentials, and each probe opened a database connection of its
    own: 300 probes at once opened about 300 (PostgreSQL's connection slots are what every
    other client needs). Probes at the same time share one, and a verdict is reused for a
    second."""

    def sessions() -> int:
        pg.execute("SELECT pg_stat_clear_snapshot()")
        row = pg.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        return int(row[0])

    before = sessions()
    limits = httpx.Limits(max_connections=60)
    with httpx.Client(timeout=30, limits=limits) as http, ThreadPoolExecutor(60) as pool:
        statuses = list(
            pool.map(lambda _: http.get(f"{server.base_url}/readyz").status_code, range(300))
        )
    assert statuses == [200] * 300
    time.sleep(1.5)  # sessions are counted when they end
    opened = sessions() - before
    assert opened <= 15, opened


def test_probes_and_metrics_answer_only_reads(server: ServerProcess) -> None:
    """``/healthz``, ``/readyz`` and ``/metrics`` answered 200 to DELETE and POST (probe 7d):
    they are 405 with ``Allow``, and GET and HEAD answer as before."""
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        for url in ("/healthz", "/readyz", "/metrics"):
            for method in ("DELETE", "POST", "PUT"):
                refused = http.request(method, url)
                assert refused.status_code == 405, (method, url)
                assert refused.headers["Allow"] == "GET, HEAD, OPTIONS"
            assert http.get(url).status_code == 200 and http.head(url).status_code == 200


def test_large_bodies_arriving_slowly_are_bounded_per_process(start_server: Any) -> None:
    """A client sending large bodies slowly (a byte within each body timeout) held every one
    of them: 24 bodies of 64 MiB took a worker up by 1 GiB (probe 7c), and nothing bounded
    the count. Past DS_HTTP__ARRIVING_BODIES_BYTES (8 MiB here), bodies over 1 MiB are refused
    (503, Retry-After) and small ones still go through; when the held ones go, large bodies
    are taken again."""
    server = start_server(env={"DS_HTTP__ARRIVING_BODIES_BYTES": str(8 << 20)})
    path = f"hostile/arriving-{time.time_ns()}"
    url = f"/v1/stream/{path}"
    assert httpx.put(server.base_url + url, headers={"Content-Type": "text/plain"}).is_success
    head = (
        f"POST {url} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {4 << 20}\r\n\r\n"
    ).encode()
    held = []
    try:
        for _ in range(2):  # 2 x 3 MiB of 4 MiB bodies arrive and stay
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(head + b"h" * (3 << 20))
            held.append(sock)
        time.sleep(0.5)
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            text = {"Content-Type": "text/plain"}
            large = b"L" * (3 << 20)
            refused = http.post(url, headers=text, content=large)
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"]
            assert http.post(url, headers=text, content=b"small").status_code == 204
            for sock in held:
                sock.close()
            held.clear()
            deadline = time.monotonic() + 10
            while (taken := http.post(url, headers=text, content=large)).status_code == 503:
                assert time.monotonic() < deadline, "the held bodies were never let go"
                time.sleep(0.2)
            assert taken.status_code == 204
            stored = http.get(url, params={"offset": "-1"}).content
            assert stored == b"small" + large
            gauge = re.search(r"^ds_arriving_body_bytes(?:\{[^}]*\})? (\S+)$",
                              http.get("/metrics").text, re.MULTILINE)  # fmt: skip
            assert gauge is not None and float(gauge.group(1)) == 0
    finally:
        for sock in held:
            sock.close()


def _text_streams(server: ServerProcess, *names: str) -> list[str]:
    """New text streams, one per name: their paths."""
    stamp = time.time_ns()
    paths = [f"hostile/{name}-{stamp}" for name in names]
    for path in paths:
        assert httpx.put(server.stream_url(path), headers={"Content-Type": "text/plain"}).is_success
    return paths


def _read_until_closed(sock: socket.socket, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_request_asking_to_switch_protocols_smuggles_nothing(server: ServerProcess) -> None:
    """``Connection: Upgrade`` with ``Upgrade: h2c`` on a POST: the parser read nothing after
    its head as HTTP, and its body, arriving a moment later, was run as the next request
    (probe 8b: a body that was a whole POST to another stream was appended there, and got an
    answer of its own). A proxy that forwards Upgrade sees one request. Now a body with an
    Upgrade is refused, once, and the connection closed; a bodyless Upgrade (curl's h2c) is
    answered as any GET, and a WebSocket handshake is no longer a 500."""
    front, victim = _text_streams(server, "front", "victim")
    hidden = (
        f"POST /v1/stream/{victim} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        "Content-Length: 8\r\n\r\nSMUGGLED"
    ).encode()
    head = (
        f"POST /v1/stream/{front} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Connection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: {len(hidden)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.3)
        with contextlib.suppress(OSError):
            sock.sendall(hidden)
        answer = _read_until_closed(sock)
    assert answer.count(b"HTTP/1.1 ") == 1 and _status(answer) == 400, answer[:300]
    for path in (front, victim):
        assert httpx.get(server.stream_url(path), params={"offset": "-1"}).content == b""
    plain = (
        f"GET /v1/stream/{front}?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        "HTTP2-Settings: AAMAAABkAAQAoAAA\r\n\r\n"
    ).encode()
    handshake = (
        f"GET /v1/stream/{front}?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
        "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    ).encode()
    for request in (plain, handshake):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(request + hidden)  # a request pipelined after it is not read
            answer = _read_until_closed(sock)
        assert answer.count(b"HTTP/1.1 ") == 1 and _status(answer) == 200, answer[:300]
    assert httpx.get(server.stream_url(victim), params={"offset": "-1"}).content == b""
    assert "No application configured" not in server.log_path.read_text(errors="replace")


def test_a_client_that_half_closes_is_answered(server: ServerProcess) -> None:
    """A client that sends its requests and then shuts down its side of the connection: the
    transport closed on its FIN, so appends were committed and never answered (a client
    retrying one writes it twice), and pipelined ones were dropped (probe 8b). Every request
    it sent whole is answered, then the connection closes."""
    path = f"hostile/half-{time.time_ns()}"
    assert httpx.put(server.stream_url(path), headers={"Content-Type": "text/plain"}).is_success
    requests = b"".join(
        f"POST /v1/stream/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: 2\r\n\r\n{n},".encode()
        for n in range(3)
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(requests)
        sock.shutdown(socket.SHUT_WR)
        answer = _read_until_closed(sock)
    assert answer.count(b"HTTP/1.1 204") == 3, answer[:500]
    assert httpx.get(server.stream_url(path), params={"offset": "-1"}).content == b"0,1,2,"


def test_a_request_cut_by_a_half_close_leaves_those_before_it_answered(
    server: ServerProcess,
) -> None:
    """Probe 10k: an append, then a request pipelined behind it cut short (its body, or its
    head, incomplete), then the client's FIN: the connection closed at once, the append was
    committed and never answered, and a client retrying it stored it twice. The append is
    answered, the incomplete request dropped, then the connection closes."""
    for n, tail in enumerate((b"Content-Length: 100\r\n\r\nonly ten b", b"Content-Le")):
        path = f"hostile/half-cut-{n}-{time.time_ns()}"
        assert httpx.put(server.stream_url(path), headers={"Content-Type": "text/plain"}).is_success
        head = f"POST /v1/stream/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(f"{head}Content-Length: 1\r\n\r\nA".encode() + head.encode() + tail)
            sock.shutdown(socket.SHUT_WR)
            answer = _read_until_closed(sock)
        assert answer.count(b"HTTP/1.1 ") == 1 and _status(answer) == 204, (n, answer[:300])
        assert httpx.get(server.stream_url(path), params={"offset": "-1"}).content == b"A"


def test_framing_the_parser_lets_through_is_refused(server: ServerProcess) -> None:
    """httptools' parser took a transfer coding other than chunked (``gzip, chunked``: the
    compressed bytes were stored as sent), an ``HTTP/2.0`` request line, a target in absolute
    form naming another host than the Host header (the Host header was checked and used:
    RFC 9112 3.2.2 says the target's host counts), and a Host port that is none (put in
    Location). Each is refused (501, 505, 400, 400) and nothing is written; an absolute-form
    target naming the Host header's host is served."""
    path = f"hostile/framing-{time.time_ns()}"
    assert httpx.put(server.stream_url(path), headers={"Content-Type": "text/plain"}).is_success
    head = "Host: 127.0.0.1\r\nContent-Type: text/plain\r\n"
    for request, status in (
        (f"POST /v1/stream/{path} HTTP/1.1\r\n{head}Transfer-Encoding: gzip, chunked\r\n\r\n"
         "1\r\nx\r\n0\r\n\r\n", 501),
        (f"POST /v1/stream/{path} HTTP/2.0\r\n{head}Content-Length: 1\r\n\r\nx", 505),
        (f"POST http://evil.example/v1/stream/{path} HTTP/1.1\r\n{head}Content-Length: 1\r\n\r\n"
         "x", 400),
        (f"POST /v1/stream/{path} HTTP/1.1\r\nHost: 127.0.0.1:99999999999\r\n"
         "Content-Type: text/plain\r\nContent-Length: 1\r\n\r\nx", 400),
    ):  # fmt: skip
        answer = _exchange(server, request.encode(), timeout=10)
        assert _status(answer) == status, (request[:60], answer[:200])
    assert httpx.get(server.stream_url(path), params={"offset": "-1"}).content == b""
    served = _exchange(
        server,
        f"POST http://127.0.0.1/v1/stream/{path} HTTP/1.1\r\n{head}Content-Length: 2\r\n"
        "Connection: close\r\n\r\nok".encode(),
    )
    assert _status(served) == 204, served[:200]
    assert httpx.get(server.stream_url(path), params={"offset": "-1"}).content == b"ok"


def test_requests_around_a_refused_one_are_answered_or_not_run(server: ServerProcess) -> None:
    """A refusal at the head (here an absolute-form target naming another host) wrote its
    answer and closed the connection from inside the parser, which went on with the rest of
    the read: a DELETE pipelined after it ran though the client was told the connection
    closed, and an append pipelined before it was committed and never answered (found by
    review). The answers before it go out first, the refusal last, and nothing after it runs."""
    before, victim = _text_streams(server, "before", "after")
    requests = (
        f"POST /v1/stream/{before} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        "Content-Length: 1\r\n\r\nX"
        f"GET http://evil.example/v1/stream/{before} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        f"DELETE /v1/stream/{victim} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(requests)
        answer = _read_until_closed(sock)
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3})", answer)]
    assert statuses == [204, 400], answer[:600]
    assert httpx.get(server.stream_url(before), params={"offset": "-1"}).content == b"X"
    assert httpx.head(server.stream_url(victim)).status_code == 200  # not deleted


def test_a_live_read_whose_client_closes_ends_at_once(start_server: Any) -> None:
    """A FIN is also how a client that has gone away closes its connection: after half-closed
    clients were kept for their answers, long-polls whose clients left went on waiting until
    their timeout (found by review). A read's answer is not kept for: the long-polls end
    (ds_live_readers back where it was) long before their 30 s timeout."""
    server = start_server(env={"DS_SERVER__LONG_POLL_TIMEOUT_SECS": "30"})
    path = f"hostile/gone-{time.time_ns()}"
    created = httpx.put(server.stream_url(path), headers={"Content-Type": "text/plain"})
    tail = created.headers["Stream-Next-Offset"]

    def long_polls() -> float:
        metrics = httpx.get(f"{server.base_url}/metrics").text
        found = re.search(r'^ds_live_readers\{mode="long-poll"\} (\S+)$', metrics, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    idle = long_polls()
    socks = []
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(
            f"GET /v1/stream/{path}?offset={tail}&live=long-poll HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\n\r\n".encode()
        )
        socks.append(sock)
    deadline = time.monotonic() + 10
    while long_polls() < idle + 5:
        assert time.monotonic() < deadline, "the long-polls never began"
        time.sleep(0.05)
    for sock in socks:
        sock.close()
    deadline = time.monotonic() + 15
    while long_polls() > idle:
        assert time.monotonic() < deadline, "long-polls of clients that left went on waiting"
        time.sleep(0.05)


def test_requests_pipelined_past_a_bound_are_refused(server: ServerProcess) -> None:
    """Probe 10b: uvicorn queued every pipelined request of a read, without bound (20
    connections of 25,000 requests, reading nothing: both workers from 119 to 828 MiB, and
    another client's request held 15 s). Past 256 waiting, the connection is answered 429
    after the answers before it, and closed."""
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    answer = _exchange(server, request * 2000, timeout=10)
    assert 256 <= answer.count(b"HTTP/1.1 200") <= 258, answer.count(b"HTTP/1.1 200")
    assert answer.count(b"HTTP/1.1 429") == 1 and answer.rstrip().endswith(b"answers")


def test_a_connection_reset_while_its_answer_waits_leaves_no_traceback(
    start_server: Any,
) -> None:
    """Probe 10b: an answer waiting for its client to take the buffer, when the client reset
    the connection, was written to the closed transport anyway (uvicorn looks at the
    connection before it waits, not after): "Exception in ASGI application" in the log."""
    server = start_server()
    (path,) = _text_streams(server, "reset")
    with httpx.Client(timeout=30) as client:
        answer = client.post(
            server.stream_url(path),
            headers={"Content-Type": "text/plain"},
            content=b"x" * (4 << 20),
        )
        assert answer.status_code == 204
    for _ in range(3):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        # A large answer and one pipelined behind it: the connection's latest request was
        # the one marked gone, not the one sending.
        big = f"GET /v1/stream/{path}?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        sock.sendall(f"{big}GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        time.sleep(1)  # the answer fills the buffers and waits for them to drain
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    assert httpx.get(f"{server.base_url}/healthz").status_code == 200
    time.sleep(1)
    assert "Traceback" not in server.log_path.read_text(errors="replace")
