"""A document POST is checked against the whole document (yjs.replicas): an update that merges
alone but cannot be integrated with what the document holds is refused, whichever server
process holds the rest, so no writer can spoil a document for its readers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from pycrdt import Doc, Text

from tests.yjs.support import (
    OCTET,
    TEXT_NAME,
    Writer,
    assert_error,
    content_of,
    doc_url,
    frame,
    read_all,
    read_frames,
    tail_of,
    unique,
)

# Fuzzed updates (tests/fuzz/test_known_defects.py): each merges alone, and the first and the
# last cannot both be integrated ("block parent must be deleted or shared ref type"), in
# either order. The middle two go with either.
FIRST, MIDDLE_1, MIDDLE_2, LAST = (
    bytes.fromhex(u)
    for u in (
        "010104000401017408616261626162616200",
        "000104010002",
        "000104010004",
        "010104ff02040304040861626162616261620104010004",
    )
)


def _replayed(client: httpx.Client, url: str) -> list[bytes]:
    """The document's updates read from the start, applied one by one as a client's initial
    sync applies them (raising if one cannot be)."""
    data, _ = read_all(client, url)
    updates = read_frames(data)
    doc: Doc[Any] = Doc()
    for update in updates:
        doc.apply_update(update)
    return updates


def _new_doc(client: httpx.Client, base_url: str) -> str:
    url = base_url + doc_url("integrity", unique("doc"))
    assert client.put(url).status_code == 201
    return url


def _post(client: httpx.Client, url: str, update: bytes) -> httpx.Response:
    return client.post(url, content=frame(update), headers=OCTET)


@pytest.fixture(scope="module")
def engine_server(start_server: Any) -> Any:
    """A server that checks every document in its engine's process (yjs.engine), as it does
    documents past YJS_INLINE_DOCUMENT_BYTES."""
    return start_server(env={"YJS_INLINE_DOCUMENT_BYTES": "0"})


@pytest.mark.parametrize("order", ["parent first", "child first"])
def test_an_update_that_cannot_join_the_document_is_refused_and_changes_nothing(
    compacting_servers: tuple[Any, Any], order: str
) -> None:
    _refused_and_nothing_changed(compacting_servers[0].base_url, order)


@pytest.mark.parametrize("order", ["parent first", "child first"])
def test_the_engine_refuses_such_an_update_too(engine_server: Any, order: str) -> None:
    _refused_and_nothing_changed(engine_server.base_url, order)


def _refused_and_nothing_changed(base_url: str, order: str) -> None:
    accepted, refused = (FIRST, LAST) if order == "parent first" else (LAST, FIRST)
    with httpx.Client(timeout=30) as client:
        url = _new_doc(client, base_url)
        for update in (accepted, MIDDLE_1, MIDDLE_2):
            assert _post(client, url, update).status_code == 204
        tail = tail_of(client, url)
        assert_error(_post(client, url, refused), 400, "INVALID_REQUEST")
        assert tail_of(client, url) == tail
        assert _replayed(client, url) == [accepted, MIDDLE_1, MIDDLE_2]

        # Refused again when sent again (the Doc the refusal touched was rebuilt, and holds
        # nothing that was not stored).
        assert_error(_post(client, url, refused), 400, "INVALID_REQUEST")
        assert tail_of(client, url) == tail

        # The document stays writable: the next update is checked against it as stored.
        edit = Writer().edit("after the refusal")
        assert _post(client, url, edit).status_code == 204
        assert _replayed(client, url) == [accepted, MIDDLE_1, MIDDLE_2, edit]


def test_a_process_checks_against_what_another_process_appended(
    compacting_servers: tuple[Any, Any],
) -> None:
    first, second = compacting_servers
    with httpx.Client(timeout=30) as client:
        url = _new_doc(client, first.base_url)
        other = url.replace(first.base_url, second.base_url)
        # The first process knows the document (it checked this POST), then the second
        # appends the parent; the first must catch up before it judges the child.
        assert _post(client, url, MIDDLE_1).status_code == 204
        assert _post(client, other, FIRST).status_code == 204
        assert_error(_post(client, url, LAST), 400, "INVALID_REQUEST")
        assert _replayed(client, other) == [MIDDLE_1, FIRST]


@pytest.mark.parametrize("where", ["one process", "two processes"])
def test_racing_posts_store_at_most_one_of_two_updates_that_break_together(
    compacting_servers: tuple[Any, Any], where: str
) -> None:
    """Two POSTs that cannot both join the document land at once, with two valid edits,
    through one process (checked in order in one round, appended together) or one pair on
    each (each process checks against the document as it read it, and its append is made only
    if no other overtook that reading: the stream's validation version). Exactly one of the
    two is stored, and every valid edit."""
    first, second = compacting_servers
    pairs = 16
    with httpx.Client(timeout=30) as client:
        urls = [_new_doc(client, first.base_url) for _ in range(pairs)]
        for url in urls:  # both processes know each document before the race
            assert _post(client, url, MIDDLE_1).status_code == 204
            other = url.replace(first.base_url, second.base_url)
            assert _post(client, other, MIDDLE_2).status_code == 204

    barrier = threading.Barrier(4, timeout=30)

    def post(url: str, update: bytes) -> int:
        with httpx.Client(timeout=30) as own:
            own.head(url)  # connected before the barrier
            barrier.wait()
            return _post(own, url, update).status_code

    outcomes = []
    with ThreadPoolExecutor(4) as pool:
        for url in urls:
            other = url if where == "one process" else url.replace(first.base_url, second.base_url)
            edits = [Writer().edit("valid"), Writer().edit("also valid")]
            racing = [
                pool.submit(post, url, FIRST),
                pool.submit(post, other, LAST),
                pool.submit(post, url, edits[0]),
                pool.submit(post, other, edits[1]),
            ]
            statuses = [f.result() for f in racing]
            outcomes.append((sorted(statuses[:2]), statuses[2:]))
            with httpx.Client(timeout=30) as client:
                stored = _replayed(client, url)
            assert stored[:2] == [MIDDLE_1, MIDDLE_2]
            assert sorted(stored[2:]) in (sorted([FIRST, *edits]), sorted([LAST, *edits]))
    assert outcomes == [([204, 400], [204, 204])] * pairs


def test_writers_on_two_processes_at_once_all_land(compacting_servers: tuple[Any, Any]) -> None:
    """Four clients typing into one document at once, two through each process: a POST
    overtaken by the other process's appends is caught up and appended all the same; every
    update is stored once, and the document read back is what the writers made together."""
    first, second = compacting_servers
    with httpx.Client(timeout=30) as client:
        url = _new_doc(client, first.base_url)
    urls = [url, url.replace(first.base_url, second.base_url)] * 2
    writers = [Writer() for _ in urls]

    def type_into(index: int) -> list[bytes]:
        sent = []
        with httpx.Client(timeout=30) as own:
            for i in range(25):
                update = writers[index].edit(f"{index}:{i} ")
                assert _post(own, urls[index], update).status_code == 204
                sent.append(update)
        return sent

    with ThreadPoolExecutor(len(urls)) as pool:
        sent = [update for updates in pool.map(type_into, range(len(urls))) for update in updates]
    expected: Doc[Any] = Doc()
    for update in sent:
        expected.apply_update(update)
    with httpx.Client(timeout=30) as client:
        stored = _replayed(client, url)
    assert sorted(stored) == sorted(sent)
    assert content_of(*stored) == str(expected.get(TEXT_NAME, type=Text))
