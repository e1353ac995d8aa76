"""Bad input gets a clear 4xx and changes nothing; no client input produces a 500.

Each case sends a malformed request to a stream holding known data, then checks the answer's
status and that the stream (tail, content, closure) is exactly as before.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def text_stream(client: httpx.Client, stream_path: str) -> str:
    assert client.put(f"/v1/stream/{stream_path}", headers=TEXT, content="abc").status_code == 201
    return f"/v1/stream/{stream_path}"


@pytest.fixture
def json_stream(client: httpx.Client, stream_path: str) -> str:
    url = f"/v1/stream/{stream_path}-json"
    assert client.put(url, headers=JSON, content='[{"a":1}]').status_code == 201
    return url


def snapshot(client: httpx.Client, url: str) -> tuple[int, str | None, str | None, bytes]:
    head = client.head(url)
    body = client.get(url).content if head.status_code == 200 else b""
    return (
        head.status_code,
        head.headers.get("Stream-Next-Offset"),
        head.headers.get("Stream-Closed"),
        body,
    )


@pytest.mark.parametrize(
    "offset",
    ["", "abc", "0,1", "0 1", "-2", "NOW", "../x", "0000000000000000_0000000000000000\n",
     "0000000000000000_00000000000000\x00", "9999999999999999_9999999999999999",
     "0000000000000001_0000000000000001", "0000000000000000_0000000000000002",
     "%", "0000000000000000_0000000000000000/..", "\xed\xa0\x80"],
)  # fmt: skip
@pytest.mark.parametrize("live", [None, "long-poll", "sse"])
def test_malformed_offsets(
    client: httpx.Client, text_stream: str, offset: str, live: str | None
) -> None:
    """PROTOCOL.md 5.6, 8: an offset the stream did not mint is a 400 in every read mode."""
    before = snapshot(client, text_stream)
    params = {"offset": offset} | ({"live": live} if live else {})
    assert client.get(text_stream, params=params).status_code == 400
    assert snapshot(client, text_stream) == before


@pytest.mark.parametrize(
    "query",
    ["offset=a&offset=b", "live=sse", "live=long-poll", "offset=-1&live=websocket",
     "offset=-1&live=sse&live=long-poll", "offset=%ff%fe"],
)  # fmt: skip
def test_malformed_read_queries(client: httpx.Client, text_stream: str, query: str) -> None:
    """PROTOCOL.md 5.6-5.8: duplicate parameters, live modes without an offset, unknown modes."""
    assert client.get(f"{text_stream}?{query}").status_code == 400


@pytest.mark.parametrize(
    "headers",
    [
        {"Producer-Id": "p"},
        {"Producer-Id": "p", "Producer-Epoch": "0"},
        {"Producer-Epoch": "0", "Producer-Seq": "0"},
        {"Producer-Id": "", "Producer-Epoch": "0", "Producer-Seq": "0"},
        {"Producer-Id": "p", "Producer-Epoch": "-1", "Producer-Seq": "0"},
        {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "1e3"},
        {"Producer-Id": "p", "Producer-Epoch": "0x1", "Producer-Seq": "0"},
        {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": str(2**53)},
        {"Producer-Id": "p", "Producer-Epoch": "99999999999999999999", "Producer-Seq": "0"},
        {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "1.5"},
    ],
)
def test_malformed_producer_headers(
    client: httpx.Client, text_stream: str, headers: dict[str, str]
) -> None:
    """PROTOCOL.md 5.2.1: partial or non-integer producer headers are 400 and leave no state:
    the producer can still start at (0, 0) afterwards."""
    before = snapshot(client, text_stream)
    assert client.post(text_stream, headers=TEXT | headers, content="x").status_code == 400
    assert snapshot(client, text_stream) == before
    fresh = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
    assert client.post(text_stream, headers=TEXT | fresh, content="y").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"Stream-TTL": "abc"},
        {"Stream-TTL": "-1"},
        {"Stream-TTL": "1.5"},
        {"Stream-TTL": "1e3"},
        {"Stream-TTL": "007"},
        {"Stream-TTL": "99999999999999999999999"},
        {"Stream-TTL": "999999999999999999"},
        {"Stream-Expires-At": "tomorrow"},
        {"Stream-Expires-At": "2030-02-30T00:00:00Z"},
        {"Stream-Expires-At": "0000-01-01T00:00:00Z"},
        {"Stream-TTL": "60", "Stream-Expires-At": "2030-01-01T00:00:00Z"},
        {"Content-Type": "not a media type"},
        {"Stream-Fork-Offset": "0000000000000000_0000000000000000"},
        {"Stream-Fork-Sub-Offset": "1"},
        {"Stream-Forked-From": "/v1/stream/x", "Stream-Fork-Offset": "bogus"},
        {"Stream-Forked-From": "/v1/stream/x", "Stream-Fork-Sub-Offset": "-1"},
        {"Stream-Forked-From": "/v1/stream/../etc", "Stream-Fork-Sub-Offset": "0"},
    ],
)
def test_malformed_create_headers(
    client: httpx.Client, stream_path: str, headers: dict[str, str]
) -> None:
    """PROTOCOL.md 5.1, 4.2: bad TTL, expiry, content type or fork headers are 400 and create
    nothing."""
    url = f"/v1/stream/{stream_path}-new"
    response = client.put(url, headers={"Content-Type": "text/plain"} | headers)
    assert response.status_code == 400, response.text
    assert client.head(url).status_code == 404


@pytest.mark.parametrize(
    "body",
    [b"{ invalid json }", b"[]", b"[1,]", b"NaN", b'{"a": Infinity}', b"\xff\xfe\x00",
     b"[" * 100_000, b'{"a":1} trailing', b"", b"   "],
)  # fmt: skip
def test_malformed_json_appends(client: httpx.Client, json_stream: str, body: bytes) -> None:
    """PROTOCOL.md 9.1: invalid JSON, empty arrays and empty bodies are 400, store nothing."""
    before = snapshot(client, json_stream)
    assert client.post(json_stream, headers=JSON, content=body).status_code == 400
    assert snapshot(client, json_stream) == before


def test_missing_or_malformed_content_type(client: httpx.Client, text_stream: str) -> None:
    """PROTOCOL.md 5.2: a body needs a (valid) Content-Type; a different type is a 409."""
    before = snapshot(client, text_stream)
    assert client.post(text_stream, content=b"x", headers={"Content-Type": ""}).status_code == 400
    assert (
        client.post(text_stream, content=b"x", headers={"Content-Type": "???"}).status_code == 400
    )
    assert client.post(text_stream, content=b"x", headers=JSON).status_code == 409
    assert snapshot(client, text_stream) == before


def raw_request(server: Any, method: str, raw_path: str, body: bytes = b"x") -> int:
    """Send a request with the path exactly as written (HTTP clients normalise dot segments)
    on a connection of its own; return the status."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.putrequest(method, raw_path, skip_accept_encoding=True)
        connection.putheader("Content-Type", "text/plain")
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.parametrize("method", ["PATCH", "TRACE", "PROPFIND", "MKCOL", "FOO"])
def test_unknown_methods(server: Any, client: httpx.Client, text_stream: str, method: str) -> None:
    """PROTOCOL.md 5.2: operations a stream does not support answer 405 with Allow. (A method
    the HTTP parser itself does not know, like FOO, is refused by it with a 400.)"""
    before = snapshot(client, text_stream)
    status = raw_request(server, method, text_stream)
    assert status == (400 if method == "FOO" else 405)
    assert snapshot(client, text_stream) == before
    if method != "FOO":
        response = client.request(method, text_stream, content=b"x")
        assert "GET" in response.headers["Allow"]


@pytest.mark.parametrize(
    "raw_path",
    ["/v1/stream/a/%2e%2e/b", "/v1/stream/%2E%2E", "/v1/stream/a/%2e/b", "/v1/stream/a/../b",
     "/v1/stream/a%00b", "/v1/stream/%ff%fe", "/v1/stream/a//b", "/v1/stream/a/",
     "/v1/stream/", "/v1/stream/__ds", "/v1/stream/a%0d%0aSet-Cookie:x",
     "/v1/stream/" + "x" * 2000],
)  # fmt: skip
@pytest.mark.parametrize("method", ["PUT", "POST", "GET", "HEAD", "DELETE"])
def test_path_tricks(server: Any, raw_path: str, method: str) -> None:
    """PROTOCOL.md 12.2: traversal, NUL, invalid UTF-8 and reserved prefixes are 400 and never
    reach storage."""
    assert raw_request(server, method, raw_path) == 400


@pytest.mark.parametrize("method", ["PUT", "POST", "GET", "HEAD", "DELETE"])
def test_the_reserved_prefix_is_never_a_stream(
    server: Any, client: httpx.Client, method: str
) -> None:
    """PROTOCOL.md 6: ``__ds/`` belongs to the control APIs (subscriptions); any other path
    under it is 404 from them, whatever the method, and no stream comes into being."""
    assert raw_request(server, method, "/v1/stream/__ds/not-an-api/x") == 404
    assert client.head("/v1/stream/__ds").status_code == 400
    listed = client.get("/v1/streams", params={"prefix": "__ds/not-an-api"})
    assert listed.status_code == 200 and "not-an-api" not in listed.text


def test_double_encoded_path_is_a_literal_name(client: httpx.Client) -> None:
    """`%252e%252e` decodes once to the name `%2e%2e`: an ordinary stream, not a traversal."""
    name = f"literal-{time.time_ns()}-%252e%252e"
    assert client.put(f"/v1/stream/{name}", headers=TEXT).status_code == 201
    assert client.head(f"/v1/stream/{name}").status_code == 200


@pytest.fixture(scope="module")
def small_limits_server(start_server: Any) -> Any:
    return start_server(
        env={"DS_LIMITS__MAX_REQUEST_BYTES": "1024", "DS_LIMITS__MAX_STREAM_BYTES": "4096"}
    )


@pytest.fixture
def small_client(small_limits_server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small_limits_server.base_url, timeout=10) as http:
        yield http


def test_oversized_bodies_are_413(small_client: httpx.Client, stream_path: str) -> None:
    """Request bodies over DS_LIMITS__MAX_REQUEST_BYTES and appends past
    DS_LIMITS__MAX_STREAM_BYTES answer 413 and store nothing."""
    url = f"/v1/stream/{stream_path}"
    assert small_client.put(url, headers=TEXT, content=b"a" * 2000).status_code == 413
    assert small_client.head(url).status_code == 404
    assert small_client.put(url, headers=TEXT, content=b"a" * 1000).status_code == 201
    before = snapshot(small_client, url)
    assert small_client.post(url, headers=TEXT, content=b"b" * 1025).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap applies while reading
        for _ in range(20):
            yield b"c" * 100

    assert small_client.post(url, headers=TEXT, content=chunks()).status_code == 413
    assert snapshot(small_client, url) == before
    for _ in range(3):
        assert small_client.post(url, headers=TEXT, content=b"d" * 1000).status_code == 204
    full = snapshot(small_client, url)
    assert small_client.post(url, headers=TEXT, content=b"e" * 200).status_code == 413
    assert snapshot(small_client, url) == full
    assert len(full[3]) == 4000


def test_no_500_for_garbage_headers(client: httpx.Client, text_stream: str) -> None:
    """Odd but well-formed HTTP never produces a 500."""
    before = snapshot(client, text_stream)
    odd = [
        {"Stream-Seq": "\xff\xfe"},
        {"Stream-Closed": "maybe"},
        {"Content-Type": "text/plain; charset=\xff"},
        {"If-None-Match": '"' * 500},
        {"Producer-Id": "\xe9" * 300, "Producer-Epoch": "0", "Producer-Seq": "1"},
    ]
    for headers in odd:
        raw = {name: value.encode("latin-1") for name, value in (TEXT | headers).items()}
        response = client.post(text_stream, headers=raw, content=b"")
        assert 400 <= response.status_code < 500, (headers, response.status_code)
        raw_get = {name: value.encode("latin-1") for name, value in headers.items()}
        assert client.get(text_stream, headers=raw_get).status_code in (200, 304)
    assert snapshot(client, text_stream) == before


def test_content_type_whitespace_is_http_ows(client: httpx.Client, stream_path: str) -> None:
    """RFC 9110 5.6.3, PROTOCOL.md 5.2: space or tab before a parameter is optional whitespace,
    so a stream created as ``application/json<TAB>;charset=utf-8`` is a JSON stream that takes
    JSON appends (the store and the handlers once disagreed on what whitespace is: 409)."""
    url = f"/v1/stream/{stream_path}-ows"
    tabbed = {"Content-Type": "application/json\t;charset=utf-8"}
    assert client.put(url, headers=tabbed, content='[{"a":1}]').status_code == 201
    assert client.post(url, headers=JSON, content='{"b":2}').status_code == 204
    assert client.post(url, headers=tabbed, content='{"c":3}').status_code == 204
    assert client.get(url, params={"offset": "-1"}).json() == [{"a": 1}, {"b": 2}, {"c": 3}]


@pytest.mark.parametrize("space", ["\xa0", "\x85"])
def test_content_type_other_whitespace_is_malformed(
    client: httpx.Client, json_stream: str, stream_path: str, space: str
) -> None:
    """Only space and tab are whitespace in a Content-Type (RFC 9110 5.6.3): another blank
    before the parameters is a malformed type, a 400 on create and on append, never a 500."""
    raw = {"Content-Type": f"application/json{space};charset=utf-8".encode("latin-1")}
    url = f"/v1/stream/{stream_path}-blank"
    assert client.put(url, headers=raw, content="[1]").status_code == 400
    assert client.head(url).status_code == 404
    before = snapshot(client, json_stream)
    assert client.post(json_stream, headers=raw, content="1").status_code == 400
    assert snapshot(client, json_stream) == before
