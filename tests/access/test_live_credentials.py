"""Credentials of live reads judged while the reads last (probe 7b): a key revoked, or a
signed URL expired, while its long-polls and SSE connections wait gets no data appended after
that; and the smaller leaks the same probe found around credentials (a signed URL's own rate
bucket, internal streams named through the state API).

Two server processes in ``keys`` mode, with a long-poll timeout long enough for a revocation
to happen while the long-polls wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest

from tests.access.support import bearer, create_key, key_id
from tests.conftest import ServerProcess

TEXT = {"Content-Type": "text/plain"}
MARKER = "after-the-revocation"


@pytest.fixture(scope="module")
def servers(start_server: Any) -> tuple[ServerProcess, ServerProcess]:
    env = {"DS_AUTH__MODE": "keys", "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "30"}
    return start_server(env=env), start_server(env=env)


@pytest.fixture(scope="module")
def admin(database_url: str, servers: Any) -> dict[str, str]:
    return bearer(create_key(database_url, "live-admin", ":read,append,manage"))


class Reader(threading.Thread):
    """One live read in the background: its status and everything it received, once it ends."""

    def __init__(self, url: str, live: str, headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.url, self.live, self.headers = url, live, headers
        self.status: int | None = None
        self.body = ""
        self.started_reading = threading.Event()

    def run(self) -> None:
        timeout = httpx.Timeout(5, read=40)
        with httpx.stream("GET", self.url, headers=self.headers, timeout=timeout) as response:
            self.status = response.status_code
            self.started_reading.set()
            for text in response.iter_text():
                self.body += text


def _readers(
    servers: Any, path: str, tail: str, headers: dict[str, str], url: Callable[[Any], str]
) -> list[Reader]:
    """An SSE connection and a long-poll at the tail on each process, waiting (``url``: the
    stream's URL on a process, which may have a query already)."""
    readers = []
    for server in servers:
        for live in ("sse", "long-poll"):
            base = url(server)
            query = f"offset={tail}&live={live}"
            reader = Reader(f"{base}{'&' if '?' in base else '?'}{query}", live, headers)
            reader.start()
            readers.append(reader)
    for reader in readers:
        if reader.live == "sse":
            assert reader.started_reading.wait(10)
            assert reader.status == 200
    time.sleep(0.5)  # the long-polls are waiting too
    return readers


def _new_stream(server: ServerProcess, admin: dict[str, str], prefix: str) -> tuple[str, str]:
    """A new text stream under ``prefix``: its path and its tail."""
    path = f"{prefix}/{time.time_ns()}"
    created = httpx.put(server.stream_url(path), headers=TEXT | admin, content="before ")
    assert created.status_code == 201
    return path, created.headers["Stream-Next-Offset"]


def _append_and_check(
    servers: Any, path: str, admin: dict[str, str], readers: list[Reader], refusal: str
) -> None:
    """Append the marker with another key; every reader ends without it, each long-poll
    refused (401, saying ``refusal``)."""
    first = servers[0]
    appended = httpx.post(first.stream_url(path), headers=TEXT | admin, content=MARKER)
    assert appended.status_code == 204
    for reader in readers:
        reader.join(20)
        assert not reader.is_alive(), f"{reader.live} still open after the marker"
        assert MARKER not in reader.body, reader.live
        if reader.live == "long-poll":
            assert reader.status == 401 and refusal in reader.body, reader.body


def test_a_revoked_key_gets_nothing_more_on_live_reads_it_holds(
    servers: Any, admin: dict[str, str], database_url: str
) -> None:
    """A key holds an SSE connection and a long-poll on each process; it is revoked; data
    appended afterwards reaches none of them: the SSE connections end, the long-polls answer
    401 (both got the data before)."""
    path, tail = _new_stream(servers[0], admin, "live-revoke")
    key = create_key(database_url, "live-reader", "stream/live-revoke/:read")
    readers = _readers(servers, path, tail, bearer(key), lambda server: server.stream_url(path))
    with psycopg.connect(database_url, autocommit=True) as db:
        db.execute("UPDATE ds_api_key SET revoked = true WHERE prefix = %s", (key_id(key),))
    # Every process has heard of it: new requests are refused.
    deadline = time.monotonic() + 5
    for server in servers:
        while httpx.head(server.stream_url(path), headers=bearer(key)).status_code != 401:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    _append_and_check(servers, path, admin, readers, "revoked")


def test_a_long_poll_whose_key_is_revoked_while_it_waits_is_refused_at_its_end(
    start_server: Any, database_url: str
) -> None:
    """A long-poll whose key was revoked while it waited, with nothing appended, answered 204
    at its timeout, telling the revoked key the stream's tail and that it was up to date (probe
    10h). It answers 401, as with data."""
    server = start_server(env={"DS_AUTH__MODE": "keys", "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "3"})
    owner = bearer(create_key(database_url, "quiet-owner", "stream/live-quiet/:read,append,manage"))
    path, tail = _new_stream(server, owner, "live-quiet")
    key = create_key(database_url, "quiet-reader", "stream/live-quiet/:read")
    reader = Reader(f"{server.stream_url(path)}?offset={tail}&live=long-poll", "long-poll",
                    bearer(key))  # fmt: skip
    reader.start()
    time.sleep(0.5)  # waiting
    with psycopg.connect(database_url, autocommit=True) as db:
        db.execute("UPDATE ds_api_key SET revoked = true WHERE prefix = %s", (key_id(key),))
    reader.join(20)
    assert reader.status == 401 and "revoked" in reader.body, (reader.status, reader.body)


def test_a_live_read_ends_when_its_signed_url_expires(
    servers: Any, admin: dict[str, str], database_url: str
) -> None:
    """An SSE connection and a long-poll opened with a signed URL that expires in 2 s: the SSE
    connection ends at the expiry, and data appended after it reaches neither (the long-poll
    answers 401)."""
    first = servers[0]
    path, tail = _new_stream(first, admin, "live-signed")
    key = create_key(database_url, "live-signer", "stream/live-signed/:read")
    minted = httpx.post(
        f"{first.base_url}/v1/auth/signed-urls",
        json={"stream": path, "expires_in": 2},
        headers=bearer(key),
    )
    assert minted.status_code == 201, minted.text
    signed = minted.json()["url"]
    expires = int(httpx.URL(signed).params["ds_expires"])
    readers = _readers(
        servers, path, tail, {}, lambda server: signed.replace(first.base_url, server.base_url)
    )
    time.sleep(max(0.0, expires - time.time()) + 0.5)
    sse = [reader for reader in readers if reader.live == "sse"]
    for reader in sse:  # ended at the expiry, before any append
        reader.join(10)
        assert not reader.is_alive()
    _append_and_check(servers, path, admin, readers, "expired")


def test_a_signed_url_counts_against_its_key_rate_limit(
    servers: Any, admin: dict[str, str], database_url: str
) -> None:
    """A key limited to 2 requests a second and a signed URL it minted share one bucket: the
    URL does not double what the key may do (it had a bucket of its own)."""
    first = servers[0]
    path = f"live-limited/{time.time_ns()}"
    assert httpx.put(first.stream_url(path), headers=TEXT | admin, content="x").status_code == 201
    key = create_key(
        database_url, "live-limited", "stream/live-limited/:read", extra=("--rate-limit", "2")
    )
    minted = httpx.post(
        f"{first.base_url}/v1/auth/signed-urls", json={"stream": path}, headers=bearer(key)
    )
    assert minted.status_code == 201, minted.text
    signed = minted.json()["url"]
    time.sleep(1.5)  # the bucket is full again (2)
    accepted = 0
    with httpx.Client(timeout=10) as http:
        started = time.monotonic()
        for n in range(20):
            if n % 2:
                response = http.get(first.stream_url(path), params={"offset": "-1"},
                                    headers=bearer(key))  # fmt: skip
            else:
                response = http.get(signed + "&offset=-1")
            assert response.status_code in (200, 429), response.text
            accepted += response.status_code == 200
        elapsed = time.monotonic() - started
    assert accepted <= 2 + 2 * elapsed + 1, (accepted, elapsed)


def test_internal_streams_cannot_be_named_through_the_state_api(
    servers: Any, admin: dict[str, str], database_url: str
) -> None:
    """A key for every stream but no Yjs grant could tell which Yjs documents exist: the state
    API's registration answered 409 (not JSON) for a document's internal stream and 404 for
    none. Paths under ``__ds`` are refused there (400) as on the stream endpoint, whether or
    not such a stream exists."""
    first = servers[0]
    doc = f"d{time.time_ns()}"
    made = httpx.put(f"{first.base_url}/v1/yjs/live/docs/{doc}", headers=admin)
    assert made.status_code == 201, made.text
    streams_only = bearer(create_key(database_url, "streams-only", "stream/:read,manage"))
    with httpx.Client(base_url=first.base_url, headers=streams_only, timeout=10) as http:
        answers = set()
        for name in (doc, f"{doc}-none"):
            internal = f"__ds/yjs/live/docs/{name}"
            register = http.post("/v1/state/streams", json={"stream": internal})
            detail = http.get(f"/v1/state/streams/{internal}")
            entities = http.get("/v1/state/entities", params={"stream": internal})
            answers.add((register.status_code, detail.status_code, entities.status_code))
            assert "reserved" in register.text, register.text
        assert answers == {(400, 400, 400)}


def test_key_changes_name_the_key_they_change(database_url: str, servers: Any) -> None:
    """Every change to a key or its grants is heard by every process as a change to that key
    (``auth:key:<prefix>``), so that only its live readers judge their credentials again (every
    change was ``auth:<table>``, and made every live reader of every key look its key up)."""
    key = create_key(database_url, "notified", "stream/notified/:read")
    prefix = key_id(key)
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN ds_streams")
        with psycopg.connect(database_url, autocommit=True) as db:
            db.execute("UPDATE ds_api_key SET revoked = true WHERE prefix = %s", (prefix,))
            db.execute(
                "UPDATE ds_api_grant SET read = false WHERE key_id LIKE %s", (f"{prefix}.%",)
            )
        heard = [
            note.payload
            for note in listener.notifies(timeout=2, stop_after=2)
            if note.payload.startswith("auth:")
        ]
    assert heard == [f"auth:key:{prefix}", f"auth:key:{prefix}"]


def test_in_open_mode_expiring_credentials_do_not_end_a_live_read(
    start_server: Any, database_url: str
) -> None:
    """In open mode everyone may read: a long-poll sent with a key that expires while it
    waits still gets the data appended afterwards (found by review: it answered 401, where a
    new request with the same key is served)."""
    server = start_server(env={"DS_AUTH__MODE": "open", "DS_SERVER__LONG_POLL_TIMEOUT_SECS": "30"})
    path = f"live-open/{time.time_ns()}"
    created = httpx.put(server.stream_url(path), headers=TEXT, content="before ")
    assert created.status_code == 201
    key = create_key(database_url, "open-brief", "stream/:read", extra=("--expires-in", "2"))
    (reader,) = _readers([server], path, created.headers["Stream-Next-Offset"], bearer(key),
                         lambda s: s.stream_url(path))[1:]  # fmt: skip
    time.sleep(2.5)
    assert httpx.post(server.stream_url(path), headers=TEXT, content=MARKER).status_code == 204
    reader.join(20)
    assert reader.status == 200 and reader.body == MARKER, (reader.status, reader.body)
