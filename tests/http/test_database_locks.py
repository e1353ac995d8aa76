"""A database whose tables someone else holds locked (a long transaction, an operator's LOCK
TABLE, a migration) gives requests a bounded wait and a 503 with Retry-After, then serves
again: no request waits for as long as the lock lasts (DS_DB__LOCK_TIMEOUT_SECS,
streams/store/pool.py).

Found by a probe: with ``ds_message`` locked for 90 s, every append, create and catch-up read
that had its pooled connection waited 89 s, and only requests still queued for a connection
heard a 503.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import psycopg

from tests.conftest import ServerProcess

TEXT = {"Content-Type": "text/plain"}
# Longer than the server's lock timeout here (1 s) by far; a request that waited for the lock
# instead would time out on this.
CLIENT_TIMEOUT_SECS = 10.0


def test_a_locked_table_answers_503_and_nothing_is_stored(
    start_server: Any, database_url: str
) -> None:
    server: ServerProcess = start_server(env={"DS_DB__LOCK_TIMEOUT_SECS": "1"})
    url = server.stream_url(f"locked/{time.time_ns()}")
    with httpx.Client(timeout=CLIENT_TIMEOUT_SECS) as http:
        assert http.put(url, headers=TEXT).status_code == 201
        assert http.post(url, headers=TEXT, content=b"before").status_code == 204
        with psycopg.connect(database_url) as locker:
            locker.execute("LOCK TABLE ds_message IN ACCESS EXCLUSIVE MODE")
            append = http.post(url, headers=TEXT, content=b"while locked")
            read = http.get(url, params={"offset": "-1"})
            locker.rollback()
        for response in (append, read):
            assert response.status_code == 503, response.text
            assert int(response.headers["Retry-After"]) > 0
        assert http.post(url, headers=TEXT, content=b"after").status_code == 204
        read = http.get(url, params={"offset": "-1"})
    assert read.status_code == 200
    assert read.content == b"beforeafter"


def test_pages_and_the_rest_api_wait_for_a_lock_no_longer_than_the_protocol(
    start_server: Any, database_url: str
) -> None:
    """Django's connections (the REST API, the admin, the console) have the same bound: before,
    a catalog read met a locked ``ds_stream`` and waited for as long as the lock lasted, and
    with it one of the four connections Django's pool has per process."""
    server: ServerProcess = start_server(env={"DS_DB__LOCK_TIMEOUT_SECS": "1"})
    prefix = f"locked-catalog/{time.time_ns()}"
    catalog = f"{server.base_url}/v1/streams"
    with httpx.Client(timeout=CLIENT_TIMEOUT_SECS) as http:
        assert http.put(server.stream_url(f"{prefix}/a"), headers=TEXT).status_code == 201
        with psycopg.connect(database_url) as locker:
            locker.execute("LOCK TABLE ds_stream IN ACCESS EXCLUSIVE MODE")
            listed = http.get(catalog, params={"prefix": prefix})
            locker.rollback()
        assert listed.status_code == 503, listed.text
        assert int(listed.headers["Retry-After"]) > 0
        listed = http.get(catalog, params={"prefix": prefix})
    assert listed.status_code == 200, listed.text
    assert [s["path"] for s in listed.json()["results"]] == [f"{prefix}/a"]
