"""A database whose tables someone else holds locked (a long transaction, an operator's LOCK
TABLE, a migration) gives requests a bounded wait and a 503 with Retry-After, then serves
again: no request waits for as long as the lock lasts (DS_DB__LOCK_TIMEOUT_SECS,
streams/store/pool.py).

Found by a probe: with ``ds_message`` locked for 90 s, every append, create and catch-up read
that had its pooled connection waited 89 s, and only requests still queued for a connection
heard a 503.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import psycopg

from tests.conftest import ServerProcess

TEXT = {"Content-Type": "text/plain"}
# Longer than the server's lock timeout here (1 s) by far; a request that waited for the lock
# instead would time out on this.
CLIENT_TIMEOUT_SECS = 6.0


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


def test_a_stream_whose_row_is_held_does_not_hold_other_streams(
    start_server: Any, database_url: str
) -> None:
    """Probe 10e: with one stream's row held (a session's SELECT ... FOR UPDATE), another
    stream's append that shared a group-commit transaction with it waited 40 s: the transaction
    failed after the lock timeout, each stream was written again alone (the held one first,
    waiting as long again), and then each append to the held stream alone, a lock timeout
    each. Now a lock timeout is nobody's fault: the held stream's appends answer 503 together,
    and the streams tried again alone wait briefly for their locks. One write slot, so the
    appends to both streams are bound to share a transaction."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "1", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    held, other = f"a-held/{stamp}", f"b-other/{stamp}"

    async def run(locker: psycopg.Connection[Any]) -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_SECS) as http:
            for path in (held, other):
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            locker.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", (held,))
            to_held = [
                asyncio.create_task(
                    http.post(server.stream_url(held), headers=TEXT, content=b"%d" % n)
                )
                for n in range(8)
            ]
            await asyncio.sleep(0.3)  # the first is waiting for the lock, the rest queued
            # Answered within the client's timeout, while the row is still held: before, this
            # waited for the held stream's eight lock timeouts and more.
            to_other = await http.post(server.stream_url(other), headers=TEXT, content=b"fine")
            return await asyncio.gather(*to_held), to_other

    with psycopg.connect(database_url) as locker:
        to_held, to_other = asyncio.run(run(locker))
        locker.rollback()
    assert to_other.status_code == 204, to_other.text
    for response in to_held:
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) > 0
    with httpx.Client(timeout=CLIENT_TIMEOUT_SECS) as http:
        assert http.get(server.stream_url(held), params={"offset": "-1"}).content == b""
        assert http.get(server.stream_url(other), params={"offset": "-1"}).content == b"fine"
    # The brief waits for a lock cost no pooled connection (review: a transaction block
    # around them left each connection in error after its timeout, and it was thrown away).
    assert "discarding" not in server.log_path.read_text()


def test_appends_behind_a_held_row_wait_their_turn_while_other_streams_go_on(
    start_server: Any, database_url: str
) -> None:
    """With one write slot, an append waiting for a held stream row kept the slot, and every
    other stream's appends in the process waited behind it for as long as the lock timeout
    (15 s by default). Now a transaction waits for a lock a slice at a time, and between
    slices the other streams are written; the held stream's appends, still within the lock
    timeout, are written in their order once the row is free."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "30", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    held = f"held/{stamp}"
    others = [f"other-{n}/{stamp}" for n in range(3)]

    async def run(locker: psycopg.Connection[Any]) -> tuple[list[httpx.Response], list[int]]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_SECS) as http:
            for path in (held, *others):
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            locker.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", (held,))
            to_held = []
            for n in range(5):
                body = b"%d" % n
                post = http.post(server.stream_url(held), headers=TEXT, content=body)
                to_held.append(asyncio.create_task(post))
                await asyncio.sleep(0.05)  # they arrive in this order
            # Twenty, one after another, within the client's timeout (6 s) while the row is
            # still held: before, the first waited for the held stream's lock timeout (30 s);
            # then each for a slice of the held stream's (0.8 s each, probe 10i).
            statuses = []
            async with asyncio.timeout(CLIENT_TIMEOUT_SECS):
                for n in range(20):
                    path = others[n % len(others)]
                    post = http.post(server.stream_url(path), headers=TEXT, content=b"%d," % n)
                    statuses.append((await post).status_code)
            locker.rollback()
            return await asyncio.gather(*to_held), statuses

    with psycopg.connect(database_url) as locker:
        to_held, statuses = asyncio.run(run(locker))
    assert statuses == [204] * 20
    assert [response.status_code for response in to_held] == [204] * 5
    with httpx.Client(timeout=CLIENT_TIMEOUT_SECS) as http:
        assert http.get(server.stream_url(held), params={"offset": "-1"}).content == b"01234"
        for k, path in enumerate(others):
            expected = b"".join(b"%d," % n for n in range(k, 20, len(others)))
            assert http.get(server.stream_url(path), params={"offset": "-1"}).content == expected
    assert "discarding" not in server.log_path.read_text()


def test_appends_behind_a_locked_table_answer_at_their_lock_timeout(
    start_server: Any, database_url: str
) -> None:
    """Probe 10i: with ``ds_message`` locked (an operator's LOCK TABLE), appends to many
    streams answered 25-49 s after a 15 s lock timeout: after the transaction of all of them
    timed out, each stream was tried alone, one after another, a lock wait each, and an append
    was judged late only when its stream's turn came back. Each now answers 503 at its lock
    timeout (2 s here, one slice more at most); before, most were still waiting when the lock
    went, 6 s in, and were stored then."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "2", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    paths = [f"table-locked-{n}/{stamp}" for n in range(8)]

    async def run(locker: psycopg.Connection[Any]) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            for path in paths:
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            locker.execute("LOCK TABLE ds_message IN ACCESS EXCLUSIVE MODE")
            posts = [
                asyncio.create_task(http.post(server.stream_url(path), headers=TEXT, content=b"x"))
                for path in paths
            ]
            await asyncio.sleep(6)
            locker.rollback()
            return await asyncio.gather(*posts)

    with psycopg.connect(database_url) as locker:
        answers = asyncio.run(run(locker))
    assert [response.status_code for response in answers] == [503] * len(paths)
    assert all(int(response.headers["Retry-After"]) > 0 for response in answers)
    with httpx.Client(timeout=CLIENT_TIMEOUT_SECS) as http:
        for path in paths:
            assert http.get(server.stream_url(path), params={"offset": "-1"}).content == b""
            assert http.post(server.stream_url(path), headers=TEXT, content=b"y").status_code == 204


def test_streams_not_held_do_not_wait_behind_many_held_ones(
    start_server: Any, database_url: str
) -> None:
    """Review: after a transaction of several streams missed a lock, every stream in it was
    taken for contended and waited its turn in the contended streams' slot, a slice behind
    each held one: with 8 rows held, appends to the other streams took 9 s (16 rows: 15 s and
    503s). Only the streams whose rows are held are contended now."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "30", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    held = [f"many-held-{n}/{stamp}" for n in range(8)]
    others = [f"many-free-{n}/{stamp}" for n in range(3)]

    async def run(locker: psycopg.Connection[Any]) -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(timeout=40) as http:
            for path in (*held, *others):
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            locker.execute("SELECT 1 FROM ds_stream WHERE path = ANY(%s) FOR UPDATE", (held,))
            # The held streams' appends and the others' first ones share a transaction.
            to_held = [
                asyncio.create_task(http.post(server.stream_url(path), headers=TEXT, content=b"h"))
                for path in held
            ]
            await asyncio.sleep(0.3)  # the first waits for its lock, the rest are queued
            statuses = []
            async with asyncio.timeout(CLIENT_TIMEOUT_SECS):  # before: 7-9 s
                for n in range(20):
                    path = others[n % len(others)]
                    post = http.post(server.stream_url(path), headers=TEXT, content=b"%d," % n)
                    statuses.append((await post).status_code)
            locker.rollback()
            return [r.status_code for r in await asyncio.gather(*to_held)], statuses

    with psycopg.connect(database_url) as locker:
        to_held, statuses = asyncio.run(run(locker))
    assert statuses == [204] * 20
    assert to_held == [204] * len(held)


def test_a_stream_whose_row_stays_held_stays_contended(
    start_server: Any, database_url: str
) -> None:
    """Review: a contended stream's queue, emptied by its 503s, forgot the contention; the
    client's next append to the row still held was written in the write slot again, holding
    every other stream's appends for a slice (about 1 s) each time. Here a client retries the
    held stream five times (a 503 after the 1 s lock timeout each) while another appends to
    another stream one after another: before, it got about one append through per retry."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "1", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    held, other = f"still-held/{stamp}", f"still-free/{stamp}"

    async def run(locker: psycopg.Connection[Any]) -> tuple[list[int], int]:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_SECS) as http:
            for path in (held, other):
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            locker.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", (held,))
            retries: list[int] = []

            async def retry() -> None:
                for _ in range(5):
                    post = http.post(server.stream_url(held), headers=TEXT, content=b"h")
                    retries.append((await post).status_code)

            retrying = asyncio.create_task(retry())
            appended = 0
            while not retrying.done():
                post = http.post(server.stream_url(other), headers=TEXT, content=b"x")
                assert (await post).status_code == 204
                appended += 1
            await retrying
            locker.rollback()
            return retries, appended

    with psycopg.connect(database_url) as locker:
        retries, appended = asyncio.run(run(locker))
    assert retries == [503] * 5
    # Milliseconds each, for five seconds: hundreds (before: about one a retry).
    assert appended > 50, appended


def test_appends_of_streams_contended_lately_answer_at_their_lock_timeout(
    start_server: Any, database_url: str
) -> None:
    """Review: a stream remembered as contended starts its next queue contended, and that
    queue had no timer: its appends waited their turn in the contended slot, a slice behind
    every other contended stream, past the lock timeout (7 of 68 answered 204 after two lock
    timeouts, once the lock went). Here eight streams are appended to again after every answer
    while ``ds_message`` is locked for 10 s; nothing is sent after 6 s, so with a 2 s lock
    timeout every append is answered 503 before the lock goes."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "2", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    paths = [f"lately-{n}/{stamp}" for n in range(8)]

    async def run(locker: psycopg.Connection[Any]) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as http:
            for path in paths:
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            locker.execute("LOCK TABLE ds_message IN ACCESS EXCLUSIVE MODE")
            stop_sending = time.monotonic() + 6
            statuses: list[int] = []

            async def keep_appending(path: str) -> None:
                while time.monotonic() < stop_sending:
                    post = http.post(server.stream_url(path), headers=TEXT, content=b"x")
                    statuses.append((await post).status_code)

            sending = asyncio.gather(*(keep_appending(path) for path in paths))
            await asyncio.sleep(10)
            locker.rollback()
            await sending
            return statuses

    with psycopg.connect(database_url) as locker:
        statuses = asyncio.run(run(locker))
    assert statuses and set(statuses) == {503}, statuses


def test_appends_are_answered_when_the_question_of_held_rows_fails(
    start_server: Any, database_url: str
) -> None:
    """Review: after a transaction of several streams missed a lock, the question of which
    rows are held (``ds_held_streams``) failing (cancelled here by an operator, or its
    connection cut) left the transaction's appends in no queue, never answered. They are
    answered now: 503 at their lock timeout, or stored once the lock goes."""
    server: ServerProcess = start_server(
        env={"DS_DB__LOCK_TIMEOUT_SECS": "3", "DS_DB__WRITE_TRANSACTIONS": "1"}
    )
    stamp = time.time_ns()
    paths = [f"asked-{n}/{stamp}" for n in range(6)]

    async def run(locker: psycopg.Connection[Any], admin: psycopg.Connection[Any]) -> list[int]:
        async with httpx.AsyncClient(timeout=20) as http:
            for path in paths:
                assert (await http.put(server.stream_url(path), headers=TEXT)).status_code == 201
            # The rows cannot be locked while the table is, and the question waits for it.
            locker.execute("LOCK TABLE ds_stream IN EXCLUSIVE MODE")
            posts = [
                asyncio.create_task(http.post(server.stream_url(path), headers=TEXT, content=b"x"))
                for path in paths
            ]
            cancelled = 0
            async with asyncio.timeout(10):
                while not cancelled:
                    await asyncio.sleep(0.05)
                    cancelled = admin.execute(
                        "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity"
                        " WHERE query LIKE 'SELECT ds_held_streams%%'"
                    ).fetchone()[0]
            await asyncio.sleep(4)
            locker.rollback()
            return [response.status_code for response in await asyncio.gather(*posts)]

    with (
        psycopg.connect(database_url) as locker,
        psycopg.connect(database_url, autocommit=True) as admin,
    ):
        statuses = asyncio.run(run(locker, admin))
    assert len(statuses) == len(paths) and set(statuses) <= {204, 503}, statuses
