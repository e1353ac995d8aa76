"""Snapshots and compaction over real HTTP (YJS-PROTOCOL.md 5.2, 5.3, 8, 9.2), and the
``compact_yjs`` management command.

The server here compacts past THRESHOLD bytes of updates (lowered from 1 MiB, as 8.1 allows).
Every check of content syncs like a client (9.2): discover, read the snapshot, read the updates
from its Stream-Next-Offset, apply them to a fresh Y.Doc, and compare with the writer's doc.
"""

from __future__ import annotations

import concurrent.futures
import html
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb
from pycrdt import Doc, Text

from tests.conftest import admin_session, command_env, manage
from tests.yjs.support import (
    COMPACTION_THRESHOLD,
    OCTET,
    UNMERGEABLE_PAIRS,
    UNMERGEABLE_UPDATES,
    Writer,
    assert_error,
    compaction_counts,
    content_of,
    doc_url,
    frame,
    location_offset,
    offset_after_snapshot,
    post_ok,
    read_all,
    read_frames,
    unique,
    wait_for,
)

THRESHOLD = COMPACTION_THRESHOLD
SERVICE = unique("compact")
COMPACTION_WAIT_SECS = 15.0
CHUNK = "0123456789" * 10  # each edit's update is a little over 100 bytes


@pytest.fixture(scope="module")
def compacting(compacting_servers: tuple[Any, Any]) -> Any:
    return compacting_servers[0]


@pytest.fixture
def http(compacting: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=compacting.base_url, timeout=30) as client:
        yield client


@pytest.fixture
def url(http: httpx.Client, request: pytest.FixtureRequest) -> str:
    """A created, empty document of its own."""
    target = doc_url(SERVICE, f"tests/{unique(request.node.name)}")
    assert http.put(target).status_code == 201
    return target


# -- helpers ------------------------------------------------------------------------------------


@dataclass
class Written:
    """What a writer posted: its doc, and for each POST the update and the offset after it."""

    writer: Writer = field(default_factory=Writer)
    posts: list[tuple[bytes, str]] = field(default_factory=list)
    bytes_sent: int = 0

    def post(self, http: httpx.Client, url: str, chars: str = CHUNK) -> str:
        body = frame(self.writer.edit(chars))
        offset = post_ok(http, url, body)
        self.posts.append((body, offset))
        self.bytes_sent += len(body)
        return offset

    def after(self, offset: str) -> list[bytes]:
        """The updates of the POSTs that ended after ``offset`` (offsets sort lexically)."""
        return [read_frames(body)[0] for body, end in self.posts if end > offset]


def discover(http: httpx.Client, url: str) -> str:
    """offset=snapshot (5.2): the offset it redirects to, after checking the redirect."""
    response = http.get(url, params={"offset": "snapshot"})
    offset = location_offset(response, url)
    assert response.headers["Cache-Control"] == "private, max-age=5"
    return offset


def wait_for_snapshot(http: httpx.Client, url: str, other_than: str = "-1") -> str:
    def probe() -> str | None:
        offset = discover(http, url)
        return offset if offset != other_than else None

    token = wait_for(probe, COMPACTION_WAIT_SECS, f"a snapshot other than {other_than}")
    assert token.endswith("_snapshot"), token
    return token


def read_snapshot(http: httpx.Client, url: str, token: str) -> tuple[bytes, str]:
    response = http.get(url, params={"offset": token})
    assert response.status_code == 200, (response.status_code, response.text)
    assert response.headers["Content-Type"] == "application/octet-stream"
    return response.content, response.headers["Stream-Next-Offset"]


def sync(http: httpx.Client, url: str) -> tuple[str, str, list[bytes]]:
    """A client's initial sync (9.2), retrying discovery when the snapshot was replaced in
    between (8.3): (the synced text, the offset it started reading updates from, the updates
    read after the snapshot)."""
    for _ in range(20):
        offset = discover(http, url)
        applied: list[bytes] = []
        if offset != "-1":
            response = http.get(url, params={"offset": offset})
            if response.status_code == 404:
                assert_error(response, 404, "SNAPSHOT_NOT_FOUND")
                continue
            assert response.status_code == 200, response.text
            applied.append(response.content)
            offset = response.headers["Stream-Next-Offset"]
        body, _ = read_all(http, url, offset)
        updates = read_frames(body)
        return content_of(*applied, *updates), offset, updates
    raise AssertionError("the snapshot kept disappearing")


def snapshot_rows(pg: psycopg.Connection[Any], url: str) -> list[tuple[int, int]]:
    path = path_of(url)
    rows = pg.execute(
        "SELECT s.seq, s.pos FROM yjs_snapshot AS s"
        " JOIN yjs_document AS d ON d.stream_id = s.document_id"
        " WHERE d.service = %s AND d.path = %s ORDER BY s.id",
        (SERVICE, path),
    ).fetchall()
    return [tuple(row) for row in rows]


def fill_past_threshold(http: httpx.Client, url: str, written: Written) -> None:
    """POST until more than THRESHOLD bytes were written since this call began."""
    start = written.bytes_sent
    while written.bytes_sent - start <= THRESHOLD:
        written.post(http, url)


# -- 5.2 Snapshot discovery, 5.3 Read snapshot --------------------------------------------------


def test_discovery_without_snapshot_redirects_to_beginning(http: httpx.Client, url: str) -> None:
    """5.2, A.1.1 snapshot.discovery-new-doc / discovery-cached: 307 to offset=-1 with
    Cache-Control: private, max-age=5, also after writes under the threshold."""
    assert discover(http, url) == "-1"
    written = Written()
    written.post(http, url)
    assert discover(http, url) == "-1"
    text, offset, _ = sync(http, url)
    assert (text, offset) == (written.writer.content, "-1")


def test_discovery_of_missing_document(http: httpx.Client) -> None:
    """5.2, 10: discovery on a document that does not exist is 404 DOCUMENT_NOT_FOUND."""
    missing = doc_url(SERVICE, f"tests/{unique('missing')}")
    assert_error(http.get(missing, params={"offset": "snapshot"}), 404, "DOCUMENT_NOT_FOUND")


def test_compaction_at_threshold_and_snapshot_read(
    http: httpx.Client, url: str, pg: psycopg.Connection[Any]
) -> None:
    """8.1, 5.2, 5.3, A.1.4 compaction.triggers-at-threshold / creates-snapshot-url /
    stream-next-offset, A.1.1 snapshot.read: no snapshot while the updates stay within the
    threshold; crossing it makes one; the snapshot holds the whole document; its
    Stream-Next-Offset is the token's offset plus one; from there exactly the later updates
    follow, none repeated and none skipped."""
    written = Written()
    written.post(http, url)
    while written.bytes_sent + len(written.posts[-1][0]) + 8 <= THRESHOLD:
        written.post(http, url)
    assert THRESHOLD - 200 < written.bytes_sent <= THRESHOLD
    time.sleep(0.5)
    assert discover(http, url) == "-1"  # within the threshold: nothing compacted
    assert snapshot_rows(pg, url) == []

    while written.bytes_sent <= THRESHOLD:
        written.post(http, url)
    token = wait_for_snapshot(http, url)
    snapshot, next_offset = read_snapshot(http, url, token)
    assert next_offset == offset_after_snapshot(token)
    assert content_of(snapshot) == written.writer.content  # nothing written since crossing
    assert next_offset == written.posts[-1][1]

    # Updates after the snapshot (fewer than the threshold: no second compaction).
    for index in range(5):
        written.post(http, url, f"<after {index}>")
    body, _ = read_all(http, url, next_offset)
    after = read_frames(body)
    assert after == written.after(next_offset)
    assert len(after) == 5
    assert content_of(snapshot, *after) == written.writer.content
    assert discover(http, url) == token
    text, offset, updates = sync(http, url)
    assert (text, offset, updates) == (written.writer.content, next_offset, after)
    assert len(snapshot_rows(pg, url)) == 1


def test_later_compaction_moves_redirect_and_deletes_old_snapshot(
    http: httpx.Client, url: str, pg: psycopg.Connection[Any]
) -> None:
    """8.2, A.1.4 compaction.updates-redirect / deletes-old-snapshot, A.1.1 snapshot.not-found /
    deleted-retry: a second compaction moves offset=snapshot to a new token, the previous
    snapshot is gone (404 SNAPSHOT_NOT_FOUND), and discovering again leads to the new one."""
    written = Written()
    fill_past_threshold(http, url, written)
    first = wait_for_snapshot(http, url)
    first_snapshot, first_next = read_snapshot(http, url, first)

    fill_past_threshold(http, url, written)
    second = wait_for_snapshot(http, url, other_than=first)
    assert second > first
    second_snapshot, second_next = read_snapshot(http, url, second)
    assert second_next == offset_after_snapshot(second) > first_next

    assert_error(http.get(url, params={"offset": first}), 404, "SNAPSHOT_NOT_FOUND")
    assert discover(http, url) == second
    assert len(snapshot_rows(pg, url)) == 1

    body, _ = read_all(http, url, second_next)
    assert read_frames(body) == written.after(second_next)
    assert content_of(second_snapshot, *read_frames(body)) == written.writer.content
    # The old snapshot was a valid earlier state: a prefix of the document.
    assert written.writer.content.startswith(content_of(first_snapshot))


@pytest.mark.parametrize(
    "token",
    ["abc_snapshot", "_snapshot", "-1_snapshot", "now_snapshot", "12_snapshot",
     "0000000000000000_snapshot", "0000000000000001_0000000000000100_snapshot_snapshot",
     "0000000000000001-0000000000000100_snapshot", " 0000000000000001_0000000000000100_snapshot",
     "0000000000000001_000000000000010x_snapshot"],
)  # fmt: skip
def test_malformed_snapshot_tokens(http: httpx.Client, url: str, token: str) -> None:
    """5.3, 10: a snapshot offset that is no offset of this server is 400 INVALID_REQUEST."""
    assert_error(http.get(url, params={"offset": token}), 400, "INVALID_REQUEST")


def test_unknown_snapshot_tokens(http: httpx.Client, url: str) -> None:
    """5.3, 10, A.1.6 error.snapshot-deleted: a well-formed token of no snapshot is 404
    SNAPSHOT_NOT_FOUND, also one next to a real snapshot's."""
    for token in (
        "0000000000000000_0000000000000000_snapshot",
        "0000000000000005_0000000000000499_snapshot",
        "9999999999999999_9999999999999999_snapshot",
    ):
        assert_error(http.get(url, params={"offset": token}), 404, "SNAPSHOT_NOT_FOUND")
    written = Written()
    fill_past_threshold(http, url, written)
    token = wait_for_snapshot(http, url)
    offset = token.removesuffix("_snapshot")
    seq, pos = offset.split("_")
    neighbours = [
        f"{seq}_{int(pos) + 1:0{len(pos)}d}_snapshot",
        f"{seq}_{int(pos) - 1:0{len(pos)}d}_snapshot",
        f"{int(seq) - 1:0{len(seq)}d}_{pos}_snapshot",
        f"{offset_after_snapshot(token)}_snapshot",
    ]
    for neighbour in neighbours:
        assert_error(http.get(url, params={"offset": neighbour}), 404, "SNAPSHOT_NOT_FOUND")
    read_snapshot(http, url, token)
    # A real token, but of another document.
    other = doc_url(SERVICE, f"tests/{unique('other')}")
    assert http.put(other).status_code == 201
    assert_error(http.get(other, params={"offset": token}), 404, "SNAPSHOT_NOT_FOUND")


# -- 8.3 Client transparency ---------------------------------------------------------------------


def test_writes_during_compactions_are_never_lost(
    compacting: Any, http: httpx.Client, url: str, pg: psycopg.Connection[Any]
) -> None:
    """8.3, 8.4, A.1.4 compaction.client-transparent: while a writer keeps posting (several
    compactions happen meanwhile) readers keep syncing: every read answers, every sync gives
    a state that contains everything acknowledged before it began and nothing that was not
    written; at the end a sync gives exactly the writer's document, from a snapshot plus
    precisely the updates after it."""
    done = threading.Event()
    acknowledged: list[str] = [""]
    written = Written()
    syncs: list[tuple[str, str]] = []

    def write() -> None:
        try:
            with httpx.Client(base_url=compacting.base_url, timeout=30) as own:
                for index in range(70):
                    written.post(own, url, f"[{index:03d}]{CHUNK}")
                    acknowledged.append(written.writer.content)
        finally:
            done.set()

    def read() -> None:
        with httpx.Client(base_url=compacting.base_url, timeout=30) as own:
            while not done.is_set():
                before = acknowledged[-1]
                text, _, _ = sync(own, url)
                syncs.append((before, text))
                whole, _ = read_all(own, url)  # the plain log stays readable too
                assert content_of(*read_frames(whole)).startswith(before)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(write), pool.submit(read), pool.submit(read)]
        for future in futures:
            future.result(timeout=120)  # re-raises a thread's failure here
    final = acknowledged[-1]
    assert syncs, "the readers never synced"
    for before, text in syncs:
        assert text.startswith(before), (len(before), len(text))
        assert final.startswith(text)

    compactions, _ = compaction_counts(pg, SERVICE, path_of(url))
    assert compactions >= 2, compactions
    text, offset, updates = sync(http, url)
    assert text == final == written.writer.content
    assert offset != "-1"
    assert updates == written.after(offset)


def test_document_deletion_removes_snapshots(
    http: httpx.Client, url: str, pg: psycopg.Connection[Any]
) -> None:
    """5.9, A.1.7 delete.doc-cascades-snapshots: DELETE removes the snapshots; the old token
    is a 404, and a document created again at the path starts without a snapshot."""
    written = Written()
    fill_past_threshold(http, url, written)
    token = wait_for_snapshot(http, url)
    assert len(snapshot_rows(pg, url)) == 1
    stream_id = pg.execute(
        "SELECT stream_id FROM yjs_document WHERE service = %s AND path = %s",
        (SERVICE, path_of(url)),
    ).fetchone()
    assert stream_id is not None

    assert http.delete(url).status_code == 204
    gone = pg.execute("SELECT count(*) FROM yjs_snapshot WHERE document_id = %s", stream_id)
    assert gone.fetchone() == (0,)
    assert snapshot_rows(pg, url) == []
    assert http.get(url, params={"offset": token}).status_code == 404

    assert http.put(url).status_code == 201
    assert discover(http, url) == "-1"
    assert_error(http.get(url, params={"offset": token}), 404, "SNAPSHOT_NOT_FOUND")
    fresh = Written()
    fill_past_threshold(http, url, fresh)
    new_token = wait_for_snapshot(http, url)
    snapshot, _ = read_snapshot(http, url, new_token)
    assert content_of(snapshot).startswith(fresh.writer.content[: len(CHUNK)])
    assert sync(http, url)[0] == fresh.writer.content


# -- compact_yjs ----------------------------------------------------------------------------------


def compact_yjs(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = command_env(
        database_url, YJS_COMPACTION_THRESHOLD_BYTES=str(THRESHOLD), DS_LOG_LEVEL="WARNING"
    )
    return manage(database_url, "compact_yjs", *args, env=env, timeout=120)


def small_document(http: httpx.Client, service: str, posts: int = 3) -> tuple[str, Written]:
    """A document of ``service`` with a few updates, well under the threshold."""
    path = f"tests/{unique('cmd')}"
    target = doc_url(service, path)
    assert http.put(target).status_code == 201
    written = Written()
    for _ in range(posts):
        written.post(http, target, "small ")
    return target, written


def path_of(target: str) -> str:
    return target.split("/docs/", 1)[1]


def test_command_force_compacts_on_demand(http: httpx.Client, database_url: str) -> None:
    """8, compact_yjs --force: compacts a document under the threshold, prints its progress,
    and the server then redirects to the snapshot, which syncs to the writer's document."""
    target, written = small_document(http, SERVICE)
    assert discover(http, target) == "-1"

    result = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(target), "--force")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith(f"[1/1] {SERVICE}/{path_of(target)}: 3 updates"), lines
    assert "snapshot of" in lines[0]
    assert lines[-1] == "Compacted 1 of 1 documents."

    token = discover(http, target)
    assert token.endswith("_snapshot")
    snapshot, next_offset = read_snapshot(http, target, token)
    assert next_offset == offset_after_snapshot(token) == written.posts[-1][1]
    assert content_of(snapshot) == written.writer.content
    assert token.removesuffix("_snapshot") in lines[0] or next_offset in lines[0]

    # Nothing new since: nothing to do, and the snapshot stays.
    again = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(target), "--force")
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    assert "Compacted 0 of 1 documents." in again.stdout
    assert discover(http, target) == token

    written.post(http, target, "more")
    third = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(target), "--force")
    assert third.returncode == 0, third.stderr
    assert "1 updates" in third.stdout
    new_token = discover(http, target)
    assert new_token not in (token, "-1")
    assert_error(http.get(target, params={"offset": token}), 404, "SNAPSHOT_NOT_FOUND")
    assert sync(http, target)[0] == written.writer.content


def test_command_without_force_skips_small_documents(http: httpx.Client, database_url: str) -> None:
    """8.1: without --force only documents over the threshold are compacted."""
    target, _ = small_document(http, SERVICE)
    result = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(target))
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stdout
    assert "Compacted 0 of 1 documents." in result.stdout
    assert discover(http, target) == "-1"


def test_command_all_of_one_service(http: httpx.Client, database_url: str) -> None:
    """compact_yjs --all --service S --force: every document of S, none of another service."""
    service, other = unique("cmd-svc"), unique("cmd-other")
    mine = [small_document(http, service) for _ in range(2)]
    theirs, _ = small_document(http, other)

    result = compact_yjs(database_url, "--all", "--service", service, "--force")
    assert result.returncode == 0, result.stderr
    assert "Compacted 2 of 2 documents." in result.stdout
    for index, (target, written) in enumerate(sorted(mine), start=1):
        assert f"[{index}/2] {service}/{path_of(target)}" in result.stdout
        assert discover(http, target).endswith("_snapshot")
        assert sync(http, target)[0] == written.writer.content
    assert other not in result.stdout
    assert discover(http, theirs) == "-1"


def test_command_all_lists_every_service(http: httpx.Client, database_url: str) -> None:
    """compact_yjs --all: documents of every service are considered (here all under the
    threshold, so each is reported as skipped and none is compacted)."""
    first, _ = small_document(http, unique("cmd-a"))
    second, _ = small_document(http, unique("cmd-b"))
    result = compact_yjs(database_url, "--all")
    assert result.returncode == 0, result.stderr
    for target in (first, second):
        service = target.split("/")[3]
        line = next(
            line for line in result.stdout.splitlines() if f"{service}/{path_of(target)}" in line
        )
        assert "skipped" in line
        assert discover(http, target) == "-1"
    assert result.stdout.strip().splitlines()[-1].startswith("Compacted ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "--all"),
        (("--service", "x"), "--all"),
        (("--doc", "a/b"), "--service"),
        (("--service", "nosuchservice", "--doc", "no/such/doc"), "no document"),
        (("--bogus",), "unrecognized arguments"),
    ],
)
def test_command_rejects_bad_arguments(
    database_url: str, args: tuple[str, ...], message: str
) -> None:
    """compact_yjs: arguments that name nothing fail with a clear message and a non-zero exit."""
    result = compact_yjs(database_url, *args)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "Compacted" not in result.stdout


def _out_of_order_updates(kind: str) -> tuple[bytes, bytes]:
    """(an update, the earlier update it depends on) of one client."""
    writer = Writer(client_id=42)
    writer.edit("hello ")
    if kind == "insert":
        writer.edit("world")  # inserted after "hello ": depends on it
    else:
        del writer.text[0:6]  # deletes "hello ": depends on it
    first, dependent = writer.updates
    return dependent, first


@pytest.mark.parametrize("kind", ["insert", "delete"])
def test_compaction_keeps_updates_waiting_for_their_dependencies(
    http: httpx.Client, url: str, database_url: str, kind: str
) -> None:
    """8.2, 8.3 ("Compaction is invisible to clients"): an update can reach the stream before
    one it depends on (two tabs of one user, concurrent POSTs). A snapshot taken in between
    must not drop it: once the missing update arrives, syncing from the snapshot gives the
    same document as replaying the whole stream from offset -1."""
    dependent, first = _out_of_order_updates(kind)
    post_ok(http, url, frame(dependent))
    result = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(url), "--force")
    assert result.returncode == 0, result.stderr
    assert discover(http, url).endswith("_snapshot")
    post_ok(http, url, frame(first))

    replayed = content_of(*read_frames(read_all(http, url)[0]))
    assert replayed == ("hello world" if kind == "insert" else "")
    assert sync(http, url)[0] == replayed


# -- Updates compaction cannot merge (8, 8.4, 12.3) -----------------------------------------------


@pytest.mark.parametrize("name", UNMERGEABLE_UPDATES)
def test_updates_compaction_cannot_merge_are_refused(
    http: httpx.Client, url: str, name: str
) -> None:
    """5.5, 10, 12.3: an update that decodes but that compaction cannot merge into a snapshot
    is 400 INVALID_REQUEST, alone or after valid updates in the same body, and nothing of the
    body is stored (before, it was stored, and every later compaction of the document
    failed)."""
    written = Written()
    written.post(http, url, "kept")
    before = read_all(http, url)
    crafted = UNMERGEABLE_UPDATES[name]
    valid = frame(written.writer.edit(" not kept"))
    for body in (frame(crafted), valid + frame(crafted)):
        assert_error(http.post(url, headers=OCTET, content=body), 400, "INVALID_REQUEST")
    assert read_all(http, url) == before


def test_document_compacts_after_refused_updates(
    http: httpx.Client, url: str, database_url: str
) -> None:
    """8.2: a document that was sent every update of UNMERGEABLE_UPDATES (all refused) and
    valid updates compacts, and syncs from its snapshot to the writer's document."""
    written = Written()
    for name, crafted in UNMERGEABLE_UPDATES.items():
        written.post(http, url, f"<{name}>")
        assert_error(http.post(url, headers=OCTET, content=frame(crafted)), 400)
    result = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(url), "--force")
    assert result.returncode == 0, result.stderr
    token = discover(http, url)
    snapshot, _ = read_snapshot(http, url, token)
    assert content_of(snapshot) == written.writer.content
    assert sync(http, url)[0] == written.writer.content


@pytest.mark.parametrize("pair", UNMERGEABLE_PAIRS)
def test_updates_that_do_not_merge_together_in_one_body_are_refused(
    http: httpx.Client, url: str, pair: str
) -> None:
    """5.5, 12.3: two updates that each merge on their own, but not with each other, are
    refused when they come in one body (compaction would merge them together)."""
    first, second = UNMERGEABLE_PAIRS[pair]
    response = http.post(url, headers=OCTET, content=frame(first) + frame(second))
    assert_error(response, 400, "INVALID_REQUEST")
    assert read_all(http, url)[0] == b""


def test_update_after_a_gap_in_its_clients_clocks_is_compacted(
    http: httpx.Client, url: str, database_url: str
) -> None:
    """8.2, 8.3: client 7's second update (typing into another root text at position 0: an
    item without origin at clock 13) arrives before its first. The Doc holds it at clock 13
    with nothing before it; compaction must still snapshot the document (it used to fail
    reading the Doc's update as a delete set), and syncing from the snapshot once the first
    update has arrived gives the same document as replaying the stream."""
    writer = Writer(client_id=7)
    first = writer.edit("hello world!!")  # clocks 0-12
    title = writer.doc.get("title", type=Text)
    title.insert(0, "T")
    second = writer.updates[-1]
    post_ok(http, url, frame(second))

    result = compact_yjs(database_url, "--service", SERVICE, "--doc", path_of(url), "--force")
    assert result.returncode == 0, result.stderr
    assert discover(http, url).endswith("_snapshot")
    post_ok(http, url, frame(first))

    def both_texts(*updates: bytes) -> tuple[str, str]:
        doc: Doc = Doc()
        for update in updates:
            doc.apply_update(update)
        return str(doc.get("content", type=Text)), str(doc.get("title", type=Text))

    replayed = both_texts(*read_frames(read_all(http, url)[0]))
    assert replayed == ("hello world!!", "T")
    token = discover(http, url)
    snapshot, next_offset = read_snapshot(http, url, token)
    assert both_texts(snapshot, *read_frames(read_all(http, url, next_offset)[0])) == replayed


def failure_record(pg: psycopg.Connection[Any], service: str, path: str) -> tuple[str, Any]:
    """(compaction error, time it was recorded) of a document."""
    row = pg.execute(
        "SELECT compaction_error, compaction_failed_at FROM yjs_document"
        " WHERE service = %s AND path = %s",
        (service, path),
    ).fetchone()
    assert row is not None, f"no document {service}/{path}"
    return row[0], row[1]


def poisoned_document(
    http: httpx.Client, pg: psycopg.Connection[Any], service: str, pair: str, label: str
) -> tuple[str, Written]:
    """A document holding both updates of UNMERGEABLE_PAIRS[pair], as a server stored them
    before POSTs were checked against the whole document (the first POSTed, the second, which
    a POST is refused now, written straight into the stream), then a few valid updates
    POSTed: (its URL, what it holds, with the tail after each)."""
    target = doc_url(service, f"tests/{label}-{unique(pair)}")
    assert http.put(target).status_code == 201
    written = Written()
    first, second = (frame(update) for update in UNMERGEABLE_PAIRS[pair])
    written.posts.append((first, post_ok(http, target, first)))
    assert_error(http.post(target, headers=OCTET, content=second), 400, "INVALID_REQUEST")
    written.posts.append((second, stored_unchecked(pg, service, path_of(target), second)))
    written.bytes_sent += len(first) + len(second)
    for _ in range(3):
        written.post(http, target, "small ")
    return target, written


def stored_unchecked(pg: psycopg.Connection[Any], service: str, path: str, body: bytes) -> str:
    """Append ``body`` to a document's update stream with the store's own SQL function (as
    the store calls it, at the stream's current validation version), bypassing the POST's
    checks; the new tail."""
    stream = f"__ds/yjs/{service}/docs/{path}"
    request = Jsonb([["application/octet-stream", False, None, None, None, None, 1, len(body)]])
    row = pg.execute(
        "SELECT a.outcome::text, a.next_seq, a.next_pos FROM ds_stream AS s,"
        " ds_append(s.path, jsonb_set(%s, '{0,8}', to_jsonb(s.validation_version)),"
        " ARRAY[%s], ARRAY[1], %s, 1000000000) AS a WHERE s.path = %s",
        (request, len(body), body, stream),
    ).fetchone()
    assert row is not None and row[0] == "appended", row
    return f"{row[1]:016d}_{row[2]:016d}"


@pytest.mark.parametrize("pair", UNMERGEABLE_PAIRS)
def test_document_that_cannot_be_compacted_is_recorded_once(
    compacting: Any, http: httpx.Client, pg: psycopg.Connection[Any], database_url: str, pair: str
) -> None:
    """8.4: updates that merge only alone are accepted; the compaction their document then
    triggers fails. The failure is logged once and recorded on the document (error and time);
    later appends past the threshold do not retry it, the document stays readable and
    writable without a snapshot; compact_yjs without --force reports the recorded failure
    without retrying (exit 1), with --force it retries (and fails again)."""
    target, written = poisoned_document(http, pg, SERVICE, pair, "poisoned")
    path = path_of(target)
    fill_past_threshold(http, target, written)

    def recorded() -> tuple[str, Any] | None:
        error, failed_at = failure_record(pg, SERVICE, path)
        return (error, failed_at) if failed_at is not None else None

    error, failed_at = wait_for(recorded, COMPACTION_WAIT_SECS, "the failure to be recorded")
    assert "panicked" in error or "block parent" in error, error
    for _ in range(2):
        fill_past_threshold(http, target, written)
    assert read_all(http, target)[0] == b"".join(body for body, _ in written.posts)
    assert discover(http, target) == "-1"
    assert compaction_counts(pg, SERVICE, path) == (0, 0)
    assert failure_record(pg, SERVICE, path) == (error, failed_at)
    log = compacting.log_path.read_text()
    assert log.count(f"compaction of {SERVICE}/{path} failed") == 1, log[-3000:]

    again = compact_yjs(database_url, "--service", SERVICE, "--doc", path)
    assert again.returncode == 1, again.stdout
    assert "not retried without --force" in again.stderr and error in again.stderr
    assert "Compacted 0 of 1 documents." in again.stdout
    assert failure_record(pg, SERVICE, path) == (error, failed_at)

    forced = compact_yjs(database_url, "--service", SERVICE, "--doc", path, "--force")
    assert forced.returncode == 1, forced.stdout
    assert "its updates cannot be merged" in forced.stderr
    retried_error, retried_at = failure_record(pg, SERVICE, path)
    assert retried_error == error and retried_at > failed_at
    assert discover(http, target) == "-1"
    post_ok(http, target, frame(written.writer.edit("still writable")))


def test_command_all_goes_on_after_a_document_that_cannot_be_compacted(
    http: httpx.Client, pg: psycopg.Connection[Any], database_url: str
) -> None:
    """compact_yjs --all: a document whose updates cannot be merged (one failing with a
    pycrdt error, one with a Rust panic) is reported with its error on stderr, the other
    documents are compacted, and the command exits 1 naming the failed ones."""
    service = unique("cmd-poison")
    # Listed (and compacted) in path order: the broken documents first, then the good ones.
    broken, _ = poisoned_document(http, pg, service, "child-of-a-string", "a")
    panicking, _ = poisoned_document(http, pg, service, "deletion-and-huge-clock", "b")
    first, first_written = small_document(http, service)
    last, last_written = small_document(http, service)
    assert sorted([last, first, panicking, broken], key=path_of)[:2] == [broken, panicking]

    result = compact_yjs(database_url, "--all", "--service", service, "--force")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "Compacted 2 of 4 documents." in result.stdout
    reports = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(reports) == 2, result.stderr
    for index, target in enumerate((broken, panicking), start=1):
        line = next(x for x in reports if f"{service}/{path_of(target)}" in x)
        assert line.startswith(f"[{index}/4] ") and "its updates cannot be merged" in line, line
        error, failed_at = failure_record(pg, service, path_of(target))
        assert error in line and failed_at is not None
        assert discover(http, target) == "-1"
    assert "2 of 4 documents could not be compacted" in result.stderr
    for target, written in ((first, first_written), (last, last_written)):
        assert discover(http, target).endswith("_snapshot")
        assert sync(http, target)[0] == written.writer.content
        assert failure_record(pg, service, path_of(target)) == ("", None)


# -- The admin -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def admin(compacting: Any, database_url: str) -> Iterator[httpx.Client]:
    """A client logged in to the compacting server's Django admin as a new superuser."""
    with admin_session(compacting.base_url, database_url, unique("admin")) as client:
        yield client


def csrf_token(page: httpx.Response) -> str:
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None, page.text[-2000:]
    return token.group(1)


def test_admin_shows_documents_that_cannot_be_compacted(
    admin: httpx.Client, http: httpx.Client, pg: psycopg.Connection[Any]
) -> None:
    """Admin: "Compact now" on a document whose updates cannot be merged answers with the
    error (not a server error) and records it; the list filters such documents, and the
    document's page shows the error, when it happened, and why there is no preview."""
    target, _ = poisoned_document(http, pg, SERVICE, "child-of-a-string", "admin")
    path = path_of(target)
    listing = admin.get("/admin/yjs/yjsdocument/", params={"q": path})
    assert listing.status_code == 200 and path in listing.text
    found = re.search(r'href="/admin/yjs/yjsdocument/(\d+)/change/', listing.text)
    assert found is not None
    action = admin.post(
        str(listing.url),
        data={"csrfmiddlewaretoken": csrf_token(listing), "action": "compact_now",
              "_selected_action": [found.group(1)]},
        headers={"Referer": str(listing.url)},
    )  # fmt: skip
    assert action.status_code == 200, action.text[-2000:]
    assert "Compacted 0 of 1 documents." in action.text
    error, failed_at = failure_record(pg, SERVICE, path)
    assert "block parent" in error and failed_at is not None
    message = f"Could not compact {SERVICE}/{path}: its updates cannot be merged: {error}"
    assert message in html.unescape(action.text)

    link = f"/admin/yjs/yjsdocument/{found.group(1)}/change/"
    failed = admin.get("/admin/yjs/yjsdocument/", params={"q": path, "compaction": "failed"})
    assert failed.status_code == 200 and link in failed.text
    fine = admin.get("/admin/yjs/yjsdocument/", params={"q": path, "compaction": "ok"})
    assert fine.status_code == 200 and link not in fine.text
    detail = admin.get(link)
    assert detail.status_code == 200
    page = html.unescape(detail.text)
    assert error in page
    assert "the updates cannot be merged" in page


def test_compactions_waiting_for_a_lock_leave_django_its_connections(
    start_server: Any, database_url: str
) -> None:
    """Probe 10l: each compaction ran in a thread on one of Django's pooled connections (four
    by default) and held it while it waited for its document's row: with the rows held by an
    operator's session, documents crossing the threshold took every one, and the admin and the
    REST API answered 503. One compaction runs at a time per process."""
    server = start_server(
        env={
            "YJS_COMPACTION_THRESHOLD_BYTES": str(COMPACTION_THRESHOLD),
            "DS_DB__LOCK_TIMEOUT_SECS": "8",
        }
    )
    urls = [doc_url(SERVICE, f"tests/{unique('held-row')}") for _ in range(6)]
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for target in urls:
            assert http.put(target).status_code == 201
        with psycopg.connect(database_url) as holder:
            holder.execute("SELECT 1 FROM yjs_document FOR UPDATE")
            for target in urls:  # each crosses the threshold: a compaction each
                written = Written()
                while written.bytes_sent <= COMPACTION_THRESHOLD:
                    written.post(http, target)
            statuses = []
            for _ in range(6):
                time.sleep(0.5)
                statuses.append(http.get("/v1/streams", params={"prefix": "yjs"}).status_code)
            holder.rollback()
    assert set(statuses) == {200}, statuses
