"""Reads of large messages, in every read mode (PROTOCOL.md 5.6-5.8).

Streams whose messages average more than LARGE_MESSAGE_BYTES are read row by row, not
aggregated by PostgreSQL, and their messages reach the response as views of the database's
result rather than copies (streams/store/reads.py). Each message here is distinct, so a piece
lost, repeated, reordered or overwritten after its result was freed would show.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
import pytest

from streams.store.reads import LARGE_MESSAGE_BYTES
from tests.conftest import ServerProcess
from tests.retention.support import sse_events, url

MESSAGE_BYTES = 3 * LARGE_MESSAGE_BYTES + 17
COUNT = 40
# Catch-up responses of about ten messages: a read spans several responses.
CHUNK_BYTES = 10 * MESSAGE_BYTES


@pytest.fixture(scope="module")
def small_chunks(start_server: object) -> Iterator[ServerProcess]:
    server = start_server(env={"DS_READ__MAX_CHUNK_BYTES": str(CHUNK_BYTES)})  # type: ignore[operator]
    yield server
    server.stop()


@pytest.fixture
def client(small_chunks: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small_chunks.base_url, timeout=60) as http:
        yield http


def _binary(n: int) -> bytes:
    return bytes((n * 7 + i) % 251 for i in range(MESSAGE_BYTES))


def _text(n: int) -> str:
    return f"<{n:04d}>" + chr(ord("a") + n % 26) * (MESSAGE_BYTES - 6)


def _fill(client: httpx.Client, path: str, content_type: str, bodies: list[bytes]) -> list[str]:
    """Create the stream and append each body; the offsets after each append."""
    assert client.put(url(path), headers={"Content-Type": content_type}).status_code == 201
    offsets = []
    for body in bodies:
        response = client.post(url(path), content=body, headers={"Content-Type": content_type})
        assert response.status_code == 204, response.text
        offsets.append(response.headers["Stream-Next-Offset"])
    return offsets


def _catch_up(client: httpx.Client, path: str) -> tuple[bytes, int]:
    """Every response's body from -1 until up to date, joined; and how many responses."""
    offset, body, responses = "-1", b"", 0
    while True:
        response = client.get(url(path), params={"offset": offset})
        assert response.status_code == 200, response.text
        body += response.content
        responses += 1
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return body, responses


def test_large_binary_messages_in_every_read_mode(client: httpx.Client, stream_path: str) -> None:
    messages = [_binary(n) for n in range(COUNT)]
    offsets = _fill(client, stream_path, "application/octet-stream", messages)

    body, responses = _catch_up(client, stream_path)
    assert body == b"".join(messages)
    assert responses >= COUNT * MESSAGE_BYTES // CHUNK_BYTES

    polled = client.get(url(stream_path), params={"offset": offsets[4], "live": "long-poll"})
    assert polled.status_code == 200
    assert polled.content == b"".join(messages[5 : 5 + len(polled.content) // MESSAGE_BYTES])
    assert len(polled.content) >= MESSAGE_BYTES

    def up_to_date(events: list[tuple[str, str]]) -> bool:
        kind, data = events[-1]
        return kind == "control" and json.loads(data).get("upToDate") is True

    streamed = b""
    for events in sse_events(client, stream_path, "-1", until=up_to_date):
        streamed = b"".join(base64.b64decode(d) for kind, d in events if kind == "data")
    assert streamed == b"".join(messages)


def test_large_text_and_json_messages_read_back_exactly(
    client: httpx.Client, stream_path: str
) -> None:
    texts = [_text(n) for n in range(COUNT)]
    _fill(client, f"{stream_path}-text", "text/plain", [t.encode() for t in texts])
    body, _ = _catch_up(client, f"{stream_path}-text")
    assert body.decode() == "".join(texts)

    documents = [{"n": n, "text": _text(n)} for n in range(COUNT)]
    encoded = [json.dumps(d).encode() for d in documents]
    _fill(client, f"{stream_path}-json", "application/json", encoded)
    offset, items = "-1", []
    while True:
        response = client.get(url(f"{stream_path}-json"), params={"offset": offset})
        assert response.status_code == 200
        items.extend(response.json())
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            break
    assert items == documents


def test_writes_over_eight_mib_are_stored_exactly(client: httpx.Client, stream_path: str) -> None:
    """Creates and appends with more than 8 MiB of data run on the connections reserved for
    large writes (streams.store.pool): each is stored exactly, in order, with small appends
    between them, and a second create of the same content is the idempotent repeat."""
    big = [bytes([n]) * (8 * 1024 * 1024 + 1 + n) for n in range(3)]
    path = f"{stream_path}-big"
    headers = {"Content-Type": "application/octet-stream"}
    assert client.put(url(path), headers=headers, content=big[0]).status_code == 201
    assert client.put(url(path), headers=headers, content=big[0]).status_code == 200
    for body in (big[1], b"small", big[2]):
        assert client.post(url(path), headers=headers, content=body).status_code == 204
    body, _ = _catch_up(client, path)
    assert body == big[0] + big[1] + b"small" + big[2]
