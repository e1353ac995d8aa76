"""Borrowing from the pool (streams/store/pool.py) when connections are scarce: a request
waits out the acquisition timeout while the database is healthy, and gives up after
OUTAGE_WAIT_SECS only when it is failing (the outage itself: tests/faults)."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import pytest
from psycopg_pool import PoolTimeout

from streams.errors import ServiceUnavailable
from streams.store import pool
from tests.store.test_contract import run


@pytest.fixture
def one_connection(settings: Any) -> None:
    settings.DS_DB_POOL_MIN_SIZE = 1
    settings.DS_DB_POOL_MAX_SIZE = 1
    settings.DS_DB_ACQUIRE_TIMEOUT_SECS = 20


async def _hold(seconds: float) -> None:
    async with pool.connection() as conn:
        await conn.execute("SELECT 1")
        await asyncio.sleep(seconds)


async def _borrow_behind_a_holder(hold_seconds: float) -> tuple[int, float]:
    holder = asyncio.create_task(_hold(hold_seconds))
    await asyncio.sleep(0.1)
    asked = time.monotonic()
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT 42")).fetchone()
    await holder
    assert row is not None
    return row[0], time.monotonic() - asked


def test_a_busy_pool_of_a_healthy_database_lends_after_the_outage_wait(
    one_connection: None,
) -> None:
    async def scenario() -> tuple[int, float]:
        pool._Health.failed()  # a failure long gone: a statement succeeded since
        await _hold(0)
        return await _borrow_behind_a_holder(pool.OUTAGE_WAIT_SECS * 4)

    value, waited = run(scenario)
    assert value == 42
    assert waited > pool.OUTAGE_WAIT_SECS  # it did wait past the outage wait, and was lent


def test_a_busy_pool_of_a_failing_database_refuses_after_the_outage_wait(
    one_connection: None,
) -> None:
    async def scenario() -> None:
        await _hold(0)
        pool._Health.failed()  # as a lent connection failing would
        await _borrow_behind_a_holder(pool.OUTAGE_WAIT_SECS * 4)

    with pytest.raises(ServiceUnavailable) as refused:
        run(scenario)
    assert isinstance(refused.value.__context__, PoolTimeout)


def test_waiting_requests_keep_their_place_in_the_queue(
    one_connection: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking whether the database is failing does not send a waiting request to the back of
    the pool's queue: the first to wait is the first lent (it used to give up its place after
    the outage wait and queue again behind the later one)."""
    monkeypatch.setattr(pool, "OUTAGE_WAIT_SECS", 1.0)
    lent: list[str] = []

    async def borrow(name: str) -> None:
        async with pool.connection():
            lent.append(name)

    async def scenario() -> None:
        await _hold(0)
        holder = asyncio.create_task(_hold(1.35))  # released between 1.0 s and 1.6 s
        await asyncio.sleep(0.1)
        first = asyncio.create_task(borrow("first"))  # asks at 1.1 s
        await asyncio.sleep(0.5)
        second = asyncio.create_task(borrow("second"))  # would ask at 1.6 s
        await asyncio.gather(holder, first, second)

    run(scenario)
    assert lent == ["first", "second"]


def test_a_waiting_request_cancelled_leaves_the_connection_in_the_pool(
    one_connection: None,
) -> None:
    """A request cancelled while it waits for a connection (its client gone) takes nothing
    with it: the connection goes back to the pool and the next request is lent it."""

    async def scenario() -> int:
        await _hold(0)
        holder = asyncio.create_task(_hold(pool.OUTAGE_WAIT_SECS * 3))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(_hold(0))
        await asyncio.sleep(pool.OUTAGE_WAIT_SECS * 1.5)  # past its first question
        waiting.cancel()
        await asyncio.gather(holder, waiting, return_exceptions=True)
        value, _ = await _borrow_behind_a_holder(0)
        return value

    assert run(scenario) == 42


def test_the_connection_given_back_last_is_lent_first(settings: Any) -> None:
    """The pool lends its most recently used connection (pool._LastInFirstOutPool): a
    sequence of requests keeps to one warm backend instead of taking every connection in
    turn. Two connections lent at once and given back one after the other: the next three
    borrowers get the second one given back, each time."""
    settings.DS_DB_POOL_MIN_SIZE = 2
    settings.DS_DB_POOL_MAX_SIZE = 2

    async def backend(conn: Any) -> int:
        row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
        return int(row[0])

    async def scenario() -> tuple[list[int], list[int]]:
        first = pool.connection()
        second = pool.connection()
        pids = [await backend(await first.__aenter__()), await backend(await second.__aenter__())]
        await first.__aexit__(None, None, None)
        await second.__aexit__(None, None, None)
        lent = []
        for _ in range(3):
            async with pool.connection() as conn:
                lent.append(await backend(conn))
        return pids, lent

    pids, lent = run(scenario)
    assert len(set(pids)) == 2
    assert lent == [pids[1]] * 3


def test_what_the_pool_reads_to_give_back_in_place_is_there() -> None:
    """``_LastInFirstOutPool.putconn`` gives a connection back in the caller's task only when
    nothing could make that wait: it reads psycopg_pool's queue of waiting clients and lock,
    and the lock's own queue of waiters. A free asyncio lock with a task woken for it, not yet
    run, makes its next taker wait (review: a give-back cancelled there lost the connection)."""

    async def scenario() -> bool:
        lock = asyncio.Lock()
        await lock.acquire()
        waiter = asyncio.ensure_future(lock.acquire())
        await asyncio.sleep(0)
        lock.release()  # free, with the waiter woken but not run yet
        queued = not lock.locked() and bool(lock._waiters)
        await waiter
        lock.release()
        return queued

    assert asyncio.run(scenario())

    async def opened() -> Any:
        return await pool.get_pool()

    opened_pool = run(opened)
    assert isinstance(opened_pool._waiting, collections.deque)
    assert isinstance(opened_pool._lock, asyncio.Lock)
