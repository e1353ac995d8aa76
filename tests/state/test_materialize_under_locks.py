"""Materialization meeting a lock it cannot have in time (an operator's session holding an
entity row, a table locked): the run fails and is tried again, and no event is taken for
invalid because of it (probe 10l: one entity row held for 35 s made an acknowledged update be
skipped for good, ``invalid_events`` 1, the entity never updated).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import psycopg

from tests.conftest import ServerProcess
from tests.state.support import (
    append_ok,
    change,
    create_json_stream,
    entity_map,
    register_ok,
    registration,
)


def test_an_entity_row_held_delays_materialization_and_loses_nothing(
    start_server: Any, database_url: str
) -> None:
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "1", "DS_STATE__SWEEP_INTERVAL_SECS": "0.5"}
    )
    path = f"state-locks/{time.time_ns()}"
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        create_json_stream(http, path)
        register_ok(http, path)
        append_ok(http, path, [change("t", "a", {"v": 1})])
        assert entity_map(http, path) == {("t", "a"): {"v": 1}}
        with psycopg.connect(database_url) as holder:
            holder.execute(
                "SELECT 1 FROM ds_entity AS n JOIN ds_stream AS s ON s.id = n.stream_id"
                " WHERE s.path = %s FOR UPDATE OF n",
                [path],
            )
            append_ok(http, path, [change("t", "a", {"v": 2}, op="update")])
            time.sleep(3)  # the materialization after the append, and sweeps, meet the lock
            holder.rollback()
        deadline = time.monotonic() + 20
        while entity_map(http, path) != {("t", "a"): {"v": 2}} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert entity_map(http, path) == {("t", "a"): {"v": 2}}
        assert registration(http, path).json()["invalid_events"] == 0


def test_materializations_waiting_for_a_lock_leave_connections_for_requests(
    start_server: Any, database_url: str
) -> None:
    """Probe 10l: every state stream's materialization (and every sink's run) took a pooled
    connection of its own and held it while it waited for a lock: with ``ds_entity`` locked,
    twelve state streams' runs took the pool, and unrelated appends and reads answered 503.
    Background work of that kind holds a third of the pool at most."""
    server: ServerProcess = start_server()
    stamp = time.time_ns()
    paths = [f"state-pool/{stamp}/{n}" for n in range(12)]
    plain = server.stream_url(f"state-pool/{stamp}/plain")
    statuses: list[int] = []
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for path in paths:
            create_json_stream(http, path)
            register_ok(http, path)
        assert http.put(plain, headers={"Content-Type": "text/plain"}).status_code == 201
        with psycopg.connect(database_url) as locker:
            locker.execute("LOCK TABLE ds_entity IN ACCESS EXCLUSIVE MODE")
            for path in paths:  # each schedules its stream's materialization
                append_ok(http, path, [change("t", "k", 1)])
            until = time.monotonic() + 8
            while time.monotonic() < until:
                post = http.post(plain, content=b"x", headers={"Content-Type": "text/plain"})
                statuses.append(post.status_code)
                statuses.append(http.get(plain, params={"offset": "-1"}).status_code)
            locker.rollback()
        for path in paths:
            assert entity_map(http, path) == {("t", "k"): 1}
    assert statuses and set(statuses) <= {200, 204}, sorted(set(statuses))
