"""Clients that stop reading their response (PROTOCOL.md 5.6, 5.8, 10.2).

An ASGI server's ``send`` waits for the client to take what was sent before. A client that
never reads kept that ``send`` waiting for as long as it kept its connection, and with it the
read being answered: an SSE catch-up over a large binary stream held 42 MB per connection
(its first read of 8 MiB, base64-encoded, in copies), past the SSE reconnect interval, and
after the response ended in error the connection stayed open with its buffer (uvicorn closes
it, and a close waits for the buffer to drain). Now a connection whose client leaves its
buffer full for ``DS_SERVER__SEND_TIMEOUT_SECS`` is aborted, on every route
(durable_project.protocol), an SSE session's also at the end of its interval
(streams.http.sending), and an SSE event carries at most about 1 MiB of data
(streams.http.live_reads.EVENT_READ_BYTES).

Real server, real sockets: the stalled clients ask for a tiny receive buffer and never read.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import ServerProcess
from tests.http.test_observability import scrape, value
from tests.retention.support import sse_events, url

TEXT = {"Content-Type": "text/plain"}

SEND_TIMEOUT_SECS = 2.0
# What "eventually" allows beyond a deadline: a loaded machine, never a measure of speed.
MARGIN_SECS = 25.0
MESSAGE_BYTES = 1024 * 1024
MESSAGES = 16  # 16 MiB: far more than the kernel's buffers of a connection hold
STALLED = 8
BINARY = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}
# The data an SSE event carries at most (streams.http.live_reads.EVENT_READ_BYTES).
EVENT_READ_BYTES = 1024 * 1024
# How fast the slow but steady reader reads (bytes per second).
READ_RATE = 0.6 * 2**20


PATIENT = {
    "DS_SERVER__SEND_TIMEOUT_SECS": str(SEND_TIMEOUT_SECS),
    "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS": "600",
}


@pytest.fixture(scope="module")
def server(start_server: object) -> Iterator[ServerProcess]:
    process = start_server(env=PATIENT)  # type: ignore[operator]
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        yield http


def _message(n: int) -> bytes:
    return bytes([n]) * MESSAGE_BYTES


@pytest.fixture(scope="module")
def big(client: httpx.Client) -> str:
    """A binary stream of 16 x 1 MiB (read over SSE as base64)."""
    assert client.put(url("slow/big"), headers=BINARY).status_code == 201
    for n in range(MESSAGES):
        assert client.post(url("slow/big"), content=_message(n), headers=BINARY).is_success
    return "slow/big"


def _stalled(server: ServerProcess, path: str, query: str) -> socket.socket:
    """A connection that asks for stream ``path`` and never reads the answer."""
    return _stalled_at(server, f"{url(path)}?{query}")


def _stalled_at(server: ServerProcess, target: str) -> socket.socket:
    """A connection that asks for ``target`` and never reads the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    request = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    sock.sendall(request.encode())
    return sock


def _held_by_server(server: ServerProcess, socks: list[socket.socket]) -> set[int]:
    """The client ports of ``socks`` the server process still holds a connection to."""
    ports = {sock.getsockname()[1] for sock in socks}
    held = psutil.Process(server.process.pid).net_connections(kind="tcp")
    return {c.raddr.port for c in held if c.raddr and c.raddr.port in ports}


def _wait_held(server: ServerProcess, socks: list[socket.socket]) -> None:
    """Wait until the server has accepted every one of ``socks``' connections."""
    deadline = time.monotonic() + MARGIN_SECS
    while len(_held_by_server(server, socks)) < len(socks):
        assert time.monotonic() < deadline, "the stalled connections were never accepted"
        time.sleep(0.1)


def _wait_cut_off(server: ServerProcess, socks: list[socket.socket], within: float) -> None:
    """Wait until the server holds none of ``socks``' connections."""
    began = time.monotonic()
    while _held_by_server(server, socks):
        if time.monotonic() - began > within:
            held = _held_by_server(server, socks)
            pytest.fail(f"{len(held)} stalled connections still open after {within:g}s")
        time.sleep(0.2)


def _expect_cut_off(
    server: ServerProcess,
    socks: list[socket.socket],
    within: float = SEND_TIMEOUT_SECS + MARGIN_SECS,
) -> None:
    """Wait until the server has accepted every one of ``socks``' connections, then until it
    has cut them all off (within ``within`` seconds); the sockets are closed either way."""
    try:
        _wait_held(server, socks)
        _wait_cut_off(server, socks, within)
    finally:
        for sock in socks:
            sock.close()


def _worker_rss(server: ServerProcess) -> int:
    return int(psutil.Process(server.process.pid).memory_info().rss)


def _catch_up_bytes(client: httpx.Client, path: str) -> int:
    """Read ``path`` to its end with catch-up GETs (PROTOCOL.md 5.6); the bytes read."""
    offset, total = "-1", 0
    while True:
        response = client.get(url(path), params={"offset": offset})
        assert response.status_code == 200
        total += len(response.content)
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return total


@pytest.mark.parametrize("query", ["offset=-1&live=sse", "offset=-1"], ids=["sse", "catch-up"])
def test_a_client_that_never_reads_is_cut_off(
    server: ServerProcess, client: httpx.Client, big: str, query: str
) -> None:
    """PROTOCOL.md 5.6, 5.8: a response nobody takes ends, and its connection with it; the
    worker serves everyone else meanwhile."""
    socks = [_stalled(server, big, query) for _ in range(STALLED)]
    # Served meanwhile, in full.
    assert _catch_up_bytes(client, big) == MESSAGES * MESSAGE_BYTES
    _expect_cut_off(server, socks)
    assert client.head(url(big)).status_code == 200


def test_stalled_readers_do_not_keep_the_memory_they_pinned(
    server: ServerProcess, client: httpx.Client, big: str
) -> None:
    """What stalled clients' responses held is given back once they are cut off: before, each
    SSE reader of this stream pinned about 42 MB for as long as it stayed (for ever, if
    hostile). The worker's RSS does not fall back to where it was (glibc keeps up to 64 MiB
    free at the top of its heap for reuse: durable_project.process), so a first round of
    stalled readers grows the heap, and a second round must find that memory free again
    rather than add tens of MB per client."""
    rss = []
    for _ in range(2):
        _expect_cut_off(
            server, [_stalled(server, big, "offset=-1&live=sse") for _ in range(STALLED)]
        )
        rss.append(_worker_rss(server))
    grown = rss[1] - rss[0]
    assert grown < STALLED * 4 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB more"


def test_sse_events_carry_at_most_about_a_mebibyte(client: httpx.Client, big: str) -> None:
    """PROTOCOL.md 5.8: a catch-up over SSE comes in data events of at most EVENT_READ_BYTES
    (each message is 1 MiB: one per event), each followed by its control event, and the data
    is the stream's, in order, ending up to date."""
    data: list[bytes] = []
    controls: list[dict[str, object]] = []

    def done(events: list[tuple[str, str]]) -> bool:
        kind, text = events[-1]
        return kind == "control" and json.loads(text).get("upToDate") is True

    # The generator yields its one list of events, grown, after each event.
    events = list(sse_events(client, big, "-1", until=done))[-1]
    for (kind, text), (next_kind, next_text) in zip(events[::2], events[1::2], strict=True):
        assert (kind, next_kind) == ("data", "control")
        data.append(base64.b64decode(text.replace("\n", "")))
        controls.append(json.loads(next_text))
    assert max(map(len, data)) <= EVENT_READ_BYTES
    assert b"".join(data) == b"".join(_message(n) for n in range(MESSAGES))
    offsets = [str(control["streamNextOffset"]) for control in controls]
    assert offsets == sorted(set(offsets))
    assert all("upToDate" not in control for control in controls[:-1])


def test_sse_reconnect_interval_holds_while_a_send_waits(
    start_server: object, client: httpx.Client, big: str
) -> None:
    """PROTOCOL.md 10.2: an SSE connection ends at its reconnect interval even when the
    client does not read what was sent (the send timeout here is far longer)."""
    interval = 3.0
    env = {
        "DS_SERVER__SEND_TIMEOUT_SECS": "600",
        "DS_SERVER__SSE_RECONNECT_INTERVAL_SECS": str(interval),
    }
    patient = start_server(env=env)  # type: ignore[operator]
    try:
        socks = [_stalled(patient, big, "offset=-1&live=sse") for _ in range(2)]
        _expect_cut_off(patient, socks, interval + MARGIN_SECS)
    finally:
        patient.stop()


def test_a_client_that_never_reads_is_cut_off_behind_middleware(
    start_server: object, client: httpx.Client, big: str
) -> None:
    """The deadline holds whatever wraps the application: tracing's ASGI middleware wraps
    ``receive`` and ``send``, and a deadline that found the connection through them could not
    cut it (the stalled readers stayed for as long as they liked)."""
    traced = start_server(env=PATIENT | {"OTEL_TRACES_EXPORTER": "console"})  # type: ignore[operator]
    try:
        socks = [_stalled(traced, big, query) for query in ("offset=-1", "offset=-1&live=sse")]
        _expect_cut_off(traced, socks)
    finally:
        traced.stop()


def test_a_client_that_never_reads_a_django_answer_is_cut_off(
    server: ServerProcess, client: httpx.Client
) -> None:
    """The deadline is the connection's, not the protocol endpoints': a page of the state API
    (a Django view, 7 MiB of entities: a page holds at most 8 MiB) that its client never reads
    is cut off too."""
    path = "slow/state"
    value = "v" * MESSAGE_BYTES
    assert client.put(url(path), headers=JSON).status_code == 201
    for n in range(7):
        event = {"type": "big", "key": str(n), "value": value, "headers": {"operation": "insert"}}
        assert client.post(url(path), headers=JSON, content=json.dumps([event])).is_success
    assert client.post("/v1/state/streams", json={"stream": path}).status_code == 201
    target = f"/v1/state/entities?stream={path}&page_size=100"
    assert len(client.get(target).content) > 7 * MESSAGE_BYTES
    _expect_cut_off(server, [_stalled_at(server, target) for _ in range(2)])
    assert client.head(url(path)).status_code == 200


def test_clients_taking_django_answers_slowly_hold_no_database_connection(
    start_server: object, client: httpx.Client
) -> None:
    """A Django-served answer gives its database connection back to the pool once it is made,
    not once its client has taken the last byte: four clients that took a state API page
    slowly (here: not at all, within a deadline long enough to outlast the test) held the
    process's pooled connections (two here), and every other Django-served request waited for
    one and failed (503, found by review). Each answer has begun to arrive before the check."""
    patient = start_server(  # type: ignore[operator]
        env={
            "DS_SERVER__SEND_TIMEOUT_SECS": "120",
            "DS_DB__DJANGO_POOL_MAX_SIZE": "2",
            "DS_DB__ACQUIRE_TIMEOUT_SECS": "1",
        }
    )
    stalled: list[socket.socket] = []
    try:
        path = "slow/state-held"
        value = "v" * MESSAGE_BYTES
        assert client.put(patient.stream_url(path), headers=JSON).status_code == 201
        for n in range(7):
            event = {
                "type": "big",
                "key": str(n),
                "value": value,
                "headers": {"operation": "insert"},
            }
            body = json.dumps([event])
            assert client.post(patient.stream_url(path), headers=JSON, content=body).is_success
        registered = client.post(f"{patient.base_url}/v1/state/streams", json={"stream": path})
        assert registered.status_code == 201
        target = f"/v1/state/entities?stream={path}&page_size=100"
        for _ in range(4):
            sock = _stalled_at(patient, target)
            stalled.append(sock)
            sock.settimeout(30)
            assert sock.recv(12, socket.MSG_PEEK).startswith(b"HTTP/1.1 200")
        listing = client.get(f"{patient.base_url}/v1/streams")
        assert listing.status_code == 200, listing.text
    finally:
        for sock in stalled:
            sock.close()
        patient.stop()


def test_a_slow_reader_that_keeps_reading_gets_its_whole_answer(
    start_server: object, client: httpx.Client
) -> None:
    """PROTOCOL.md 5.6: the deadline is for clients that stop reading, not for slow links. A
    client taking at most 0.6 MiB/s reads an 8 MiB catch-up of small JSON messages to its end
    with a 5 s deadline: what the server buffers for it at a time is one block of the answer
    (1 MiB), not what is left of the whole 8 MiB, which was cut off."""
    patient = start_server(env={"DS_SERVER__SEND_TIMEOUT_SECS": "5"})  # type: ignore[operator]
    try:
        path = "slow/json"
        item = "j" * 2000
        assert client.put(patient.stream_url(path), headers=JSON).status_code == 201
        for first in range(0, 4200, 600):
            batch = [{"n": n, "pad": item} for n in range(first, first + 600)]
            response = client.post(patient.stream_url(path), headers=JSON, json=batch)
            assert response.is_success
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect(("127.0.0.1", patient.port))
        target = patient.stream_url(path).removeprefix(patient.base_url)
        sock.sendall(f"GET {target}?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        received = bytearray()
        began = time.monotonic()
        with sock:
            while b"\r\n\r\n" not in received or len(received) < _answer_length(received):
                chunk = sock.recv(65536)
                assert chunk, f"cut off after {len(received)} bytes"
                received += chunk
                # Paced: never faster than READ_RATE.
                time.sleep(max(0.0, began + len(received) / READ_RATE - time.monotonic()))
        body = bytes(received).split(b"\r\n\r\n", 1)[1]
        assert len(body) > 8_000_000
        assert [message["n"] for message in json.loads(body)] == list(range(len(json.loads(body))))
    finally:
        patient.stop()


def _read_paced(server: ServerProcess, target: str, rate: float) -> bytes:
    """The answer to GET ``target``, read by a client that takes at most ``rate`` bytes a
    second; fails if the server cuts the connection first."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    received = bytearray()
    began = time.monotonic()
    with sock:
        while b"\r\n\r\n" not in received or len(received) < _answer_length(received):
            try:
                chunk = sock.recv(16384)
            except ConnectionResetError:  # cut off, what it had buffered dropped
                chunk = b""
            assert chunk, f"cut off after {len(received)} bytes"
            received += chunk
            time.sleep(max(0.0, began + len(received) / rate - time.monotonic()))
    return bytes(received).split(b"\r\n\r\n", 1)[1]


def test_a_link_slower_than_a_block_per_deadline_gets_its_whole_answer(
    start_server: object, client: httpx.Client
) -> None:
    """PROTOCOL.md 5.6: a slow link is not a stalled client. A client taking at most 768 KiB/s
    needs more than a second for each 1 MiB block of its answer once the kernel's buffers are
    full (the answer, 6 MiB, is more than they hold on loopback): with a 0.75 s deadline it was
    cut off, though it never stopped reading. A deadline passes now when the client has taken
    at least 64 KiB since it was set (durable_project.protocol.SEND_PROGRESS_BYTES); one
    taking less is still cut off."""
    patient = start_server(env={"DS_SERVER__SEND_TIMEOUT_SECS": "0.75"})  # type: ignore[operator]
    try:
        path = "slow/link"
        message = bytes(range(256)) * (6 * 2**20 // 256)
        assert client.put(patient.stream_url(path), headers=BINARY).status_code == 201
        assert client.post(patient.stream_url(path), headers=BINARY, content=message).is_success
        target = patient.stream_url(path).removeprefix(patient.base_url) + "?offset=-1"
        assert _read_paced(patient, target, rate=768 * 1024) == message
        with pytest.raises(AssertionError, match="cut off after"):
            _read_paced(patient, target, rate=32 * 1024)  # 24 KiB a deadline
        with pytest.raises(AssertionError, match="cut off after"):
            _read_paced(patient, target, rate=16 * 1024)
    finally:
        patient.stop()


def _answer_length(received: bytearray) -> int:
    """The whole length of an answer whose head is in ``received`` (its Content-Length)."""
    head, _, _ = bytes(received).partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    raise AssertionError("no content-length")


def test_a_slow_sse_reader_gets_an_event_of_one_large_message(
    server: ServerProcess, client: httpx.Client
) -> None:
    """PROTOCOL.md 5.8: one message is one SSE event, however large (here 16 MiB, 21 MiB once
    base64-encoded). A client taking at most 2 MiB/s reads it whole with a 2 s deadline: the
    event goes out in blocks too, where in one piece the client had to take all of it in time."""
    path = "slow/huge"
    message = bytes(range(256)) * (16 * MESSAGE_BYTES // 256)
    assert client.put(url(path), headers=BINARY).status_code == 201
    assert client.post(url(path), content=message, headers=BINARY).is_success
    sock = _stalled(server, path, "offset=-1&live=sse")
    received = bytearray()
    began = time.monotonic()
    with sock:
        while b"event: control" not in received[-4096:]:
            chunk = sock.recv(65536)
            assert chunk, f"cut off after {len(received)} bytes"
            received += chunk
            time.sleep(max(0.0, began + len(received) / (2 * 2**20) - time.monotonic()))
    body = _dechunked(bytes(received).split(b"\r\n\r\n", 1)[1])
    data = body.split(b"event: data\n", 1)[1].split(b"\n\n", 1)[0]
    lines = [line.removeprefix(b"data:").strip() for line in data.split(b"\n")]
    assert base64.b64decode(b"".join(lines)) == message


def _dechunked(body: bytes) -> bytes:
    """The data of a chunked HTTP body (RFC 9112 7.1), as far as it arrived."""
    data = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        data += rest[:size]
        body = rest[size + 2 :]
    return bytes(data)


HELD_BUDGET_BYTES = 12 * 1024 * 1024
# DS_READ__MAX_CHUNK_BYTES's default: what a catch-up read carries within the budget.
FULL_READ_BYTES = 8 * 1024 * 1024
# streams.held_answers.TIGHT_READ_BYTES: what a read carries past the budget (at least one
# message, and these are larger).
TIGHT_MESSAGE_BYTES = 128 * 1024


HELD_STREAM_BYTES = 16 * 1024 * 1024


def _budgeted(start_server: object, client: httpx.Client, path: str) -> tuple[ServerProcess, str]:
    """A server holding at most HELD_BUDGET_BYTES of answers, patient with slow clients, and
    a stream of HELD_STREAM_BYTES there in messages of TIGHT_MESSAGE_BYTES: the server and the
    stream's URL."""
    patient = start_server(  # type: ignore[operator]
        env={
            "DS_SERVER__SEND_TIMEOUT_SECS": "120",
            "DS_READ__HELD_ANSWERS_BYTES": str(HELD_BUDGET_BYTES),
        }
    )
    stream = patient.stream_url(path)
    assert client.put(stream, headers=BINARY).status_code == 201
    for n in range(HELD_STREAM_BYTES // TIGHT_MESSAGE_BYTES):
        body = bytes([n % 251]) * TIGHT_MESSAGE_BYTES
        assert client.post(stream, content=body, headers=BINARY).is_success
    return patient, stream


def test_answers_held_by_slow_clients_past_the_budget_make_reads_small(
    start_server: object, client: httpx.Client
) -> None:
    """A client on a slow link holds its answer's memory until it has taken it, and the write
    deadline lets one that keeps reading keep its connection: a few hundred could make a
    process hold gigabytes. Past DS_READ__HELD_ANSWERS_BYTES held (12 MiB here), reads carry
    at most 64 KiB, at least one message (streams.held_answers): two stalled readers hold 8 MiB
    answers each, and meanwhile another client reads one message per request, yet the whole
    stream; once they leave, a read carries 8 MiB again (what was held was given back). Before,
    every read carried 8 MiB whatever the process held."""
    path = "slow/held-budget"
    patient, stream = _budgeted(start_server, client, path)
    total = HELD_STREAM_BYTES

    def first_read() -> int:
        response = client.get(stream, params={"offset": "-1"})
        assert response.status_code == 200
        return len(response.content)

    assert first_read() == FULL_READ_BYTES
    stalled: list[socket.socket] = []
    try:
        for _ in range(2):
            sock = _stalled_at(patient, f"{url(path)}?offset=-1")
            stalled.append(sock)
            sock.settimeout(30)
            assert sock.recv(12, socket.MSG_PEEK).startswith(b"HTTP/1.1 200")
        assert first_read() == TIGHT_MESSAGE_BYTES
        offset, read, requests = "-1", 0, 0
        while True:
            response = client.get(stream, params={"offset": offset})
            assert response.status_code == 200
            read, requests = read + len(response.content), requests + 1
            offset = response.headers["Stream-Next-Offset"]
            if response.headers.get("Stream-Up-To-Date") == "true":
                break
        assert (read, requests) == (total, total // TIGHT_MESSAGE_BYTES)
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + MARGIN_SECS
    while first_read() != FULL_READ_BYTES:
        assert time.monotonic() < deadline, "reads stayed small after the slow clients left"
        time.sleep(0.2)


def _held_answer_bytes(client: httpx.Client, server: ServerProcess) -> float:
    metrics = client.get(f"{server.base_url}/metrics").text
    found = re.search(r"^ds_held_answer_bytes(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    assert found is not None
    return float(found.group(1))


def test_reads_begun_together_and_sse_events_count_against_the_budget(
    start_server: object, client: httpx.Client
) -> None:
    """The budget of held answers was checked before each read and counted only once its
    answer was being sent: 12 clients asking for 8 MiB at once, then never reading, were each
    given 8 MiB (probe 8b: 100 of them held 3.1 times the budget), and SSE events were not
    counted at all. Reads under way now count what they may bring, and so do SSE events of more
    than a block: the 12 hold about the budget, and stalled SSE readers count."""
    path = "slow/held-together"
    patient, _ = _budgeted(start_server, client, path)
    stalled: list[socket.socket] = []
    try:
        stalled = [_stalled_at(patient, f"{url(path)}?offset=-1") for _ in range(12)]
        for sock in stalled:
            sock.settimeout(30)
            assert sock.recv(12, socket.MSG_PEEK).startswith(b"HTTP/1.1 200")
        held = max(_held_answer_bytes(client, patient) for _ in range(10))
        # The budget, plus what reads that began while it was not yet reached may bring.
        assert held <= HELD_BUDGET_BYTES + 2 * FULL_READ_BYTES, held
        for sock in stalled:
            sock.close()
        stalled = []
        deadline = time.monotonic() + MARGIN_SECS
        while _held_answer_bytes(client, patient) > 0:
            assert time.monotonic() < deadline, "the stalled answers were never let go"
            time.sleep(0.2)
        stalled = [_stalled_at(patient, f"{url(path)}?offset=-1&live=sse") for _ in range(4)]
        for sock in stalled:
            sock.settimeout(30)
            assert sock.recv(12, socket.MSG_PEEK).startswith(b"HTTP/1.1 200")
        counted = 0.0
        while counted <= 0 and time.monotonic() < deadline:
            counted = _held_answer_bytes(client, patient)
        assert counted > 0, "stalled SSE readers' events were not counted"
    finally:
        for sock in stalled:
            sock.close()


def _pool_whole(server: ServerProcess) -> None:
    """Once the server is idle again, every connection its pool counts is idle."""
    deadline = time.monotonic() + 20
    while True:
        samples = scrape(server)
        opened = value(samples, "ds_db_pool_connections", state="open")
        idle = value(samples, "ds_db_pool_connections", state="idle")
        if opened == idle > 0:
            return
        assert time.monotonic() < deadline, f"{opened} connections open, {idle} idle"
        time.sleep(0.5)


async def _cut(port: int, request: bytes, after: float) -> None:
    """Send ``request`` and reset the connection ``after`` seconds later."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    await asyncio.sleep(after)
    writer.transport.abort()


def test_live_reads_abandoned_at_once_give_every_connection_back(start_server: Any) -> None:
    """Probe 9d: 600 live reads on 60 streams the process had not read yet, their clients gone
    0-20 ms after sending (while the pool was still growing), left the pool counting
    connections nobody held: giving one back to a client waiting for it, psycopg_pool may
    wait, and the request, cancelled when its client left, lost it there (open 3, idle 1,
    three runs in four)."""
    server = start_server()
    stamp = time.time_ns()
    paths = [f"abandoned/{stamp}-{i}" for i in range(60)]
    with httpx.Client(timeout=30) as client:
        for path in paths:
            assert client.put(server.stream_url(path), headers=TEXT).status_code == 201
    rng = random.Random(9)

    def request(i: int) -> bytes:
        live = rng.choice(["long-poll", "sse"])
        return (
            f"GET /v1/stream/{paths[i % 60]}?offset=now&live={live} HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\n\r\n"
        ).encode()

    async def abandon_all() -> None:
        await asyncio.gather(
            *(_cut(server.port, request(i), rng.random() * 0.02) for i in range(600))
        )

    asyncio.run(abandon_all())
    _pool_whole(server)


def test_reads_cut_at_any_moment_give_every_connection_back(start_server: Any) -> None:
    """Review: catch-up reads cut at random moments by 40 clients lost 2 of a pool's 3
    connections for good: a give-back waited for the pool's lock (free, with tasks woken for
    it not yet run) and was cancelled there."""
    server = start_server(env={"DS_DB__POOL_MAX_SIZE": "3"})
    big, small = f"cut/{time.time_ns()}-big", f"cut/{time.time_ns()}-small"
    with httpx.Client(timeout=30) as client:
        assert client.put(server.stream_url(big), headers=TEXT, content=b"a" * (3 << 20)).is_success
        assert client.put(server.stream_url(small), headers=TEXT, content=b"hello").is_success
    rng = random.Random(40)
    requests = [
        f"GET /v1/stream/{path}?offset=-1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        for path in (big, small)
    ]

    async def client_cutting(stop: float) -> None:
        while time.monotonic() < stop:
            await _cut(
                server.port, rng.choice(requests), rng.choice([0, 0.0005, 0.002, 0.01, 0.05])
            )

    async def cut_all() -> None:
        stop = time.monotonic() + 10
        await asyncio.gather(*(client_cutting(stop) for _ in range(40)))

    asyncio.run(cut_all())
    _pool_whole(server)
