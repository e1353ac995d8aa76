"""Live reads on a path whose stream was deleted and created again (PROTOCOL.md 5.7, 5.8).

A server process remembers the stream id of each path it read lately, and a live read
subscribes to that stream's changes before its first statement (streams.services.reads). These
tests read a path (so its id is remembered), delete the stream and create another at the same
path, and read it live again: the answers must be the new stream's, and a reader waiting on it
must be woken by the new stream's appends (a long-poll must not wait out its timeout, 2 s on
test servers). The test server is one process, so the second read meets the remembered id.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from tests.retention.support import sse_events

TEXT = {"Content-Type": "text/plain"}


def _url(path: str) -> str:
    return f"/v1/stream/{path}"


def _create(client: httpx.Client, path: str, body: bytes = b"") -> str:
    created = client.put(_url(path), content=body, headers=TEXT)
    assert created.status_code == 201, created.text
    return created.headers["Stream-Next-Offset"]


def _replace(client: httpx.Client, path: str, body: bytes) -> str:
    """Read the path's stream (its id is remembered), delete it, create another there."""
    read = client.get(_url(path), params={"offset": "-1", "live": "long-poll"})
    assert read.status_code == 200
    assert client.delete(_url(path)).status_code == 204
    return _create(client, path, body)


def test_a_long_poll_reads_the_stream_created_again_at_its_path(
    client: httpx.Client, stream_path: str
) -> None:
    _create(client, stream_path, b"first stream")
    _replace(client, stream_path, b"second")

    again = client.get(_url(stream_path), params={"offset": "-1", "live": "long-poll"})

    assert again.status_code == 200
    assert again.content == b"second"


def test_an_offset_of_the_old_stream_is_judged_against_the_new_one(
    client: httpx.Client, stream_path: str
) -> None:
    old_tail = _create(client, stream_path, b"a longer first stream")
    _replace(client, stream_path, b"short")

    beyond = client.get(_url(stream_path), params={"offset": old_tail, "live": "long-poll"})

    assert beyond.status_code == 400


def _append_while(client: httpx.Client, path: str, reader: threading.Thread) -> int:
    """Append "+" every 0.2 s while ``reader`` runs (for at most 15 s): whichever append came
    after the reader's tail should wake it, however late its request reached the server. A
    reader that is never woken ends on its own (a long-poll's timeout) or is still waiting
    at the end. Returns how many were appended."""
    appended = 0
    deadline = time.monotonic() + 15
    with httpx.Client(base_url=client.base_url, timeout=30) as writer:
        while reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
            done = writer.post(_url(path), content=b"+", headers=TEXT)
            assert done.status_code in (200, 204)
            appended += 1
    return appended


def test_a_long_poll_at_the_tail_is_woken_by_the_new_streams_appends(
    client: httpx.Client, stream_path: str
) -> None:
    _create(client, stream_path, b"old")
    tail = _replace(client, stream_path, b"new")
    answer: dict[str, Any] = {}

    def long_poll() -> None:
        response = client.get(_url(stream_path), params={"offset": "now", "live": "long-poll"})
        answer["status"], answer["body"] = response.status_code, response.content

    waiting = threading.Thread(target=long_poll)
    waiting.start()
    appended = _append_while(client, stream_path, waiting)
    waiting.join(30)

    assert answer["status"] == 200, answer
    assert answer["body"].startswith(b"+")
    after = client.get(_url(stream_path), params={"offset": tail})
    assert after.content == b"+" * appended


def test_an_sse_reader_follows_the_stream_created_again_at_its_path(
    client: httpx.Client, stream_path: str
) -> None:
    _create(client, stream_path, b"old")
    _replace(client, stream_path, b"new")
    seen: list[str] = []

    def follow() -> None:
        with httpx.Client(base_url=client.base_url, timeout=30) as reader:
            for events in sse_events(
                reader, stream_path, "-1", until=lambda got: "+" in got[-1][1]
            ):
                seen[:] = [data for kind, data in events if kind == "data"]

    reading = threading.Thread(target=follow, daemon=True)
    reading.start()
    _append_while(client, stream_path, reading)
    reading.join(10)

    assert not reading.is_alive(), f"the SSE reader was never woken: {seen}"
    assert seen[0].startswith("new")
    assert "+" in seen[-1]
