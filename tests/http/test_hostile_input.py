"""Hostile input against the real server (issue 8): one bad request never hurts another client,
no input causes a 500, a stall or a leak.

Each test names the defect it pins; all failed on commit 53fc172.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest

from tests.access.support import create_key
from tests.http.test_bad_input import snapshot
from tests.http.test_hostile_requests import _exchange

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


def producer(pid: str, seq: int) -> dict[str, str]:
    return {"Producer-Id": pid, "Producer-Epoch": "0", "Producer-Seq": str(seq)}


def test_oversized_producer_id_fails_alone(
    server: Any, client: httpx.Client, stream_path: str
) -> None:
    """Defect 1: an 8,000-character Producer-Id was a 500, and since a group-commit batch is
    one transaction, it failed most of the well-formed appends batched with it. Now it is a 400
    of its own, and every other append is stored, exactly once, in order."""
    url = f"/v1/stream/{stream_path}"
    assert client.put(url, headers=TEXT).status_code == 201
    huge = "x" * 8000

    async def run() -> list[tuple[str, int]]:
        async with aiohttp.ClientSession(base_url=server.base_url) as session:

            async def one(index: int) -> tuple[str, int]:
                bad = index % 20 == 7
                headers = TEXT | producer(huge if bad else f"p{index}", 0)
                async with session.post(url, headers=headers, data=f"m{index}.") as response:
                    await response.read()
                    return ("bad" if bad else f"m{index}.", response.status)

            return await asyncio.gather(*(one(i) for i in range(200)))

    results = asyncio.run(run())
    assert {status for kind, status in results if kind == "bad"} == {400}
    good = [kind for kind, status in results if kind != "bad"]
    assert {status for kind, status in results if kind != "bad"} == {200}
    body = client.get(url, params={"offset": "-1"}).text
    stored = [part + "." for part in body.split(".") if part]
    assert sorted(stored) == sorted(good) and len(stored) == len(set(stored))


@pytest.mark.parametrize(
    "headers",
    [
        producer("p" * 513, 0),
        {"Stream-Seq": "s" * 513},
        {"Content-Type": "text/" + "x" * 300},
    ],
)
def test_header_values_the_store_keeps_are_bounded(
    client: httpx.Client, stream_path: str, headers: dict[str, str]
) -> None:
    """Defect 1's class: values stored with a stream have bounds, refused with 400 before
    anything is written."""
    url = f"/v1/stream/{stream_path}"
    assert client.put(url, headers=TEXT, content="a").status_code == 201
    before = snapshot(client, url)
    response = client.post(url, headers=TEXT | headers, content="b")
    assert response.status_code == 400, response.text
    assert snapshot(client, url) == before


def test_json_append_message_count_is_bounded(client: httpx.Client, stream_path: str) -> None:
    """Defect 2: a 6 MB body of 3M tiny JSON elements took 47 s on the event loop. An append
    holds at most DS_LIMITS__MAX_APPEND_MESSAGES (100,000) messages: more is a 413, judged
    before the messages are encoded; the stream is unchanged."""
    url = f"/v1/stream/{stream_path}"
    assert client.put(url, headers=JSON, content="[1]").status_code == 201
    before = snapshot(client, url)
    body = b"[" + b",".join([b"0"] * 3_000_000) + b"]"
    response = client.post(url, headers=JSON, content=body, timeout=60)
    assert response.status_code == 413, response.text
    assert snapshot(client, url) == before
    # At the bound it is accepted.
    at_limit = b"[" + b",".join([b"1"] * 100_000) + b"]"
    assert client.post(url, headers=JSON, content=at_limit, timeout=60).status_code == 204
    assert client.head(url).headers["Stream-Next-Offset"].startswith("0000000000100001_")


def test_catch_up_of_tiny_messages_is_bounded_by_count(
    client: httpx.Client, stream_path: str
) -> None:
    """Defect 2: a catch-up read of many tiny messages built one object per message on the
    event loop, up to 1 MiB of them per response. A response carries at most
    DS_READ__MAX_CHUNK_MESSAGES (10,000) messages; following Stream-Next-Offset reads all, well
    past offsets that fit a smallint."""
    url = f"/v1/stream/{stream_path}"
    # Past 32,767 messages: reads once added two smallints (psycopg's type for small ints).
    values = list(range(45_000))
    body = "[" + ",".join(str(v) for v in values) + "]"
    assert client.put(url, headers=JSON, content=body).status_code == 201
    first = client.get(url, params={"offset": "-1"})
    assert len(first.json()) == 10_000
    assert first.headers["Stream-Next-Offset"].startswith("0000000000010000_")
    assert "Stream-Up-To-Date" not in first.headers
    read: list[int] = []
    offset = "-1"
    while True:
        response = client.get(url, params={"offset": offset})
        read.extend(response.json())
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            break
    assert read == values


def test_offsets_with_non_ascii_digits_are_refused(client: httpx.Client, stream_path: str) -> None:
    """Defect 12: offsets written with other scripts' digits were accepted (Python's ``\\d``
    and ``int`` take them)."""
    url = f"/v1/stream/{stream_path}"
    assert client.put(url, headers=TEXT, content="abc").status_code == 201
    arabic_zeros = "\u0660" * 16
    for offset in (f"{arabic_zeros}_{arabic_zeros}", "0" * 16 + "_" + "\u0660" * 16):
        for live in (None, "long-poll", "sse"):
            params = {"offset": offset} | ({"live": live} if live else {})
            assert client.get(url, params=params).status_code == 400
    # Headers arrive as bytes (latin-1): "\xb2" is SUPERSCRIPT TWO, a digit to isdigit() that
    # int() refuses (it was a 500).
    fork = f"{url}-fork"
    headers = {"Stream-Forked-From": url.encode(), "Stream-Fork-Sub-Offset": b"\xb2"}
    assert client.put(fork, headers=TEXT | headers).status_code == 400
    assert client.get(url, params={"offset": "-1", "cursor": "\u0661"}).status_code == 200


@pytest.mark.parametrize(
    "url",
    [
        "/v1/streams?prefix=%00",
        "/v1/streams?prefix=a%00b&page=1",
        "/v1/state/entities?stream=%00",
        "/v1/state/entities?stream=x&type=%00",
        "/v1/state/streams/a%00b",
        "/admin/login/?next=%00",
    ],
)
def test_nul_in_django_urls_is_400(client: httpx.Client, url: str) -> None:
    """Defect 6: NUL characters in the paths and query strings of the REST API were 500s
    (PostgreSQL text cannot hold them)."""
    assert client.get(url).status_code == 400


def test_nul_in_state_schemas_is_400(client: httpx.Client, stream_path: str) -> None:
    """Defect 6: a NUL character in a registered JSON Schema was a 500; the stream stays
    unregistered."""
    stream = f"{stream_path}-state"
    assert client.put(f"/v1/stream/{stream}", headers=JSON).status_code == 201
    schemas = {"user": {"type": "object", "description": "nul \u0000 here"}}
    response = client.post("/v1/state/streams", json={"stream": stream, "schemas": schemas})
    assert response.status_code == 400, response.text
    assert client.get(f"/v1/state/streams/{stream}").status_code == 404


@pytest.mark.parametrize("depth", [50_000, 3_000])
def test_deeply_nested_json_to_the_api_is_400(
    client: httpx.Client, stream_path: str, depth: int
) -> None:
    """Defect 6: JSON nested 50,000 deep was a 500 from the REST API's parser."""
    body = '{"stream": "x", "schemas": {"a": ' + "[" * depth + "]" * depth + "}}"
    response = client.post("/v1/state/streams", content=body, headers=JSON)
    assert response.status_code == 400, response.text


@pytest.fixture(scope="module")
def impatient_server(start_server: Any) -> Any:
    """A server that waits at most one second for the next part of a request body."""
    return start_server(env={"DS_HTTP__BODY_READ_TIMEOUT_SECS": "1"})


def _raw(port: int, request: bytes, *, read_timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


@pytest.mark.parametrize("path", ["/v1/state/streams", "/admin/login/", "/v1/stream/x"])
def test_huge_declared_bodies_are_refused_before_reading(impatient_server: Any, path: str) -> None:
    """Defect 7: a 300 MB POST to a Django-served URL was spooled to a temporary file before
    being refused. A declared length over the limit is a 413 at once (and the connection is
    closed), before one byte of the body is sent."""
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: 300000000\r\n\r\n"
    ).encode()
    answer = _raw(impatient_server.port, request)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("path", ["/v1/state/streams", "/admin/login/", "/v1/stream/x"])
def test_incomplete_bodies_time_out(impatient_server: Any, path: str) -> None:
    """Defect 7 (slowloris): a body that stops arriving was waited for forever; now the
    request ends with 408 once no part arrived for DS_HTTP__BODY_READ_TIMEOUT_SECS."""
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: 100\r\n\r\nonly ten b"
    ).encode()
    started = time.monotonic()
    answer = _raw(impatient_server.port, request, read_timeout=15)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 14


@pytest.mark.parametrize("path", ["/v1/state/streams", "/v1/stream/x"])
def test_a_body_dripping_in_times_out(impatient_server: Any, path: str) -> None:
    """Probe 9a: a body sent a byte at a time, each within the timeout, held its connection for
    as long as its client liked (40,000 of them took every descriptor of both processes). A body
    must bring 64 KiB, or end, within each timeout: this one is answered 408 while it drips."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
        f"Content-Length: 100000\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", impatient_server.port), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(0.2)
        answer = b""
        for _ in range(50):  # 10 s of drops, ten times the timeout
            with contextlib.suppress(TimeoutError):
                answer = sock.recv(65536)
            if answer:
                break
            sock.sendall(b"x")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_slow_body_that_keeps_coming_is_taken(impatient_server: Any, stream_path: str) -> None:
    """A slow link is not a dripping client: 64 KiB a little more often than the timeout is
    taken whole, however long the body takes."""
    block = b"y" * 65536
    with httpx.Client(base_url=impatient_server.base_url, timeout=30) as client:
        url = f"/v1/stream/{stream_path}"
        assert client.put(url, headers={"Content-Type": "text/plain"}).status_code == 201

        def blocks() -> Iterator[bytes]:
            for _ in range(4):
                yield block
                time.sleep(0.7)

        answer = client.post(url, headers={"Content-Type": "text/plain"}, content=blocks())
        assert answer.status_code == 204, answer.text
        assert len(client.get(url, params={"offset": "-1"}).content) == 4 * len(block)


@pytest.fixture(scope="module")
def django_limit_client(impatient_server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=impatient_server.base_url, timeout=30) as http:
        yield http


def test_chunked_bodies_to_django_urls_are_bounded(django_limit_client: httpx.Client) -> None:
    """Defect 7: without a declared length, a body is refused as soon as it passes the limit
    (DATA_UPLOAD_MAX_MEMORY_SIZE, 2.5 MiB)."""

    def chunks() -> Iterator[bytes]:
        for _ in range(400):
            yield b" " * 65536

    response = django_limit_client.post("/v1/state/streams", content=chunks(), headers=JSON)
    assert response.status_code == 413


def test_fork_chains_stop_at_their_depth(start_server: Any, stream_path: str) -> None:
    """Every read and HEAD of a fork walks its chain: a client forking forks a thousand deep
    made each cost tens of milliseconds of the database's time, and fork creation slower still
    (found by a probe). Past ``DS_LIMITS__MAX_FORK_DEPTH`` a fork is refused (400) and nothing
    is created; the deepest fork reads its whole chain."""
    server = start_server(env={"DS_LIMITS__MAX_FORK_DEPTH": "5"})
    with httpx.Client(timeout=30) as client:
        text = {"Content-Type": "text/plain"}
        assert client.put(server.stream_url(stream_path), headers=text).status_code == 201
        chain = [stream_path]
        for depth in range(1, 7):
            source = chain[-1]
            assert client.post(server.stream_url(source), headers=text, content=f"{depth - 1}.")
            fork = f"{stream_path}/f{depth}"
            answer = client.put(server.stream_url(fork), headers={"Stream-Forked-From": source})
            if depth <= 5:
                assert answer.status_code == 201, (depth, answer.text)
                chain.append(fork)
            else:
                assert answer.status_code == 400, answer.text
                assert "5 forks deep" in answer.text
                assert client.head(server.stream_url(fork)).status_code == 404
        deepest = client.get(server.stream_url(chain[-1]), params={"offset": "-1"})
        assert deepest.text == "0.1.2.3.4.5."
        # A fork of a shallower link of the chain is still allowed.
        beside = client.put(
            server.stream_url(f"{stream_path}/beside"), headers={"Stream-Forked-From": chain[2]}
        )
        assert beside.status_code == 201, beside.text


def test_an_expiry_past_the_last_year_in_utc_is_refused(
    client: httpx.Client, stream_path: str
) -> None:
    """9999-12-31T23:59:59-23:59 is in year 10000 in UTC: it answered 500 (found by the
    fuzzer); it is a 400 and nothing is created."""
    expires = {"Stream-Expires-At": "9999-12-31T23:59:59-23:59", "Content-Type": "text/plain"}
    assert client.put(f"/v1/stream/{stream_path}", headers=expires).status_code == 400
    assert client.head(f"/v1/stream/{stream_path}").status_code == 404


def test_a_body_left_unread_closes_the_connection_once(impatient_server: Any) -> None:
    """A body past the request limit, or too slow, is refused before it has all arrived, and
    the connection closes after the answer: said once (the error's own header and the unread
    body's each said it)."""
    for length, status in ((999999999999, 413), (1000, 408)):
        head = (
            "POST /v1/stream/unread/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: text/plain\r\nContent-Length: {length}\r\n\r\nonly the start"
        ).encode()
        answer = _exchange(impatient_server, head, timeout=10)
        assert answer.startswith(f"HTTP/1.1 {status}".encode()), answer[:300]
        head_lines = answer.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
        assert head_lines.count(b"connection: close") == 1, head_lines


def test_a_body_its_sender_may_not_send_is_not_waited_for(
    start_server: Any, database_url: str
) -> None:
    """Probe 9a: in ``keys`` mode a body was read before its sender was judged, so anyone could
    make a process hold 64 MiB bodies, or a connection for as long as its body took to drip
    in, before hearing 401. The refusal comes at the head now, and the connection closes after
    it rather than wait for a body nobody will read."""
    server = start_server(env={"DS_AUTH__MODE": "keys"})
    reader = create_key(database_url, "body-reader", "stream/bodies/:read")
    owner = create_key(database_url, "body-owner", "stream/bodies/:read,append,manage")
    fork = "Stream-Forked-From: /v1/stream/secret/x\r\n"
    for method, credentials, status in (
        ("POST", "", 401),
        ("PUT", "", 401),
        ("POST", f"Authorization: Bearer {reader}\r\n", 403),
        # A fork of a stream the key may not read (review).
        ("PUT", f"Authorization: Bearer {owner}\r\n{fork}", 403),
    ):
        head = (
            f"{method} /v1/stream/bodies/x HTTP/1.1\r\nHost: 127.0.0.1\r\n{credentials}"
            f"Content-Type: text/plain\r\nContent-Length: 1000000\r\n\r\nonly the start"
        ).encode()
        answer = _exchange(server, head, timeout=10)  # what came before the server closed
        assert answer.startswith(f"HTTP/1.1 {status}".encode()), (method, answer[:300])
        assert b"connection: close" in answer.lower()
    # The REST API's writes too (probe 10b): their bodies were read, up to 2.5 MB each and for
    # as long as they took, before their credentials were judged.
    for credentials in ("", "Authorization: Bearer made.up\r\n"):
        head = (
            f"POST /v1/state/streams HTTP/1.1\r\nHost: 127.0.0.1\r\n{credentials}"
            f"Content-Type: application/json\r\nContent-Length: 2000000\r\n\r\n{{"
        ).encode()
        answer = _exchange(server, head, timeout=10)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
        assert b"connection: close" in answer.lower()
        # Worded as the REST API words its refusals (review).
        assert b"content-type: application/json" in answer.lower()
        assert answer.split(b"\r\n\r\n", 1)[1].startswith(b'{"detail": ')
