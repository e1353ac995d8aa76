"""The Yjs endpoint over real HTTP (YJS-PROTOCOL.md): documents, reads, awareness, deletion,
errors, path validation, refused closes and per-service secrets. Snapshots and compaction are
in test_yjs_compaction.py.

Every test starts from documents of its own (unique paths under a service of this module), and
checks answers against the spec and what is stored against what was written.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest

from tests.yjs.support import (
    OCTET,
    UNMERGEABLE_UPDATES,
    Writer,
    assert_error,
    content_of,
    doc_url,
    frame,
    frames,
    location_offset,
    post_ok,
    raw_request,
    read_all,
    read_frames,
    sse_events,
    tail_of,
    unique,
    wait_for,
)

# The most updates one POST may hold (yjs.updates.MAX_UPDATES).
MAX_UPDATES = 1_000
LONG_POLL_SECS = 2.0
SERVICE = unique("svc")
ALLOWED = {"GET", "HEAD", "POST", "PUT", "DELETE"}


@pytest.fixture(scope="module")
def yjs(start_server: Any) -> Any:
    """A server of this module with a short long-poll, so timeouts are quick to observe."""
    return start_server(env={"DS_SERVER__LONG_POLL_TIMEOUT_SECS": str(LONG_POLL_SECS)})


@pytest.fixture
def http(yjs: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=yjs.base_url, timeout=15) as client:
        yield client


@dataclass
class DocRef:
    service: str
    path: str

    @property
    def url(self) -> str:
        return doc_url(self.service, self.path)

    @property
    def awareness_prefix(self) -> str:
        return f"__ds/yjs/{self.service}/awareness/{self.path}/"


@pytest.fixture
def new_doc(request: pytest.FixtureRequest) -> DocRef:
    """A document path no one has used (not created)."""
    return DocRef(SERVICE, f"tests/{unique(request.node.name)}")


@pytest.fixture
def doc(http: httpx.Client, new_doc: DocRef) -> DocRef:
    """A created, empty document."""
    assert http.put(new_doc.url).status_code == 201
    return new_doc


def stored_streams(pg: psycopg.Connection[Any], prefix: str) -> list[str]:
    rows = pg.execute(
        "SELECT path FROM ds_stream WHERE starts_with(path, %s) ORDER BY path", (prefix,)
    ).fetchall()
    return [path for (path,) in rows]


def state(http: httpx.Client, url: str, **params: str) -> tuple[str, bytes]:
    """(tail, every stored byte) of a document or awareness stream."""
    body, next_offset = read_all(http, url, **params)
    assert next_offset == tail_of(http, url, **params)
    return next_offset, body


def producer(pid: str, epoch: int, seq: int) -> dict[str, str]:
    return {**OCTET, "Producer-Id": pid, "Producer-Epoch": str(epoch), "Producer-Seq": str(seq)}


# -- 5.1 Create document --------------------------------------------------------------------


def test_put_creates_document_then_answers_200(http: httpx.Client, new_doc: DocRef) -> None:
    """5.1: 201 with Location and Stream-Next-Offset; an existing document answers 200 with
    its current tail."""
    created = http.put(new_doc.url)
    assert created.status_code == 201, created.text
    location = httpx.URL(str(created.request.url)).join(created.headers["Location"])
    assert location.path == new_doc.url
    empty_tail = created.headers["Stream-Next-Offset"]
    assert empty_tail

    again = http.put(new_doc.url)
    assert again.status_code == 200, again.text
    assert again.headers["Stream-Next-Offset"] == empty_tail

    next_offset = post_ok(http, new_doc.url, frame(Writer().edit("hello")))
    assert next_offset != empty_tail
    third = http.put(new_doc.url)
    assert third.status_code == 200
    assert third.headers["Stream-Next-Offset"] == next_offset
    assert read_all(http, new_doc.url)[1] == next_offset  # PUT again kept the content


def test_put_creates_default_awareness_stream(http: httpx.Client, new_doc: DocRef) -> None:
    """5.1, 5.8, A.1.3 awareness.created-with-doc: PUT of a document also creates
    ?awareness=default."""
    assert_error(http.head(new_doc.url, params={"awareness": "default"}), 404)
    assert http.put(new_doc.url).status_code == 201
    head = http.head(new_doc.url, params={"awareness": "default"})
    assert head.status_code == 200
    assert head.headers["Content-Type"] == "application/octet-stream"
    assert http.put(new_doc.url, params={"awareness": "default"}).status_code == 200


def test_document_paths_with_slashes(http: httpx.Client, new_doc: DocRef) -> None:
    """4, A.1.2 doc.path-with-slashes: hierarchical paths are documents of their own; a parent
    path is a different document."""
    parent = new_doc.url
    child = f"{parent}/chapter-1/v1.2_draft"
    assert http.put(child).status_code == 201
    assert_error(http.get(parent, params={"offset": "-1"}), 404, "DOCUMENT_NOT_FOUND")

    writer = Writer()
    update = writer.edit("chapter one")
    post_ok(http, child, frame(update))
    assert read_all(http, child)[0] == frame(update)

    assert http.put(parent).status_code == 201
    assert read_all(http, parent)[0] == b""
    post_ok(http, parent, frame(Writer().edit("parent")))
    assert read_all(http, child)[0] == frame(update)


# -- 5.5 Write update, 7 Binary framing ----------------------------------------------------------


def test_post_appends_and_returns_next_offset(http: httpx.Client, doc: DocRef) -> None:
    """5.5, A.1.2 write.returns-offset / write.appends-to-stream / updates.read-from-offset:
    204 with Stream-Next-Offset, growing with each POST; reading from an offset returns what
    came after it."""
    writer = Writer()
    start = tail_of(http, doc.url)
    bodies = [frame(writer.edit(f"part {i} ")) for i in range(4)]
    offsets = []
    for body in bodies:
        response = http.post(doc.url, headers=OCTET, content=body)
        assert response.status_code == 204, response.text
        assert response.content == b""
        offsets.append(response.headers["Stream-Next-Offset"])
    assert [start, *offsets] == sorted({start, *offsets})  # strictly increasing
    assert tail_of(http, doc.url) == offsets[-1]
    for index, offset in enumerate(offsets):
        rest, _ = read_all(http, doc.url, offset)
        assert rest == b"".join(bodies[index + 1 :])
    assert content_of(*read_frames(read_all(http, doc.url)[0])) == writer.content


def test_several_frames_in_one_post(http: httpx.Client, doc: DocRef) -> None:
    """7.2, A.1.2 write.rapid-batched-updates: a body may carry several framed updates; they
    are stored and returned as sent. One update is over 127 bytes, so its length prefix takes
    two bytes (7.1)."""
    writer = Writer()
    updates = [writer.edit("a"), writer.edit("b" * 300), writer.edit("c")]
    assert len(updates[1]) > 127
    body = frames(*updates)
    assert body[len(frame(updates[0])) + 1] & 0x80 == 0  # second byte of the 2-byte prefix
    post_ok(http, doc.url, body)
    stored, _ = read_all(http, doc.url)
    assert stored == body
    assert read_frames(stored) == updates
    assert content_of(*updates) == writer.content == "a" + "b" * 300 + "c"


def test_large_update_and_large_garbage(http: httpx.Client, doc: DocRef) -> None:
    """5.5, 7.1: an update of over 64 KiB (a 3-byte length prefix) is accepted and returned as
    sent; framed garbage of that size is still refused with 400 INVALID_REQUEST."""
    writer = Writer()
    update = writer.edit("L" * 100_000)
    body = frame(update)
    assert len(update) >= 2**16 and body[2] & 0x80 == 0 and body[1] & 0x80
    post_ok(http, doc.url, body)
    before = state(http, doc.url)
    assert before[1] == body
    garbage = frame(b"\x05" + b"\xff" * 100_000)
    assert_error(http.post(doc.url, headers=OCTET, content=garbage), 400, "INVALID_REQUEST")
    assert state(http, doc.url) == before
    assert content_of(*read_frames(before[1])) == writer.content


def test_multiple_rapid_bursts(http: httpx.Client, doc: DocRef) -> None:
    """A.1.2 write.multiple-rapid-bursts: bursts of batched writes from two clients, all stored
    in order and merging to the same document."""
    alice, bob = Writer(client_id=1), Writer(client_id=2)
    sent: list[bytes] = []
    for burst in range(5):
        for author in (alice, bob):
            batch = [author.edit(f"{burst}{i}") for i in range(3)]
            post_ok(http, doc.url, frames(*batch))
            sent.extend(batch)
    stored = read_frames(read_all(http, doc.url)[0])
    assert stored == sent
    merged = content_of(*stored)
    assert sorted(merged) == sorted(alice.content + bob.content)


def test_idempotent_producer(http: httpx.Client, doc: DocRef) -> None:
    """5.5 with PROTOCOL.md 5.2.1 producers: new data 200, a duplicate 204 (stored once), a
    stale epoch 403 with Producer-Epoch, a sequence gap 409 with the expected and received
    sequence numbers; refusals store nothing."""
    writer = Writer()
    first, second, third = (frame(writer.edit(s)) for s in ("one ", "two ", "three "))

    new = http.post(doc.url, headers=producer("p", 0, 0), content=first)
    assert new.status_code == 200, new.text
    assert (new.headers["Producer-Epoch"], new.headers["Producer-Seq"]) == ("0", "0")
    after_first = new.headers["Stream-Next-Offset"]

    duplicate = http.post(doc.url, headers=producer("p", 0, 0), content=first)
    assert duplicate.status_code == 204, duplicate.text
    assert duplicate.headers["Stream-Next-Offset"] == after_first

    assert http.post(doc.url, headers=producer("p", 0, 1), content=second).status_code == 200
    bumped = http.post(doc.url, headers=producer("p", 1, 0), content=third)
    assert bumped.status_code == 200, bumped.text
    before = state(http, doc.url)

    stale = http.post(doc.url, headers=producer("p", 0, 2), content=frame(writer.edit("x")))
    assert_error(stale, 403)
    assert stale.headers["Producer-Epoch"] == "1"

    gap = http.post(doc.url, headers=producer("p", 1, 5), content=frame(writer.edit("y")))
    assert_error(gap, 409)
    assert gap.headers["Producer-Expected-Seq"] == "1"
    assert gap.headers["Producer-Received-Seq"] == "5"

    assert state(http, doc.url) == before
    assert before[1] == first + second + third


def test_post_to_missing_document(http: httpx.Client, new_doc: DocRef) -> None:
    """5.5, A.1.2 write.requires-put: POST before PUT is 404 DOCUMENT_NOT_FOUND and creates
    nothing."""
    response = http.post(new_doc.url, headers=OCTET, content=frame(Writer().edit("x")))
    assert_error(response, 404, "DOCUMENT_NOT_FOUND")
    assert_error(http.head(new_doc.url), 404)
    with_producer = http.post(
        new_doc.url, headers=producer("p", 0, 0), content=frame(Writer().edit("x"))
    )
    assert_error(with_producer, 404, "DOCUMENT_NOT_FOUND")
    assert_error(http.get(new_doc.url, params={"offset": "-1"}), 404, "DOCUMENT_NOT_FOUND")


def _bad_bodies() -> dict[str, bytes]:
    update = Writer(client_id=7).edit("hello")
    try:
        read_frames(update)
        raise AssertionError("the raw update happens to parse as frames; pick another")
    except ValueError:
        pass
    return {
        "empty": b"",
        "unframed-update": update,
        "truncated": frame(update)[:-1],
        "prefix-only": b"\x85",
        "truncated-prefix": frame(b"x" * 200)[:1],
        "length-past-end": b"\x10abc",
        "valid-then-truncated": frame(update) + frame(update)[:-2],
        "framed-text": frame(b"hello world"),
        "framed-ff": frame(b"\xff\xff\xff\xff"),
        "framed-empty": frame(b""),
        "valid-then-garbage": frame(update) + frame(b"\x01\x01\x01\x01\x01"),
    }


BAD_BODIES = _bad_bodies()


@pytest.mark.parametrize("case", BAD_BODIES)
def test_refused_update_bodies(http: httpx.Client, doc: DocRef, case: str) -> None:
    """5.5, 7.2, 10, A.1.6 error.invalid-request: a body that is not complete lib0 frames, or
    whose frames are not Yjs updates, is 400 INVALID_REQUEST and nothing is stored (not even
    the valid frames before a bad one)."""
    post_ok(http, doc.url, frame(Writer().edit("kept")))
    before = state(http, doc.url)
    response = http.post(doc.url, headers=OCTET, content=BAD_BODIES[case])
    assert_error(response, 400, "INVALID_REQUEST")
    assert state(http, doc.url) == before


def test_refused_body_does_not_consume_producer_seq(http: httpx.Client, doc: DocRef) -> None:
    """5.5 with producers: a refused body leaves the producer's sequence where it was."""
    garbage = http.post(doc.url, headers=producer("p", 0, 0), content=frame(b"garbage!"))
    assert_error(garbage, 400, "INVALID_REQUEST")
    update = frame(Writer().edit("good"))
    accepted = http.post(doc.url, headers=producer("p", 0, 0), content=update)
    assert accepted.status_code == 200, accepted.text
    assert read_all(http, doc.url)[0] == update


def _refused_bodies_of_any_document() -> dict[str, bytes]:
    """Bodies a POST to an existing document refuses, for any reason of the body."""
    update = Writer(client_id=9).edit("fine")
    return {
        **BAD_BODIES,
        **{f"unmergeable-{name}": frame(crafted) for name, crafted in UNMERGEABLE_UPDATES.items()},
        "large-garbage": frame(b"\x05" + b"\xff" * 100_000),
        "large-unframed": b"\xff" * 100_000,
        "many-valid-then-garbage": frames(*[update] * 8) + frame(b"garbage"),
        "too-many-updates": b"\x00" * (MAX_UPDATES + 1),
    }


REFUSED_BODIES = _refused_bodies_of_any_document()


@pytest.mark.parametrize("case", REFUSED_BODIES)
@pytest.mark.parametrize("missing", ["never-created", "deleted"])
def test_post_to_missing_document_is_404_whatever_the_body(
    http: httpx.Client, new_doc: DocRef, pg: psycopg.Connection[Any], missing: str, case: str
) -> None:
    """5.5 ("If the document does not exist, the server MUST return 404"), A.1.7
    delete.doc-then-post-returns-404: the base protocol's precedence (docs/gaps.md), existence
    before the body: a POST to a document that does not exist, or was deleted, is 404
    DOCUMENT_NOT_FOUND for every body an existing document refuses (400 or 413), and
    creates nothing."""
    body = REFUSED_BODIES[case]
    if missing == "deleted":
        assert http.put(new_doc.url).status_code == 201
        assert http.delete(new_doc.url).status_code == 204
    else:  # the same body to an existing document is refused for what it is
        other = DocRef(new_doc.service, f"tests/{unique('existing')}")
        assert http.put(other.url).status_code == 201
        refused = http.post(other.url, headers=OCTET, content=body)
        assert refused.status_code in (400, 413), refused.status_code
    response = http.post(new_doc.url, headers=OCTET, content=body)
    assert_error(response, 404, "DOCUMENT_NOT_FOUND")
    with_producer = http.post(new_doc.url, headers=producer("p", 0, 0), content=body)
    assert_error(with_producer, 404, "DOCUMENT_NOT_FOUND")
    assert stored_streams(pg, f"__ds/yjs/{new_doc.service}/docs/{new_doc.path}") == []
    assert stored_streams(pg, new_doc.awareness_prefix) == []


def test_too_many_updates_in_one_body_is_413(http: httpx.Client, doc: DocRef) -> None:
    """11 ("implementation decisions"): one body holds at most MAX_UPDATES updates (checking
    each costs tens of microseconds); more is 413 PAYLOAD_TOO_LARGE and stores nothing, while
    a body of many valid updates below it is stored as sent."""
    writer = Writer()
    body = frames(*(writer.edit("y") for _ in range(300)))
    post_ok(http, doc.url, body)
    before = state(http, doc.url)
    assert content_of(*read_frames(before[1])) == "y" * 300
    response = http.post(doc.url, headers=OCTET, content=b"\x00" * (MAX_UPDATES + 1))
    assert_error(response, 413, "PAYLOAD_TOO_LARGE")
    assert state(http, doc.url) == before


# -- 5.4 Read updates ---------------------------------------------------------------------------


def test_catch_up_returns_frames_byte_for_byte(http: httpx.Client, doc: DocRef) -> None:
    """5.4, 7.3, A.1.2 updates.read-from-beginning: offset=-1 returns every stored frame as it
    was sent, as application/octet-stream, up to date at the last POST's offset."""
    writer = Writer()
    bodies = [
        frame(writer.edit("x")),
        frames(writer.edit("y" * 200), writer.edit("z")),
        frame(writer.edit("\u00e9\u4e2d")),
    ]
    last = ""
    for body in bodies:
        last = post_ok(http, doc.url, body)
    response = http.get(doc.url, params={"offset": "-1"})
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/octet-stream"
    assert response.headers["Stream-Up-To-Date"] == "true"
    assert response.headers["Stream-Next-Offset"] == last
    assert response.content == b"".join(bodies)
    assert content_of(*read_frames(response.content)) == writer.content

    at_tail = http.get(doc.url, params={"offset": last})
    assert at_tail.status_code == 200
    assert at_tail.content == b""
    assert at_tail.headers["Stream-Up-To-Date"] == "true"


def test_new_document_reads_empty(http: httpx.Client, doc: DocRef) -> None:
    """9.2: a new document reads as an empty body with a Stream-Next-Offset."""
    response = http.get(doc.url, params={"offset": "-1"})
    assert response.status_code == 200
    assert response.content == b""
    assert response.headers["Stream-Next-Offset"] == tail_of(http, doc.url)


def _later_post(base_url: str, url: str, body: bytes, delay: float, **params: str) -> str:
    time.sleep(delay)
    with httpx.Client(base_url=base_url, timeout=15) as other:
        return post_ok(other, url, body, **params)


def test_long_poll_receives_a_later_update(yjs: Any, http: httpx.Client, doc: DocRef) -> None:
    """5.4 long-poll, A.1.2 updates.live-long-poll: a long-poll at the tail waits and returns
    the update written meanwhile."""
    old = frame(Writer().edit("old"))
    tail = post_ok(http, doc.url, old)
    new = frame(Writer().edit("new"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        posted = pool.submit(_later_post, yjs.base_url, doc.url, new, 0.3)
        response = http.get(doc.url, params={"offset": tail, "live": "long-poll"})
        elapsed = time.monotonic() - started
        next_offset = posted.result()
    assert response.status_code == 200, response.text
    assert elapsed >= 0.25
    assert response.content == new
    assert response.headers["Stream-Next-Offset"] == next_offset


def test_long_poll_timeout_is_204_up_to_date(http: httpx.Client, doc: DocRef) -> None:
    """5.4, A.1.2 updates.live-timeout: with no new data the long-poll ends after the timeout
    with 204, Stream-Next-Offset and Stream-Up-To-Date: true."""
    tail = post_ok(http, doc.url, frame(Writer().edit("only")))
    started = time.monotonic()
    response = http.get(doc.url, params={"offset": tail, "live": "long-poll"})
    elapsed = time.monotonic() - started
    assert response.status_code == 204, response.text
    assert response.content == b""
    assert response.headers["Stream-Up-To-Date"] == "true"
    assert response.headers["Stream-Next-Offset"] == tail
    assert LONG_POLL_SECS * 0.9 <= elapsed < LONG_POLL_SECS + 5


def test_sse_delivers_base64_frames(yjs: Any, http: httpx.Client, doc: DocRef) -> None:
    """5.4 SSE, A.1.2 updates.live-sse, PROTOCOL.md 5.8: data events are base64 (announced by
    stream-sse-data-encoding) and decode to the stored frames, history first, then an update
    written while connected."""
    writer = Writer()
    history = frames(writer.edit("one"), writer.edit("two"))
    tail = post_ok(http, doc.url, history)
    later = frame(writer.edit("three" * 40))
    with http.stream("GET", doc.url, params={"offset": "-1", "live": "sse"}) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["stream-sse-data-encoding"] == "base64"
        events = sse_events(response.iter_lines())
        first = next(events)
        assert first.payload == history
        control = next(events).control
        assert control["streamNextOffset"] == tail
        assert control.get("upToDate") is True

        next_offset = _later_post(yjs.base_url, doc.url, later, 0.0)
        second = next(events)
        assert second.payload == later
        assert next(events).control["streamNextOffset"] == next_offset
    assert content_of(*read_frames(history + later)) == writer.content


def test_head_document(http: httpx.Client, doc: DocRef, new_doc: DocRef) -> None:
    """5: HEAD gives the tail without a body, and no Stream-Closed; missing documents 404."""
    tail = post_ok(http, doc.url, frame(Writer().edit("x")))
    head = http.head(doc.url)
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["Stream-Next-Offset"] == tail
    assert head.headers["Content-Type"] == "application/octet-stream"
    assert "Stream-Closed" not in head.headers
    assert "Stream-TTL" not in head.headers  # documents do not expire; awareness does
    missing = DocRef(doc.service, f"{doc.path}-missing")
    assert_error(http.head(missing.url), 404)


@pytest.mark.parametrize("method", ["PATCH", "PROPFIND", "TRACE", "COPY"])
@pytest.mark.parametrize("awareness", [None, "default"])
def test_other_methods_are_405(
    http: httpx.Client, doc: DocRef, method: str, awareness: str | None
) -> None:
    """5, A.1.5 method.doc-rejects-patch / method.awareness-rejects-patch: any other method is
    405 with Allow and the JSON error body; nothing changes."""
    params = {"awareness": awareness} if awareness else {}
    post_ok(http, doc.url, frame(Writer().edit("x")), **params)
    before = state(http, doc.url, **params)
    response = http.request(method, doc.url, params=params, headers=OCTET, content=b"\x01\x00")
    assert_error(response, 405)
    allowed = {m.strip() for m in response.headers["Allow"].split(",")}
    assert allowed >= ALLOWED
    assert method not in allowed
    assert state(http, doc.url, **params) == before


# -- 5.6-5.8, 5.10 Awareness ----------------------------------------------------------------------


def test_awareness_put_creates_then_answers_200(http: httpx.Client, doc: DocRef) -> None:
    """5.8, A.1.3 awareness.put-creates-stream / put-idempotent / awareness.write: 201, then
    200; a POST then answers 204 with Stream-Next-Offset, and the update reads back."""
    params = {"awareness": "cursors"}
    assert_error(http.get(doc.url, params={**params, "offset": "-1"}), 404, "STREAM_NOT_FOUND")
    assert http.put(doc.url, params=params).status_code == 201
    assert http.put(doc.url, params=params).status_code == 200
    update = frame(b"\x01\x02cursor at 5")
    response = http.post(doc.url, params=params, headers=OCTET, content=update)
    assert response.status_code == 204, response.text
    assert response.headers["Stream-Next-Offset"]
    assert read_all(http, doc.url, **params)[0] == update


def test_awareness_put_requires_document(
    http: httpx.Client, new_doc: DocRef, pg: psycopg.Connection[Any]
) -> None:
    """5.8, A.1.3 awareness.put-requires-doc: 404 DOCUMENT_NOT_FOUND, nothing created."""
    response = http.put(new_doc.url, params={"awareness": "cursors"})
    assert_error(response, 404, "DOCUMENT_NOT_FOUND")
    assert stored_streams(pg, new_doc.awareness_prefix) == []
    assert_error(http.head(new_doc.url), 404)


def test_awareness_post_auto_creates(
    http: httpx.Client, doc: DocRef, pg: psycopg.Connection[Any]
) -> None:
    """5.7, A.1.3 awareness.post-auto-creates: POST to an awareness stream that does not exist
    creates it when the document exists."""
    params = {"awareness": "presence"}
    assert_error(http.head(doc.url, params=params), 404)
    update = frame(b"presence: online")
    post_ok(http, doc.url, update, **params)
    assert http.head(doc.url, params=params).status_code == 200
    assert read_all(http, doc.url, **params)[0] == update
    assert f"{doc.awareness_prefix}presence" in stored_streams(pg, doc.awareness_prefix)


def test_awareness_post_without_document(
    http: httpx.Client, new_doc: DocRef, pg: psycopg.Connection[Any]
) -> None:
    """5.7: auto-creation needs the document: 404 DOCUMENT_NOT_FOUND, nothing created."""
    for name in ("default", "presence"):
        response = http.post(
            new_doc.url, params={"awareness": name}, headers=OCTET, content=frame(b"hi")
        )
        assert_error(response, 404, "DOCUMENT_NOT_FOUND")
    assert stored_streams(pg, new_doc.awareness_prefix) == []
    assert_error(http.head(new_doc.url), 404)


def test_awareness_concurrent_auto_create(yjs: Any, http: httpx.Client, doc: DocRef) -> None:
    """A.1.3 awareness.post-concurrent: concurrent POSTs to a stream that does not exist yet
    all succeed, and every update is kept."""
    updates = [frame(f"client {i}".encode()) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        offsets = list(
            pool.map(
                lambda body: _later_post(yjs.base_url, doc.url, body, 0.0, awareness="burst"),
                updates,
            )
        )
    assert len(set(offsets)) == len(updates)
    stored = read_frames(read_all(http, doc.url, awareness="burst")[0])
    assert sorted(stored) == sorted(read_frames(b"".join(updates)))


def test_awareness_bytes_pass_through(http: httpx.Client, doc: DocRef) -> None:
    """7.3, 7.4, 12.4: awareness updates are pass-through bytes the server does not interpret:
    whatever a client POSTs is stored and returned exactly as sent, lib0 frames or not (the
    clients validate what they read). Only an empty body is refused."""
    params = {"awareness": "default"}
    bodies = [
        frames(b"\xff\xfe not yjs", b""),
        b"\x10abc",  # a frame that runs past the end
        b"\x85",  # a cut-off length prefix
        b"plain text, not framed",
        bytes(range(256)) * 300,  # over 64 KiB
    ]
    for body in bodies:
        post_ok(http, doc.url, body, **params)
    tail, stored = state(http, doc.url, **params)
    assert stored == b"".join(bodies)
    assert_error(http.post(doc.url, params=params, headers=OCTET, content=b""), 400)
    assert state(http, doc.url, **params) == (tail, stored)
    # Auto-created streams take anything too (5.7).
    post_ok(http, doc.url, b"\x85", awareness="fresh")
    assert read_all(http, doc.url, awareness="fresh")[0] == b"\x85"


def test_awareness_post_without_document_is_404_whatever_the_body(
    http: httpx.Client, new_doc: DocRef, pg: psycopg.Connection[Any]
) -> None:
    """5.7, 10: an awareness POST for a document that does not exist is 404
    DOCUMENT_NOT_FOUND, with any body, the empty one included."""
    for body in (b"\x85", b"", frame(b"hi")):
        response = http.post(
            new_doc.url, params={"awareness": "default"}, headers=OCTET, content=body
        )
        assert_error(response, 404, "DOCUMENT_NOT_FOUND")
    assert stored_streams(pg, new_doc.awareness_prefix) == []


def test_named_awareness_streams_are_separate(http: httpx.Client, doc: DocRef) -> None:
    """5.6, A.1.3 awareness.named-streams / named-separate / default-stream: each name is a
    stream of its own, separate from the document and from other documents' streams."""
    other = DocRef(doc.service, f"{doc.path}-other")
    assert http.put(other.url).status_code == 201
    bodies = {
        (doc.url, "default"): frame(b"doc default"),
        (doc.url, "cursors"): frame(b"doc cursors"),
        (doc.url, "presence"): frame(b"doc presence"),
        (other.url, "cursors"): frame(b"other cursors"),
    }
    for (url, name), body in bodies.items():
        post_ok(http, url, body, awareness=name)
    for (url, name), body in bodies.items():
        assert read_all(http, url, awareness=name)[0] == body
    assert read_all(http, doc.url)[0] == b""
    assert read_all(http, other.url, awareness="default")[0] == b""


def test_awareness_offset_now_long_poll(yjs: Any, http: httpx.Client, doc: DocRef) -> None:
    """5.6, A.1.3 awareness.offset-now / awareness.live-long-poll: offset=now skips history and
    the long-poll returns the broadcast made while waiting."""
    params = {"awareness": "default"}
    post_ok(http, doc.url, frame(b"old state"), **params)
    fresh = frame(b"new state")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        posted = pool.submit(_later_post, yjs.base_url, doc.url, fresh, 0.3, **params)
        response = http.get(doc.url, params={**params, "offset": "now", "live": "long-poll"})
        next_offset = posted.result()
    assert response.status_code == 200, response.text
    assert response.content == fresh
    assert response.headers["Stream-Next-Offset"] == next_offset


def test_awareness_offset_now_long_poll_times_out(http: httpx.Client, doc: DocRef) -> None:
    """5.6, 5.4: offset=now with nothing new: 204 up to date, no history."""
    params = {"awareness": "default"}
    tail = post_ok(http, doc.url, frame(b"old state"), **params)
    response = http.get(doc.url, params={**params, "offset": "now", "live": "long-poll"})
    assert response.status_code == 204
    assert response.content == b""
    assert response.headers["Stream-Up-To-Date"] == "true"
    assert response.headers["Stream-Next-Offset"] == tail


def test_awareness_offset_now_sse(yjs: Any, http: httpx.Client, doc: DocRef) -> None:
    """5.6, A.1.3 awareness.live-sse / awareness.broadcast / awareness.sse-control-events: an
    SSE subscriber at offset=now gets no history, a control event with streamNextOffset and
    streamCursor, then the broadcast as base64 data."""
    params = {"awareness": "cursors"}
    assert http.put(doc.url, params=params).status_code == 201
    tail = post_ok(http, doc.url, frame(b"history"), **params)
    fresh = frame(b"cursor moved")
    query = {**params, "offset": "now", "live": "sse"}
    with http.stream("GET", doc.url, params=query) as response:
        assert response.status_code == 200
        assert response.headers["stream-sse-data-encoding"] == "base64"
        events = sse_events(response.iter_lines())
        first = next(events)
        assert first.kind == "control", first
        assert first.control["streamNextOffset"] == tail
        assert first.control["streamCursor"]
        assert first.control.get("upToDate") is True
        next_offset = _later_post(yjs.base_url, doc.url, fresh, 0.0, **params)
        data = next(events)
        assert data.payload == fresh
        control = next(events).control
        assert control["streamNextOffset"] == next_offset
        assert control["streamCursor"]


@pytest.mark.parametrize("name", ["default", "cursors"])
def test_awareness_stream_ttl(http: httpx.Client, doc: DocRef, name: str) -> None:
    """3.2, 11, A.1.3 awareness.ttl: awareness streams have a 1 hour TTL."""
    if name != "default":
        assert http.put(doc.url, params={"awareness": name}).status_code == 201
    head = http.head(doc.url, params={"awareness": name})
    assert head.status_code == 200
    assert head.headers["Stream-TTL"] == "3600"


@pytest.mark.parametrize(
    "name", ["a b", "a/b", "", "x" * 65, "caf\u00e9", "a?b", "../default", " default"]
)
@pytest.mark.parametrize("method", ["GET", "PUT", "POST", "DELETE"])
def test_invalid_awareness_names(
    http: httpx.Client, doc: DocRef, pg: psycopg.Connection[Any], name: str, method: str
) -> None:
    """5.6, 10: an awareness name that is not a plain name is 400 INVALID_REQUEST, for every
    method, and creates nothing."""
    before = stored_streams(pg, doc.awareness_prefix)
    params = {"awareness": name, "offset": "-1"} if method == "GET" else {"awareness": name}
    body = frame(b"x") if method == "POST" else None
    response = http.request(method, doc.url, params=params, headers=OCTET, content=body)
    assert_error(response, 400, "INVALID_REQUEST")
    assert stored_streams(pg, doc.awareness_prefix) == before


def test_awareness_name_of_64_characters_is_fine(http: httpx.Client, doc: DocRef) -> None:
    """5.6: the longest accepted name (the counterpart of the too-long case above)."""
    name = "n" * 64
    assert http.put(doc.url, params={"awareness": name}).status_code == 201
    post_ok(http, doc.url, frame(b"x"), awareness=name)


def test_get_missing_awareness_stream(http: httpx.Client, doc: DocRef) -> None:
    """10: reading an awareness stream that does not exist is 404 STREAM_NOT_FOUND."""
    for live in (None, "long-poll", "sse"):
        params = {"awareness": "nobody", "offset": "-1"} | ({"live": live} if live else {})
        assert_error(http.get(doc.url, params=params), 404, "STREAM_NOT_FOUND")


def test_delete_awareness_stream(http: httpx.Client, doc: DocRef) -> None:
    """5.10, A.1.7 delete.awareness-returns-204 / returns-404 / preserves-document."""
    update = frame(Writer().edit("doc text"))
    post_ok(http, doc.url, update)
    doc_before = state(http, doc.url)
    post_ok(http, doc.url, frame(b"cursor"), awareness="cursors")
    post_ok(http, doc.url, frame(b"presence"), awareness="default")

    response = http.delete(doc.url, params={"awareness": "cursors"})
    assert response.status_code == 204, response.text
    assert_error(http.head(doc.url, params={"awareness": "cursors"}), 404)
    gone = http.get(doc.url, params={"awareness": "cursors", "offset": "-1"})
    assert_error(gone, 404, "STREAM_NOT_FOUND")
    again = http.delete(doc.url, params={"awareness": "cursors"})
    assert_error(again, 404, "STREAM_NOT_FOUND")

    assert state(http, doc.url) == doc_before
    assert read_all(http, doc.url, awareness="default")[0] == frame(b"presence")
    post_ok(http, doc.url, frame(Writer().edit("more")))
    # Deleting the default stream leaves the document too; a POST brings the stream back.
    assert http.delete(doc.url, params={"awareness": "default"}).status_code == 204
    assert http.head(doc.url).status_code == 200
    post_ok(http, doc.url, frame(b"back"), awareness="default")
    assert read_all(http, doc.url, awareness="default")[0] == frame(b"back")


def test_awareness_post_recovers_after_ttl_expiry(start_server: Any, new_doc: DocRef) -> None:
    """5.7, A.1.3 awareness.post-ttl-recovery: once the awareness stream has expired (a 3 s
    TTL on this server) reads find nothing, a POST re-creates it, and the document (no TTL)
    is unaffected."""
    server = start_server(env={"YJS_AWARENESS_TTL_SECS": "3"})
    with httpx.Client(base_url=server.base_url, timeout=15) as client:
        assert client.put(new_doc.url).status_code == 201
        assert (
            client.head(new_doc.url, params={"awareness": "default"}).headers["Stream-TTL"] == "3"
        )
        update = frame(Writer().edit("durable"))
        post_ok(client, new_doc.url, update)
        wait_for(
            lambda: (
                True
                if client.head(new_doc.url, params={"awareness": "default"}).status_code == 404
                else None
            ),
            timeout=10,
            what="the awareness stream to expire",
        )
        post_ok(client, new_doc.url, frame(b"back again"), awareness="default")
        assert read_all(client, new_doc.url, awareness="default")[0] == frame(b"back again")
        assert read_all(client, new_doc.url)[0] == update


# -- 5.9 Delete document ------------------------------------------------------------------------


def test_delete_document_removes_everything(
    http: httpx.Client, doc: DocRef, pg: psycopg.Connection[Any]
) -> None:
    """5.9, A.1.7 delete.doc-returns-204 / then-get / then-post / cascades-awareness /
    awareness-post-requires-document: afterwards every operation but PUT of the document is a
    404, and the awareness streams and the document row are gone from the database."""
    post_ok(http, doc.url, frame(Writer().edit("text")))
    post_ok(http, doc.url, frame(b"cursor"), awareness="cursors")
    post_ok(http, doc.url, frame(b"here"), awareness="default")
    assert stored_streams(pg, doc.awareness_prefix) == [
        f"{doc.awareness_prefix}cursors",
        f"{doc.awareness_prefix}default",
    ]

    response = http.delete(doc.url)
    assert response.status_code == 204, response.text

    assert_error(http.get(doc.url, params={"offset": "-1"}), 404, "DOCUMENT_NOT_FOUND")
    for live in ("long-poll", "sse"):
        read = http.get(doc.url, params={"offset": "-1", "live": live})
        assert_error(read, 404, "DOCUMENT_NOT_FOUND")
    assert_error(http.get(doc.url, params={"offset": "snapshot"}), 404, "DOCUMENT_NOT_FOUND")
    assert_error(http.head(doc.url), 404)
    post = http.post(doc.url, headers=OCTET, content=frame(Writer().edit("late")))
    assert_error(post, 404, "DOCUMENT_NOT_FOUND")
    assert_error(http.delete(doc.url), 404, "DOCUMENT_NOT_FOUND")
    for name in ("default", "cursors"):
        params = {"awareness": name}
        read = http.get(doc.url, params={**params, "offset": "-1"})
        assert assert_error(read, 404) in ("DOCUMENT_NOT_FOUND", "STREAM_NOT_FOUND")
        assert_error(http.head(doc.url, params=params), 404)
        write = http.post(doc.url, params=params, headers=OCTET, content=frame(b"x"))
        assert_error(write, 404, "DOCUMENT_NOT_FOUND")
        assert_error(http.put(doc.url, params=params), 404, "DOCUMENT_NOT_FOUND")
        deleted = http.delete(doc.url, params=params)
        assert assert_error(deleted, 404) in ("DOCUMENT_NOT_FOUND", "STREAM_NOT_FOUND")

    assert stored_streams(pg, doc.awareness_prefix) == []
    assert stored_streams(pg, f"__ds/yjs/{doc.service}/docs/{doc.path}") == []
    rows = pg.execute(
        "SELECT count(*) FROM yjs_document WHERE service = %s AND path = %s",
        (doc.service, doc.path),
    ).fetchone()
    assert rows == (0,)


def test_delete_missing_document(http: httpx.Client, new_doc: DocRef) -> None:
    """5.9, A.1.7 delete.doc-returns-404: 404 DOCUMENT_NOT_FOUND."""
    assert_error(http.delete(new_doc.url), 404, "DOCUMENT_NOT_FOUND")


def test_put_after_delete_creates_a_fresh_document(http: httpx.Client, doc: DocRef) -> None:
    """5.9, A.1.7 delete.doc-then-put-creates-fresh: PUT after DELETE is 201 and the document
    is empty, with a new default awareness stream and none of the old named ones."""
    post_ok(http, doc.url, frame(Writer().edit("old text")))
    post_ok(http, doc.url, frame(b"old cursor"), awareness="cursors")
    post_ok(http, doc.url, frame(b"old presence"), awareness="default")
    assert http.delete(doc.url).status_code == 204

    again = http.put(doc.url)
    assert again.status_code == 201, again.text
    assert read_all(http, doc.url)[0] == b""
    redirect = http.get(doc.url, params={"offset": "snapshot"})
    assert location_offset(redirect, doc.url) == "-1"
    assert read_all(http, doc.url, awareness="default")[0] == b""
    assert_error(http.head(doc.url, params={"awareness": "cursors"}), 404)

    writer = Writer()
    post_ok(http, doc.url, frame(writer.edit("new text")))
    assert content_of(*read_frames(read_all(http, doc.url)[0])) == "new text"


def test_delete_parent_document_keeps_child_documents(
    http: httpx.Client, doc: DocRef, pg: psycopg.Connection[Any]
) -> None:
    """5.9 with 4 (paths with slashes): deleting ``a`` leaves ``a/b`` and its awareness
    streams alone, though their internal paths share a prefix."""
    child = DocRef(doc.service, f"{doc.path}/child")
    assert http.put(child.url).status_code == 201
    child_update = frame(Writer().edit("child"))
    post_ok(http, child.url, child_update)
    post_ok(http, child.url, frame(b"child cursor"), awareness="cursors")
    post_ok(http, doc.url, frame(b"parent cursor"), awareness="cursors")

    assert http.delete(doc.url).status_code == 204
    assert read_all(http, child.url)[0] == child_update
    assert read_all(http, child.url, awareness="cursors")[0] == frame(b"child cursor")
    assert http.head(child.url, params={"awareness": "default"}).status_code == 200
    assert stored_streams(pg, child.awareness_prefix) == [
        f"{child.awareness_prefix}cursors",
        f"{child.awareness_prefix}default",
    ]
    # What is left under the parent's prefix is exactly the child's streams.
    assert stored_streams(pg, doc.awareness_prefix) == stored_streams(pg, child.awareness_prefix)


# -- 12.2 Path traversal ---------------------------------------------------------------------------

BAD_PATHS = [
    "a/../b",
    "../b",
    "a/..",
    "..",
    ".",
    "a/./b",
    "a/.",
    "a/%2e%2e/b",
    "a/%2E%2E",
    "%2e%2e",
    "%2E",
    "a/%2e/b",
    "a/.%2e/b",
    "a/%2E./b",
    "a//b",
    "a/",
    "/a",
    "",
    "a/%2F/b",
    "a%2F%2Fb",
    "a%20b",
    "a~b",
    "a:b",
    "a@b",
    "a%00b",
    "a%0Ab",
    "%C3%A9t%C3%A9",
    "a%ffb",
    "a*b",
    "x" * 129,
    "/".join(["y" * 100] * 6),
]


@pytest.mark.parametrize("method", ["PUT", "GET", "POST"])
@pytest.mark.parametrize("path", BAD_PATHS)
def test_invalid_document_paths(
    yjs: Any, pg: psycopg.Connection[Any], path: str, method: str
) -> None:
    """12.2, 10: dot segments (also percent-encoded), empty segments and characters outside
    letters, digits, '_', '-', '.' are 400 INVALID_REQUEST; nothing is created."""
    service = unique("paths")
    target = f"/v1/yjs/{service}/docs/{path}"
    if method == "GET":
        target += "?offset=-1"
    status, headers, body = raw_request(yjs.port, method, target, OCTET)
    assert status == 400, (target, status, body)
    assert headers["content-type"].startswith("application/json")
    error = httpx.Response(status, content=body).json()["error"]
    assert error["code"] == "INVALID_REQUEST" and error["message"]
    assert stored_streams(pg, f"__ds/yjs/{service}/") == []


@pytest.mark.parametrize(
    "target",
    [
        "/v1/yjs/a%20b/docs/x",
        "/v1/yjs/../docs/x",
        "/v1/yjs/svc/doc/x",
        "/v1/yjs/svc",
        "/v1/yjs/svc/docs",
        "/v1/yjs//docs/x",
        "/v1/yjs/" + "s" * 65 + "/docs/x",
    ],
)
def test_invalid_service_or_route(yjs: Any, target: str) -> None:
    """4, 10: a URL that does not name a service and a document is 400 INVALID_REQUEST."""
    status, _, body = raw_request(yjs.port, "PUT", target)
    assert status == 400, (target, status, body)
    assert httpx.Response(status, content=body).json()["error"]["code"] == "INVALID_REQUEST"


def test_longest_valid_paths(http: httpx.Client) -> None:
    """12.2: the counterparts of the too-long cases: a 128-character segment and a long
    hierarchical path are documents."""
    base = f"tests/{unique('long')}"
    for path in (f"{base}/{'s' * 128}", f"{base}/{'/'.join(['d' * 60] * 6)}", f"{base}/..."):
        url = doc_url(SERVICE, path)
        assert http.put(url).status_code == 201, path
        post_ok(http, url, frame(Writer().edit("x")))


def test_internal_streams_are_not_reachable_through_the_stream_endpoint(
    http: httpx.Client, doc: DocRef
) -> None:
    """Single URL design (4) and PROTOCOL.md 6: the streams behind a document live under the
    reserved ``__ds/`` prefix, which belongs to the control APIs (subscriptions), never to the
    base endpoint: there it is no API (404), so no one can close or rewrite a document behind
    the Yjs endpoint's back."""
    post_ok(http, doc.url, frame(Writer().edit("x")))
    before = state(http, doc.url)
    internal = f"/v1/stream/__ds/yjs/{doc.service}/docs/{doc.path}"
    assert http.post(internal, headers={**OCTET, "Stream-Closed": "true"}).status_code == 404
    assert http.delete(internal).status_code == 404
    assert http.get(internal, params={"offset": "-1"}).status_code == 404
    assert state(http, doc.url) == before


# -- Refused closes --------------------------------------------------------------------------------


@pytest.mark.parametrize("with_producer", [False, True])
@pytest.mark.parametrize("awareness", [None, "default"])
def test_close_is_refused_and_changes_nothing(
    http: httpx.Client, doc: DocRef, with_producer: bool, awareness: str | None
) -> None:
    """5.5, 5.7, 10: documents and awareness streams are never closed. A departing client's
    empty POST with Stream-Closed: true gets a clear 4xx; the stream stays open (HEAD has no
    Stream-Closed), its content and tail are unchanged, the producer's next sequence number
    is still free, and later writes and reads work."""
    params = {"awareness": awareness} if awareness else {}
    writer = Writer()
    first = frame(writer.edit("first "))
    headers = producer("leaver", 0, 0) if with_producer else OCTET
    accepted = http.post(doc.url, params=params, headers=headers, content=first)
    assert accepted.status_code == (200 if with_producer else 204), accepted.text
    before = state(http, doc.url, **params)

    close_headers = {**(producer("leaver", 0, 1) if with_producer else {}), "Stream-Closed": "true"}
    close = http.post(doc.url, params=params, headers=close_headers)
    assert 400 <= close.status_code < 500, close.status_code
    assert_error(close, close.status_code)
    assert "Stream-Closed" not in close.headers

    head = http.head(doc.url, params=params)
    assert head.status_code == 200
    assert "Stream-Closed" not in head.headers
    assert state(http, doc.url, **params) == before

    second = frame(writer.edit("second"))
    headers = producer("leaver", 0, 1) if with_producer else OCTET
    later = http.post(doc.url, params=params, headers=headers, content=second)
    assert later.status_code == (200 if with_producer else 204), later.text
    assert "Stream-Closed" not in later.headers
    assert read_all(http, doc.url, **params)[0] == first + second
    if not awareness:
        assert content_of(*read_frames(first + second)) == "first second"


def test_close_with_a_body_is_refused_too(http: httpx.Client, doc: DocRef) -> None:
    """5.5: a final update sent with Stream-Closed: true is refused whole (not stored, not
    closed), so the client can resend it without the header."""
    update = frame(Writer().edit("last words"))
    before = state(http, doc.url)
    close = http.post(doc.url, headers={**OCTET, "Stream-Closed": "true"}, content=update)
    assert 400 <= close.status_code < 500
    assert_error(close, close.status_code)
    assert state(http, doc.url) == before
    assert "Stream-Closed" not in http.head(doc.url).headers
    post_ok(http, doc.url, update)


@pytest.mark.parametrize(
    ("deleted", "awareness", "with_producer"),
    [(True, None, False), (True, "default", False), (False, None, True)],
    ids=["deleted-document", "deleted-document-awareness", "never-created-with-producer"],
)
def test_close_on_a_missing_document_is_404(
    http: httpx.Client, new_doc: DocRef, deleted: bool, awareness: str | None, with_producer: bool
) -> None:
    """5.5 ("If the document does not exist, the server MUST return 404"), 5.7 (auto-creation
    needs the document) and 5.9 ("After deletion, all operations on the document and its
    awareness URLs MUST return 404"): a departing client's close, a well-formed base-protocol
    request, on a document that does not exist (any more) is a 404, like any other POST."""
    if deleted:
        assert http.put(new_doc.url).status_code == 201
        assert http.delete(new_doc.url).status_code == 204
    params = {"awareness": awareness} if awareness else {}
    headers = {**(producer("leaver", 0, 0) if with_producer else {}), "Stream-Closed": "true"}
    close = http.post(new_doc.url, params=params, headers=headers)
    assert_error(close, 404, "DOCUMENT_NOT_FOUND")
    assert_error(http.head(new_doc.url), 404)


def test_put_with_stream_closed_does_not_create_a_closed_document(
    http: httpx.Client, new_doc: DocRef
) -> None:
    """5.1: a document is created open whatever the PUT carries, so it can be written."""
    created = http.put(new_doc.url, headers={"Stream-Closed": "true"})
    assert created.status_code in (201, 400), created.text
    if created.status_code == 400:
        assert_error(created, 400, "INVALID_REQUEST")
        assert http.put(new_doc.url).status_code == 201
    assert "Stream-Closed" not in http.head(new_doc.url).headers
    post_ok(http, new_doc.url, frame(Writer().edit("writable")))


# -- 12.1 Per-service secrets ----------------------------------------------------------------------

SECRET = "s3cret-token"


@pytest.fixture(scope="module")
def locked(start_server: Any) -> Any:
    """A server where service ``locked`` needs a bearer secret and ``other`` another one."""
    return start_server(env={"YJS_SERVICE_SECRETS": f"locked={SECRET},other=x-other"})


BAD_AUTH = {
    "none": {},
    "wrong": {"Authorization": "Bearer nope"},
    "other-service-secret": {"Authorization": "Bearer x-other"},
    "not-bearer": {"Authorization": f"Basic {SECRET}"},
    "bare-secret": {"Authorization": SECRET},
    "prefix-of-secret": {"Authorization": f"Bearer {SECRET[:-1]}"},
}


@pytest.mark.parametrize("auth", BAD_AUTH)
def test_missing_or_wrong_secret_is_401(
    locked: Any, pg: psycopg.Connection[Any], auth: str
) -> None:
    """12.1, 10, A.1.6 error.unauthorized: without the service's secret every operation (on the
    document and its awareness) is 401 UNAUTHORIZED and changes nothing."""
    good = {"Authorization": f"Bearer {SECRET}"}
    bad = BAD_AUTH[auth]
    path = f"tests/{unique('auth')}"
    url = doc_url("locked", path)
    missing = doc_url("locked", f"{path}-never")
    with httpx.Client(base_url=locked.base_url, timeout=15) as client:
        assert client.put(url, headers=good).status_code == 201
        update = frame(Writer().edit("secret text"))
        response = client.post(url, headers={**good, **OCTET}, content=update)
        assert response.status_code == 204, response.text
        tail = response.headers["Stream-Next-Offset"]

        requests = [
            ("PUT", missing, {}),
            ("PUT", url, {}),
            ("GET", url, {"offset": "-1"}),
            ("GET", url, {"offset": "-1", "live": "long-poll"}),
            ("GET", url, {"offset": "snapshot"}),
            ("HEAD", url, {}),
            ("POST", url, {}),
            ("DELETE", url, {}),
            ("PUT", url, {"awareness": "cursors"}),
            ("GET", url, {"awareness": "default", "offset": "-1"}),
            ("POST", url, {"awareness": "default"}),
            ("DELETE", url, {"awareness": "default"}),
        ]
        for method, target, params in requests:
            body = frame(Writer().edit("intruder")) if method == "POST" else None
            answer = client.request(
                method, target, params=params, headers={**bad, **OCTET}, content=body
            )
            assert_error(answer, 401, "UNAUTHORIZED")

        check = client.get(url, params={"offset": "-1"}, headers=good)
        assert check.status_code == 200
        assert check.content == update
        assert check.headers["Stream-Next-Offset"] == tail
        assert client.head(url, params={"awareness": "default"}, headers=good).status_code == 200
    assert stored_streams(pg, f"__ds/yjs/locked/docs/{path}-never") == []
    assert stored_streams(pg, f"__ds/yjs/locked/awareness/{path}/cursors") == []


def test_right_secret_works_normally(locked: Any) -> None:
    """12.1: with ``Authorization: Bearer <secret>`` the protocol works as usual."""
    good = {"Authorization": f"Bearer {SECRET}"}
    url = doc_url("locked", f"tests/{unique('auth-ok')}")
    writer = Writer()
    with httpx.Client(base_url=locked.base_url, timeout=15, headers=good) as client:
        assert client.put(url).status_code == 201
        update = frame(writer.edit("hello"))
        post_ok(client, url, update)
        assert read_all(client, url)[0] == update
        assert location_offset(client.get(url, params={"offset": "snapshot"}), url) == "-1"
        post_ok(client, url, frame(b"cursor"), awareness="default")
        assert read_all(client, url, awareness="default")[0] == frame(b"cursor")
        assert client.delete(url).status_code == 204


def test_services_without_a_secret_are_open(locked: Any) -> None:
    """12.1: the secret of one service does not guard the others."""
    url = doc_url("open", f"tests/{unique('open')}")
    with httpx.Client(base_url=locked.base_url, timeout=15) as client:
        assert client.put(url).status_code == 201
        post_ok(client, url, frame(Writer().edit("public")))
        assert client.get(url, params={"offset": "-1"}).status_code == 200
        with_other = client.put(url, headers={"Authorization": "Bearer whatever"})
        assert with_other.status_code == 200


# -- Request body limit ----------------------------------------------------------------------------

BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def limited(start_server: Any) -> Any:
    """A server whose request bodies may hold at most BODY_LIMIT bytes."""
    return start_server(env={"DS_LIMITS__MAX_REQUEST_BYTES": str(BODY_LIMIT)})


def test_request_body_limit_bounds_awareness_and_updates(limited: Any) -> None:
    """12.4, README (DS_LIMITS__MAX_REQUEST_BYTES): awareness bytes pass through unchecked,
    but within the request body limit: one byte over it is 413 PAYLOAD_TOO_LARGE and stores
    nothing; a body of exactly the limit is stored. Document updates are bounded the same."""
    url = doc_url(SERVICE, f"tests/{unique('limited')}")
    params = {"awareness": "default"}
    with httpx.Client(base_url=limited.base_url, timeout=15) as client:
        assert client.put(url).status_code == 201
        over = client.post(url, params=params, headers=OCTET, content=b"\x85" * (BODY_LIMIT + 1))
        assert_error(over, 413, "PAYLOAD_TOO_LARGE")
        assert read_all(client, url, **params)[0] == b""
        post_ok(client, url, b"\x85" * BODY_LIMIT, **params)
        assert read_all(client, url, **params)[0] == b"\x85" * BODY_LIMIT

        update = frame(Writer().edit("z" * BODY_LIMIT))
        assert len(update) > BODY_LIMIT
        assert_error(client.post(url, headers=OCTET, content=update), 413, "PAYLOAD_TOO_LARGE")
        assert read_all(client, url)[0] == b""


def test_an_update_of_another_content_type_is_refused_and_changes_nothing(
    http: httpx.Client, doc: DocRef, new_doc: DocRef
) -> None:
    """5.5: a document's updates are bytes; another content type is the base protocol's 409
    (404 without the document), and nothing is stored."""
    update = frame(Writer().edit("typed"))
    wrong = {"Content-Type": "text/plain"}
    assert_error(http.post(doc.url, content=update, headers=wrong), 409)
    assert read_all(http, doc.url)[0] == b""
    missing = DocRef(SERVICE, f"{new_doc.path}-missing")
    assert_error(http.post(missing.url, content=update, headers=wrong), 404, "DOCUMENT_NOT_FOUND")
    assert http.post(doc.url, content=update, headers=OCTET).status_code == 204
