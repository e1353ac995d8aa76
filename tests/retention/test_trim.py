"""Explicit trims and reads of trimmed streams, through real HTTP (PROTOCOL.md 4: retention;
5.6: reads before the earliest retained position answer 410 Gone; 11.1: the trim and the
Stream-Start-Offset header are extensions, docs/gaps.md, Retention)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.access.support import bearer, create_key
from tests.conftest import ServerProcess, manage
from tests.retention.support import (
    BEGINNING,
    JSON,
    TEXT,
    append_all,
    create,
    eventually,
    head,
    read_text,
    sse_events,
    start_of,
    stored_seqs,
    trim,
    url,
)
from tests.state.support import append_ok, change, create_json_stream, register

MESSAGES = [f"m{i};" for i in range(10)]


@pytest.fixture
def trimmed(client: httpx.Client, stream_path: str) -> tuple[str, list[str]]:
    """A text stream of ten messages trimmed before the fourth: (path, offsets of all ten and
    the tail, as appended)."""
    create(client, stream_path)
    offsets = append_all(client, stream_path, MESSAGES)
    response = trim(client, stream_path, offsets[4])
    assert response.status_code == 204, response.text
    assert response.headers["Stream-Start-Offset"] == offsets[4]
    assert response.headers["Stream-Next-Offset"] == offsets[-1]
    return stream_path, offsets


def test_trim_keeps_offsets_and_reads_start_at_the_new_start(
    client: httpx.Client, trimmed: tuple[str, list[str]]
) -> None:
    """A trim drops what lies before its offset; -1 (and an omitted offset) now start there,
    and every retained message keeps the offset it had (PROTOCOL.md 8: offsets persist)."""
    path, offsets = trimmed
    assert start_of(client, path) == offsets[4]
    assert read_text(client, path) == ("".join(MESSAGES[4:]), offsets[-1])
    omitted = client.get(url(path))
    assert omitted.status_code == 200 and omitted.text == "".join(MESSAGES[4:])
    for i in range(4, 10):
        response = client.get(url(path), params={"offset": offsets[i]})
        assert response.status_code == 200
        assert response.text == "".join(MESSAGES[i:])
    # Appends go on after the trim, at the same tail.
    more = append_all(client, path, ["after;"])
    assert more[0] == offsets[-1]
    assert read_text(client, path, offsets[4])[0] == "".join(MESSAGES[4:]) + "after;"


@pytest.mark.parametrize("mode", [None, "long-poll", "sse"])
def test_reads_before_the_start_answer_410_with_the_start(
    client: httpx.Client, trimmed: tuple[str, list[str]], mode: str | None
) -> None:
    """PROTOCOL.md 5.6: an offset before the earliest retained position is 410 Gone, in every
    read mode (before an SSE response starts), with Stream-Start-Offset saying where the
    stream starts now; reading from there works."""
    path, offsets = trimmed
    for offset in (BEGINNING, offsets[1], offsets[3]):
        params = {"offset": offset} | ({"live": mode} if mode else {})
        response = client.get(url(path), params=params)
        assert response.status_code == 410, response.text
        assert response.headers["Stream-Start-Offset"] == offsets[4]
        assert "Stream-Start-Offset" in response.headers["Access-Control-Expose-Headers"]
    follow = client.get(url(path), params={"offset": offsets[4]})
    assert follow.status_code == 200 and follow.text == "".join(MESSAGES[4:])


def test_minus_one_starts_at_the_start_in_every_live_mode(
    client: httpx.Client, trimmed: tuple[str, list[str]]
) -> None:
    """PROTOCOL.md 8: -1 is the beginning of the stream, which after a trim is its earliest
    retained message, for long-poll and SSE too."""
    path, offsets = trimmed
    polled = client.get(url(path), params={"offset": "-1", "live": "long-poll"})
    assert polled.status_code == 200 and polled.text == "".join(MESSAGES[4:])
    assert polled.headers["Stream-Next-Offset"] == offsets[-1]
    events = list(sse_events(client, path, "-1", until=lambda e: len(e) >= 2))[-1]
    assert events[0] == ("data", "".join(MESSAGES[4:]))
    control = json.loads(events[1][1])
    assert control["streamNextOffset"] == offsets[-1] and control["upToDate"] is True


def test_trim_is_idempotent_and_trims_everything_with_now(
    client: httpx.Client, trimmed: tuple[str, list[str]]
) -> None:
    """A trim at or before the start changes nothing (204 with the current start); `now`
    drops everything so far, and the stream goes on from its tail."""
    path, offsets = trimmed
    for before in (offsets[4], offsets[2], BEGINNING):
        again = trim(client, path, before)
        assert again.status_code == 204
        assert again.headers["Stream-Start-Offset"] == offsets[4]
    everything = trim(client, path, "now")
    assert everything.status_code == 204
    assert everything.headers["Stream-Start-Offset"] == offsets[-1]
    empty = client.get(url(path), params={"offset": "-1"})
    assert empty.status_code == 200 and empty.text == ""
    assert empty.headers["Stream-Up-To-Date"] == "true"
    assert append_all(client, path, ["new;"])[0] == offsets[-1]
    assert read_text(client, path) == ("new;", head(client, path)["stream-next-offset"])


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Stream-Trim-Before": "12_34"}, 400),
        ({"Stream-Trim-Before": "-1"}, 400),
        ({"Stream-Trim-Before": ""}, 400),
        ({"Stream-Trim-Before": "0000000000000099_0000000000000999"}, 400),  # past the tail
        ({"Stream-Trim-Before": "0000000000000005_0000000000000011"}, 400),  # inside a message
        ({"Stream-Trim-Before": "now", "Stream-Closed": "true"}, 400),
        ({"Stream-Trim-Before": "now", "Producer-Id": "p"}, 400),
    ],
)
def test_bad_trims_are_refused_and_change_nothing(
    client: httpx.Client, trimmed: tuple[str, list[str]], headers: dict[str, str], status: int
) -> None:
    """Bad input gets a 4xx and changes nothing: malformed offsets, offsets that are not
    message boundaries, past the tail, a trim combined with an append or a close."""
    path, offsets = trimmed
    before = head(client, path)
    response = client.post(url(path), headers=headers)
    assert response.status_code == status, response.text
    after = head(client, path)
    assert after["stream-start-offset"] == before["stream-start-offset"] == offsets[4]
    assert after["stream-next-offset"] == before["stream-next-offset"]
    assert "stream-closed" not in after


def test_a_trim_with_a_body_is_refused(
    client: httpx.Client, trimmed: tuple[str, list[str]]
) -> None:
    path, offsets = trimmed
    response = client.post(
        url(path), headers={"Stream-Trim-Before": "now", "Content-Type": "text/plain"}, content="x"
    )
    assert response.status_code == 400
    assert start_of(client, path) == offsets[4]
    assert read_text(client, path)[0] == "".join(MESSAGES[4:])


def test_trims_of_missing_deleted_and_server_streams(
    client: httpx.Client, stream_path: str
) -> None:
    """A missing stream is 404, a soft-deleted one 410 (PROTOCOL.md 4.2), the registry is
    maintained by the server (403)."""
    assert trim(client, stream_path, "now").status_code == 404
    create(client, stream_path)
    fork = f"{stream_path}-fork"
    forked = client.put(url(fork), headers={"Stream-Forked-From": url(stream_path)})
    assert forked.status_code == 201
    assert client.delete(url(stream_path)).status_code == 204  # soft-deleted: a fork reads it
    assert trim(client, stream_path, "now").status_code == 410
    assert trim(client, "__registry__", "now").status_code == 403


def test_trimmed_rows_are_deleted(
    client: httpx.Client, trimmed: tuple[str, list[str]], pg: Any
) -> None:
    """Space comes back: the rows before the start are deleted after the trim (in the
    background), and only those."""
    path, _ = trimmed
    eventually(lambda: stored_seqs(pg, path) == list(range(4, 10)) or None, what="purge")


def test_json_streams_trim_at_message_boundaries(client: httpx.Client, stream_path: str) -> None:
    """JSON mode (PROTOCOL.md 9.1): a trim may fall between the messages of one append; reads
    start at the message, as a JSON array."""
    assert client.put(url(stream_path), headers=JSON).status_code == 201
    first = client.post(url(stream_path), headers=JSON, content=json.dumps([1, 2, 3]))
    client.post(url(stream_path), headers=JSON, content=json.dumps([{"a": 4}]))
    offsets = [first.headers["Stream-Next-Offset"]]
    # The second message of the first append starts one message and two bytes in ("1").
    second = "0000000000000001_0000000000000001"
    assert trim(client, stream_path, second).status_code == 204
    response = client.get(url(stream_path), params={"offset": "-1"})
    assert response.json() == [2, 3, {"a": 4}]
    assert client.get(url(stream_path), params={"offset": offsets[0]}).json() == [{"a": 4}]


def test_trim_renews_a_sliding_ttl_and_expired_streams_are_not_trimmed(
    client: httpx.Client, stream_path: str, pg: Any
) -> None:
    """PROTOCOL.md 5.1: a trim is a write and renews the TTL like one; an expired stream is
    gone for trims as for everything (404)."""
    create(client, stream_path, {"Stream-TTL": "3600"})
    offsets = append_all(client, stream_path, MESSAGES[:3])
    accessed = "SELECT accessed_at FROM ds_stream WHERE path = %s"
    before = pg.execute(accessed, [stream_path]).fetchone()[0]
    assert trim(client, stream_path, offsets[1]).status_code == 204
    assert pg.execute(accessed, [stream_path]).fetchone()[0] > before
    assert head(client, stream_path)["stream-ttl"] == "3600"
    expiring = f"{stream_path}-expiring"
    create(client, expiring, {"Stream-Expires-At": "2000-01-01T00:00:00Z"})
    assert trim(client, expiring, "now").status_code == 404


@pytest.fixture(scope="module")
def keys_server(start_server: Any) -> Iterator[ServerProcess]:
    server = start_server(env={"DS_AUTH__MODE": "keys"})
    yield server
    server.stop()


def test_trimming_needs_manage(keys_server: ServerProcess, database_url: str) -> None:
    """PROTOCOL.md 12.1, README (access control): a trim drops data, so it needs ``manage``
    on the stream; credentials without it are refused (401, 403) and nothing is trimmed."""
    path = f"trims/{time.time_ns()}"
    owner = bearer(create_key(database_url, "trim-owner", "stream/trims/:read,append,manage"))
    writer = bearer(create_key(database_url, "trim-writer", "stream/trims/:read,append"))
    with httpx.Client(base_url=keys_server.base_url, timeout=30) as client:
        assert client.put(url(path), headers=owner | TEXT).status_code == 201
        posted = client.post(url(path), headers=owner | TEXT, content="a;b;")
        tail = posted.headers["Stream-Next-Offset"]
        assert trim(client, path, tail).status_code == 401
        assert trim(client, path, tail, **writer).status_code == 403
        assert client.head(url(path), headers=owner).headers["Stream-Start-Offset"] == BEGINNING
        trimmed = trim(client, path, tail, **owner)
        assert trimmed.status_code == 204 and trimmed.headers["Stream-Start-Offset"] == tail


def test_a_registered_state_stream_is_not_trimmed(client: httpx.Client, stream_path: str) -> None:
    """Its readers, and any rebuild of its materialized state (a re-registration, ``manage.py
    materialize_state --rebuild``), need its whole history: a trim left the REST view with
    entities a rebuild then dropped without a word (found by a probe). A 409 now, nothing
    trimmed; the stream compacts instead (README, Retention). Unregistered, it trims."""
    create_json_stream(client, stream_path)
    append_ok(client, stream_path, [change("t", "a", 1), change("t", "b", 2)])
    tail = append_ok(client, stream_path, [change("t", "c", 3)])
    assert register(client, stream_path).status_code == 201
    start = start_of(client, stream_path)
    refused = trim(client, stream_path, tail)
    assert refused.status_code == 409, refused.text
    assert "keeps its whole history" in refused.text
    assert start_of(client, stream_path) == start
    read = client.get(url(stream_path), params={"offset": "-1"})
    assert [event["key"] for event in read.json()] == ["a", "b", "c"]
    assert client.delete(f"/v1/state/streams/{stream_path}").status_code == 204
    assert trim(client, stream_path, tail).status_code == 204


def test_a_rebuild_of_a_trimmed_state_stream_asks_before_dropping_state(
    client: httpx.Client, stream_path: str, database_url: str
) -> None:
    """Probe 10u: a state stream a client trimmed under an older version (which let them),
    rebuilt with ``materialize_state --rebuild``, kept only the entities of the events left:
    10 became 3, without a word. A stream whose start was trimmed (there, or before it was
    registered, as here) is rebuilt only when the operator says so."""
    create_json_stream(client, stream_path)
    tail = append_ok(client, stream_path, [change("t", "a", 1), change("t", "b", 2)])
    append_ok(client, stream_path, [change("t", "c", 3)])
    assert trim(client, stream_path, tail).status_code == 204
    assert register(client, stream_path).status_code == 201
    refused = manage(database_url, "materialize_state", "--stream", stream_path, "--rebuild")
    assert refused.returncode != 0
    assert "was trimmed" in refused.stderr, refused.stderr[-1000:]
    rebuilt = manage(
        database_url, "materialize_state", "--stream", stream_path, "--rebuild",
        "--allow-trimmed-history",
    )  # fmt: skip
    assert rebuilt.returncode == 0, rebuilt.stderr[-1000:]
    assert "1 events -> 1 entities" in rebuilt.stdout
