"""What the retention tests share: streams written and read over HTTP, SSE events, and waiting
for a condition the server reaches in the background (a sweep, a purge)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import psycopg

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
BEGINNING = "0000000000000000_0000000000000000"
T = TypeVar("T")


def url(path: str) -> str:
    return f"/v1/stream/{path}"


def create(client: httpx.Client, path: str, headers: dict[str, str] | None = None) -> str:
    response = client.put(url(path), headers={**TEXT, **(headers or {})})
    assert response.status_code == 201, response.text
    return response.headers["Stream-Next-Offset"]


def append_all(client: httpx.Client, path: str, messages: list[str]) -> list[str]:
    """Append each message; the offsets where they start, then the tail: ``[o0, o1, ..., tail]``
    (message i is what lies between offsets i and i + 1)."""
    offsets = [head(client, path)["stream-next-offset"]]
    for message in messages:
        response = client.post(url(path), headers=TEXT, content=message)
        assert response.status_code == 204, response.text
        offsets.append(response.headers["Stream-Next-Offset"])
    return offsets


def head(client: httpx.Client, path: str) -> httpx.Headers:
    response = client.head(url(path))
    assert response.status_code == 200, response.status_code
    return response.headers


def start_of(client: httpx.Client, path: str) -> str:
    return head(client, path)["stream-start-offset"]


def trim(client: httpx.Client, path: str, before: str, **headers: str) -> httpx.Response:
    return client.post(url(path), headers={"Stream-Trim-Before": before, **headers})


def read_text(client: httpx.Client, path: str, offset: str = "-1") -> tuple[str, str]:
    """Catch-up reads from ``offset`` until up to date: (the text, the next offset)."""
    text = ""
    while True:
        response = client.get(url(path), params={"offset": offset})
        assert response.status_code == 200, (response.status_code, response.text)
        text += response.text
        offset = response.headers["Stream-Next-Offset"]
        if response.headers.get("Stream-Up-To-Date") == "true":
            return text, offset


def sse_events(
    client: httpx.Client, path: str, offset: str, *, until: Callable[[list[tuple[str, str]]], bool]
) -> Iterator[list[tuple[str, str]]]:
    """Read an SSE response, yielding the events so far (type, data) after each one; stops
    when ``until`` holds for them or the server ends the response."""
    params = {"offset": offset, "live": "sse"}
    with client.stream("GET", url(path), params=params) as response:
        assert response.status_code == 200, response.read()
        events: list[tuple[str, str]] = []
        kind, data = None, []
        for line in response.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:])
            elif line == "" and kind is not None:
                events.append((kind, "\n".join(data)))
                kind, data = None, []
                yield events
                if until(events):
                    return


def eventually(probe: Callable[[], T | None], *, what: str, within: float = 30.0) -> T:
    """Poll ``probe`` until it returns something (not None): for work the server does in the
    background. The bound only keeps a broken server from hanging the test."""
    deadline = time.monotonic() + within
    while True:
        result = probe()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def stored_seqs(pg: psycopg.Connection[Any], path: str, *, source: str | None = None) -> list[int]:
    """The seq of every message row stored under the stream at ``path`` (its own rows)."""
    rows = pg.execute(
        "SELECT m.seq FROM ds_message AS m JOIN ds_stream AS s ON s.id = m.stream_id"
        " WHERE s.path = %s ORDER BY m.seq",
        [source or path],
    ).fetchall()
    return [row[0] for row in rows]
