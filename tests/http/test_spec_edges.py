"""Edges of the base protocol the official suite does not reach, each against PROTOCOL.md
(found by a probe reading the specification section by section, 2026-11-28)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.http.test_hostile_requests import _exchange, _status

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
CLOSE = {"Stream-Closed": "true"}


def _url(path: str) -> str:
    return f"/v1/stream/{path}"


def test_a_close_of_a_closed_stream_with_producer_headers_answers_no_none(
    client: httpx.Client, stream_path: str
) -> None:
    """5.2.1: a close-only request with producer headers on a closed stream is 204 with
    ``Stream-Closed``; its producer headers said ``None`` (the store has no epoch or sequence
    for that outcome). They are left out now; a closing tuple's retry still echoes its own."""
    url = _url(stream_path)
    assert client.put(url, headers=TEXT).status_code == 201
    closing = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0", **CLOSE}
    assert client.post(url, headers=closing).status_code == 204
    for headers in (
        {"Producer-Id": "q", "Producer-Epoch": "0", "Producer-Seq": "0", **CLOSE},
        {"Producer-Id": "p", "Producer-Epoch": "1", "Producer-Seq": "0", **CLOSE},
    ):
        answer = client.post(url, headers=headers)
        assert answer.status_code == 204, answer.text
        assert answer.headers["Stream-Closed"] == "true"
        for name in ("Producer-Epoch", "Producer-Seq"):
            assert re.fullmatch(r"\d+", answer.headers.get(name, "0")), answer.headers
    retry = client.post(url, headers=closing)
    assert retry.status_code == 204
    assert (retry.headers["Producer-Epoch"], retry.headers["Producer-Seq"]) == ("0", "0")


def test_an_echoed_cursor_past_the_interval_always_moves_forward(
    client: httpx.Client, stream_path: str
) -> None:
    """10.1: a cursor at or past the current interval MUST get a greater one back; a cursor of
    more than 18 characters (leading zeros, or a value past 10^18) got the current interval."""
    url = _url(stream_path)
    assert client.put(url, headers=TEXT, content=b"x").status_code == 201
    for echoed in ("000000000000000000099999999", "9" * 19):
        answer = client.get(url, params={"offset": "-1", "live": "long-poll", "cursor": echoed})
        assert answer.status_code == 200
        assert int(answer.headers["Stream-Cursor"]) > int(echoed)


def test_a_json_stream_is_not_created_from_whitespace(
    client: httpx.Client, stream_path: str
) -> None:
    """9.1: a JSON stream's data MUST be valid JSON: a PUT whose body is only whitespace
    created an empty stream (201), where the same body appended is a 400. An empty body still
    creates an empty stream."""
    refused = client.put(_url(stream_path), headers=JSON, content=b" \n\t ")
    assert refused.status_code == 400, refused.text
    assert client.head(_url(stream_path)).status_code == 404
    assert client.put(_url(stream_path), headers=JSON, content=b"").status_code == 201


def test_history_of_a_stream_about_to_expire_is_not_cached_past_its_expiry(
    start_server: Any, stream_path: str
) -> None:
    """5.6: caching of historical chunks is derived from the stream's TTL and expiry; a chunk
    of a stream expiring in a few seconds said ``max-age=60, stale-while-revalidate=300``, so
    a cache could serve it for six minutes after the stream was gone. (Chunks of one message
    here, so that a read from the start is history.)"""
    server = start_server(env={"DS_READ__MAX_CHUNK_MESSAGES": "1"})
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        in_five_seconds = datetime.now(UTC) + timedelta(seconds=5)
        for name, headers in (
            ("ttl", {"Stream-TTL": "5"}),
            ("expiry", {"Stream-Expires-At": in_five_seconds.strftime("%Y-%m-%dT%H:%M:%SZ")}),
            ("forever", {}),
        ):
            url = _url(f"{stream_path}-{name}")
            assert client.put(url, headers={**TEXT, **headers}).status_code == 201
            for data in (b"a", b"b"):
                assert client.post(url, headers=TEXT, content=data).status_code == 204
            history = client.get(url, params={"offset": "-1"})
            assert history.status_code == 200
            assert "Stream-Up-To-Date" not in history.headers
            control = history.headers["Cache-Control"]
            lifetimes = re.findall(r"(?:max-age|stale-while-revalidate)=(\d+)", control)
            if name == "forever":
                assert control.endswith("max-age=60, stale-while-revalidate=300"), control
            else:
                assert sum(map(int, lifetimes)) <= 5, (name, control)


def test_json_nested_past_what_the_server_parses_is_refused_as_such(
    client: httpx.Client, stream_path: str
) -> None:
    """A body nested 100,000 deep is a 400 that says so (it said "maximum recursion depth
    exceeded", Python's words), and nothing is stored."""
    url = _url(stream_path)
    assert client.put(url, headers=JSON).status_code == 201
    answer = client.post(url, headers=JSON, content=b"[" * 100_000 + b"]" * 100_000)
    assert answer.status_code == 400
    assert "nested deeper than 128 levels" in answer.text
    assert client.get(url, params={"offset": "-1"}).json() == []


def _nested(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("kind", ["array", "object"])
def test_json_nests_at_most_128_levels(client: httpx.Client, stream_path: str, kind: str) -> None:
    """128 levels are stored and read back; deeper is a 400 that changes nothing, for an append
    and a create alike. Between Python's decoder's limit and its encoder's (968-971 levels), an
    append or a create was a 500 (probe 9c), and a value the decoder just took could not be
    read back deeper in a stack (the state API: see tests/state)."""
    url = _url(stream_path)
    assert client.put(url, headers=JSON).status_code == 201
    deepest = _nested(128, kind)
    assert client.post(url, headers=JSON, content=deepest).status_code == 204
    # Brackets inside strings are not nesting (nor are escaped quotes and backslashes).
    strings = ["[{" * 500 + "\\", '\\"]', '"[' * 200]
    assert client.post(url, headers=JSON, content=json.dumps(strings)).status_code == 204
    for depth in (129, 970, 990):
        answer = client.post(url, headers=JSON, content=_nested(depth, kind))
        assert answer.status_code == 400, (depth, answer.text)
        assert "nested deeper than 128 levels" in answer.text
        created = client.put(f"{url}-{depth}", headers=JSON, content=_nested(depth, kind))
        assert created.status_code == 400, (depth, created.text)
        assert client.head(f"{url}-{depth}").status_code == 404
    # A string hiding closing brackets does not hide the depth.
    hidden = b"[" + b'"]]",[' * 129 + b"1" + b"]" * 129 + b"]"
    assert client.post(url, headers=JSON, content=hidden).status_code == 400
    value = json.loads(deepest)
    stored = client.get(url, params={"offset": "-1"}).json()
    assert stored == (value if kind == "array" else [value]) + strings


@pytest.mark.parametrize(
    "repeated",
    [
        [("Stream-Closed", "true"), ("Stream-Closed", "true")],
        [("Stream-Seq", "5"), ("Stream-Seq", "1")],
        [("Content-Type", "text/plain"), ("Content-Type", "text/plain")],
        [
            ("Producer-Id", "p"),
            ("Producer-Id", "q"),
            ("Producer-Epoch", "0"),
            ("Producer-Seq", "0"),
        ],
    ],
    ids=["closed", "seq", "content-type", "producer-id"],
)
def test_a_protocol_header_sent_twice_is_refused(
    client: httpx.Client, stream_path: str, repeated: list[tuple[str, str]]
) -> None:
    """Probe 9b: repeated headers were combined as a list, so two ``Stream-Closed: true`` were
    answered 204 without closing, and ``Stream-Seq`` 5 and 1 stored the sequence ``5, 1``,
    which refused a later 5. A protocol header sent twice is a 400 that changes nothing."""
    url = _url(stream_path)
    assert client.put(url, headers=TEXT).status_code == 201
    headers = repeated if repeated[0][0] == "Content-Type" else [*TEXT.items(), *repeated]
    answer = client.post(url, headers=headers, content="x")
    assert answer.status_code == 400, answer.text
    assert "given more than once" in answer.text
    head = client.head(url)
    assert "Stream-Closed" not in head.headers and head.headers["Stream-Next-Offset"]
    assert client.get(url, params={"offset": "-1"}).text == ""
    assert client.post(url, headers=TEXT | {"Stream-Seq": "5"}, content="y").status_code == 204


def test_header_values_lose_only_http_whitespace(
    client: httpx.Client, server: ServerProcess, stream_path: str
) -> None:
    """Probe 9b: values were trimmed with str.strip(), which also takes NEL (0x85) and no-break
    space (0xA0) away, so ``Producer-Seq: 0<A0>`` was a sequence number and a PUT took
    ``application/json<85>`` that the same stream's POST refused. Space and tab around a value
    are HTTP's and are dropped everywhere, ``Stream-TTL`` included (it refused them)."""
    url = _url(stream_path)
    producer = [("Producer-Id", "p"), ("Producer-Epoch", "0")]
    assert client.put(url, headers=TEXT).status_code == 201
    for end in (b"\xa0", b"\x85"):
        seq = [*TEXT.items(), *producer, ("Producer-Seq", b"0" + end)]
        assert client.post(url, headers=seq, content="x").status_code == 400
        typed = client.put(f"{url}-typed", headers=[("Content-Type", b"application/json" + end)])
        assert typed.status_code == 400, typed.text
        retention = [*TEXT.items(), ("Stream-Retention-Max-Age", b"60" + end)]
        assert client.put(f"{url}-kept", headers=retention).status_code == 400
    assert client.get(url, params={"offset": "-1"}).text == ""
    # httpx refuses to send whitespace around a value: on a socket of the test's own.
    target = f"{url}-spaced".encode()
    head = b"Host: 127.0.0.1\r\nContent-Type: text/plain\t\r\nContent-Length: 1\r\n"
    created = _exchange(
        server,
        b"PUT "
        + target
        + b" HTTP/1.1\r\n"
        + head
        + b"Stream-TTL: 600 \t\r\nConnection: close\r\n\r\nx",
    )
    assert _status(created) == 201, created
    spaced = (
        b"Producer-Id: p\r\nProducer-Epoch:  0\t\r\nProducer-Seq: \t0 \r\n"
        b"Connection: close\r\n\r\ny"
    )
    assert _status(_exchange(server, b"POST " + target + b" HTTP/1.1\r\n" + head + spaced)) == 200
    assert client.get(f"{url}-spaced", params={"offset": "-1"}).text == "xy"


def test_location_holds_only_what_a_url_may(server: ServerProcess, stream_path: str) -> None:
    """``"<>`` in a path, which the parser lets through, were echoed as sent in ``Location``
    (left by probe 8b): they are percent-encoded, escapes sent are kept."""
    target = f'/v1/stream/{stream_path}-%20"<>|'.encode()
    request = b"PUT " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    answer = _exchange(server, request)
    assert _status(answer) == 201, answer
    (location,) = [line for line in answer.split(b"\r\n") if line.lower().startswith(b"location:")]
    assert location.endswith(f"/v1/stream/{stream_path}-%20%22%3C%3E%7C".encode()), location


def test_a_stream_with_a_live_reader_does_not_expire_by_its_ttl(
    client: httpx.Client, stream_path: str
) -> None:
    """5.1: "a stream with active live readers will not expire". A reader waiting longer than
    the stream's sliding TTL (the test servers' long-polls wait 2 s, the TTL is 1 s) saw it
    expire under it, and was then told it was up to date (probe 10f)."""
    url = _url(stream_path)
    created = client.put(url, headers={**TEXT, "Stream-TTL": "1"})
    assert created.status_code == 201
    tail = created.headers["Stream-Next-Offset"]
    waited = client.get(url, params={"offset": tail, "live": "long-poll"})
    assert waited.status_code == 204
    assert client.head(url).status_code == 200  # HEAD renews nothing: alive, still watched


def test_live_readers_end_when_their_stream_expires(client: httpx.Client, stream_path: str) -> None:
    """5.1: past its Stream-Expires-At a stream is gone. A long-poll waiting then answered 204
    (up to date) at its timeout, and an SSE connection stayed open with keep-alives until its
    reconnect interval (probe 10f). The long-poll answers 404 at the expiry; the SSE
    connection ends then (its reconnect hears 404)."""
    for live in ("long-poll", "sse"):
        url = _url(f"{stream_path}-{live}")
        soon = datetime.now(UTC) + timedelta(seconds=1)
        expires = {"Stream-Expires-At": soon.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        created = client.put(url, headers={**TEXT, **expires})
        assert created.status_code == 201, created.text
        params = {"offset": created.headers["Stream-Next-Offset"], "live": live}
        with client.stream("GET", url, params=params, timeout=10) as reader:
            body = reader.read()  # to its end: a read timeout fails the test
        if live == "long-poll":
            assert reader.status_code == 404, (reader.status_code, body)
        else:
            assert reader.status_code == 200 and b"event: control" in body
        assert client.get(url, params={"offset": "-1"}).status_code == 404
