"""Compaction across server processes (YJS-PROTOCOL.md 8): when two processes both see a
document cross the threshold, exactly one compaction runs."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import psycopg

from tests.yjs.support import (
    COMPACTION_THRESHOLD,
    OCTET,
    Writer,
    compaction_counts,
    content_of,
    frame,
    read_frames,
    wait_for,
)


def test_one_compaction_when_two_processes_cross_the_threshold(
    compacting_servers: tuple[Any, Any], pg: psycopg.Connection[Any]
) -> None:
    first, second = compacting_servers
    doc_path = f"multiprocess/{time.time_ns()}"
    urls = [f"{s.base_url}/v1/yjs/tests/docs/{doc_path}" for s in (first, second)]

    writer = Writer()
    big = writer.edit("x" * 1400)  # one update just under the threshold
    small_1 = writer.edit("first " * 20)
    small_2 = writer.edit("second " * 20)
    just_under = len(frame(big))
    assert just_under < COMPACTION_THRESHOLD < just_under + min(len(small_1), len(small_2))

    with httpx.Client(timeout=30) as client:
        assert client.put(urls[0]).status_code == 201
        assert client.post(urls[0], content=frame(big), headers=OCTET).status_code == 204

        # Both processes append at once; each sees the threshold crossed with no snapshot.
        def append(url_and_update: tuple[str, bytes]) -> int:
            url, update = url_and_update
            with httpx.Client(timeout=30) as own:
                return own.post(url, content=frame(update), headers=OCTET).status_code

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            statuses = list(pool.map(append, [(urls[0], small_1), (urls[1], small_2)]))
        assert statuses == [204, 204]

        def snapshot_location() -> str | None:
            answer = client.get(urls[1], params={"offset": "snapshot"})
            location = answer.headers.get("Location", "")
            return location if "_snapshot" in location else None

        wait_for(snapshot_location, 10, "a compaction")
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
        assert content_of(snapshot.content, *pending) == writer.content

    assert compaction_counts(pg, "tests", doc_path) == (1, 1)
