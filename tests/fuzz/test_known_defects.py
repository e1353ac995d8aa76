"""Yjs defects the fuzzers found, each reproduced with the minimal input found, now
regression tests: the clock gap (compaction reads pending structs correctly), updates whose
merge breaks (refused by the POST check, or compacted: compaction applies a chunk Yrs cannot
decode update by update), and an update that merges alone but cannot be integrated with what
the document holds (refused: a POST is checked against the whole document, yjs.replicas).
"""

from __future__ import annotations

import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from pycrdt import Doc

from tests.fuzz.test_yjs_fuzz import frame, unframe
from tests.yjs.test_yjs_compaction import read_snapshot, wait_for_snapshot

OCTET = {"Content-Type": "application/octet-stream"}
THRESHOLD = 64

# A Map update (pycrdt, client 122, the last of 38 sets) whose client's earlier updates the
# server never got: valid, and accepted. yjs.updates.snapshot_of reads the delete set of
# ``get_update(encoded, state)`` assuming it has no structs, but pycrdt's encodeStateAsUpdate
# keeps such pending structs (after a Skip): FramingError, the compaction fails.
GAP_UPDATE = "01017a252801016d046b343230017c42140000017a0208010b01"
# Four updates (fuzzed), each decodable and applicable one after another, whose merge
# (merge_updates, which compaction runs on chunks of 50) yields bytes Yrs cannot decode.
MERGE_BREAKS = [
    "010103000401017402616200",
    "010103024403000661626162616200",
    "000103010202",
    "010103080203030300066162616261620103010202",
]
# Four updates (fuzzed), each decodable on its own, the last naming as parent an item that is
# not a type: applying the document fails ("block parent must be deleted or shared ref type"),
# for the compaction and for every client doing an initial sync, had it been stored.
PARENT_BREAKS = [
    "010104000401017408616261626162616200",
    "000104010002",
    "000104010004",
    "010104ff02040304040861626162616261620104010004",
]


@pytest.fixture(scope="module")
def compacting(start_server: Any) -> Any:
    return start_server(env={"YJS_COMPACTION_THRESHOLD_BYTES": str(THRESHOLD)})


def _document(server: Any, updates: list[str], *, repeat: int = 1) -> str:
    url = f"{server.base_url}/v1/yjs/fuzz/docs/defect-{uuid.uuid4().hex[:10]}"
    assert httpx.put(url).status_code == 201
    for _ in range(repeat):
        for update in updates:
            response = httpx.post(url, content=frame(bytes.fromhex(update)), headers=OCTET)
            assert response.status_code == 204, response.text  # accepted
    return url


def _compaction_failures(server: Any, since: int) -> list[str]:
    time.sleep(1.5)  # compaction runs in the background after the append
    lines = server.log_path.read_text(errors="replace").splitlines()[since:]
    return [line for line in lines if "compaction of" in line and "failed" in line]


def test_compaction_of_an_update_with_a_clock_gap(compacting: Any) -> None:
    since = len(compacting.log_path.read_text(errors="replace").splitlines())
    _document(compacting, [GAP_UPDATE], repeat=4)
    assert _compaction_failures(compacting, since) == []


def test_updates_whose_merge_breaks(compacting: Any) -> None:
    """The fourth update depends on the other three, and alone Yrs cannot merge it with what
    it leaves pending: the POST check refuses it (400), as compaction could not take it. The
    three others, accepted, compact (their chunk's merge is applied update by update when Yrs
    cannot decode it: tests/unit/test_yjs_updates.py), and a client's initial sync rebuilds
    exactly what they make. (Until this stop the test was an xfail that the 400 satisfied.)"""
    since = len(compacting.log_path.read_text(errors="replace").splitlines())
    accepted = MERGE_BREAKS[:3]
    url = _document(compacting, accepted, repeat=3)
    refused = httpx.post(url, content=frame(bytes.fromhex(MERGE_BREAKS[3])), headers=OCTET)
    assert refused.status_code == 400, refused.text
    assert _compaction_failures(compacting, since) == []
    rebuilt = Doc()
    for update in accepted * 3:
        rebuilt.apply_update(bytes.fromhex(update))
    # A client's initial sync: the snapshot, then the updates after it.
    with httpx.Client(base_url=compacting.base_url) as http:
        path = urlsplit(url).path
        token = wait_for_snapshot(http, path)
        snapshot, next_offset = read_snapshot(http, path, token)
        synced = Doc()
        synced.apply_update(snapshot)
        for update in unframe(http.get(path, params={"offset": next_offset}).content):
            synced.apply_update(update)
    assert synced.get_state() == rebuilt.get_state()
    assert synced.get_update() == rebuilt.get_update()


def test_an_update_that_cannot_be_applied_is_refused(compacting: Any) -> None:
    url = f"{compacting.base_url}/v1/yjs/fuzz/docs/defect-{uuid.uuid4().hex[:10]}"
    assert httpx.put(url).status_code == 201
    statuses = [
        httpx.post(url, content=frame(bytes.fromhex(u)), headers=OCTET).status_code
        for u in PARENT_BREAKS
    ]
    assert statuses == [204, 204, 204, 400]
    doc = Doc()
    for update in unframe(httpx.get(url, params={"offset": "-1"}).content):
        doc.apply_update(update)
