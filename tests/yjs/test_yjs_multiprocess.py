"""Compaction across server processes (YJS-PROTOCOL.md 8): when two processes both see a
document cross the threshold, exactly one compaction runs."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import psycopg
from pycrdt import Doc, Text

from yjs.framing import frame, read_frames

THRESHOLD = 1500


def test_one_compaction_when_two_processes_cross_the_threshold(
    start_server: Any, database_url: str
) -> None:
    env = {"YJS_COMPACTION_THRESHOLD_BYTES": str(THRESHOLD)}
    first, second = start_server(env=env), start_server(env=env)
    doc_path = f"multiprocess/{time.time_ns()}"
    urls = [f"{s.base_url}/v1/yjs/tests/docs/{doc_path}" for s in (first, second)]

    doc = Doc()
    text = doc.get("text", type=Text)
    updates: list[bytes] = []
    doc.observe(lambda event: updates.append(event.update))
    text += "x" * 1400  # one update just under the threshold
    text += "first " * 20
    text += "second " * 20
    big, small_1, small_2 = updates
    assert len(frame(big)) < THRESHOLD < len(frame(big)) + min(len(small_1), len(small_2))
    headers = {"Content-Type": "application/octet-stream"}

    with httpx.Client(timeout=30) as client:
        assert client.put(urls[0]).status_code == 201
        assert client.post(urls[0], content=frame(big), headers=headers).status_code == 204

        # Both processes append at once; each sees more than THRESHOLD bytes since no snapshot.
        def append(url_and_update: tuple[str, bytes]) -> int:
            url, update = url_and_update
            with httpx.Client(timeout=30) as own:
                return own.post(url, content=frame(update), headers=headers).status_code

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            statuses = list(pool.map(append, [(urls[0], small_1), (urls[1], small_2)]))
        assert statuses == [204, 204]

        deadline = time.monotonic() + 10
        while "_snapshot" not in client.get(urls[1], params={"offset": "snapshot"}).headers.get(
            "Location", ""
        ):
            assert time.monotonic() < deadline, "no compaction happened"
            time.sleep(0.05)
        time.sleep(1.0)  # give the other process time to try, and find nothing to do

        location = client.get(urls[0], params={"offset": "snapshot"}).headers["Location"]
        snapshot = client.get(f"{first.base_url}{location}")
        assert snapshot.status_code == 200
        # The snapshot covers what was stored when the compaction started: both small updates,
        # or only the one that committed first (the other is then below the threshold). A
        # client loads it, then the updates from its Stream-Next-Offset on.
        since = client.get(urls[1], params={"offset": snapshot.headers["Stream-Next-Offset"]})
        assert since.status_code == 200
        pending = read_frames(since.content)
        assert len(pending) <= 1
        restored = Doc()
        restored_text = restored.get("text", type=Text)
        restored.apply_update(snapshot.content)
        for update in pending:
            restored.apply_update(update)
        assert str(restored_text) == str(text)

    with psycopg.connect(database_url) as conn:
        compactions, snapshots = conn.execute(
            "SELECT d.compactions, (SELECT count(*) FROM yjs_snapshot s"
            " WHERE s.document_id = d.stream_id) FROM yjs_document d"
            " WHERE d.service = 'tests' AND d.path = %s",
            (doc_path,),
        ).fetchone()
    assert (compactions, snapshots) == (1, 1)
