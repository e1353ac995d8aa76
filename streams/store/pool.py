"""The async PostgreSQL connection pool of this server process (DESIGN.md, Request path), and
``connection()``, the one way the hot path borrows a connection.

One pool per process, opened at start-up (``streams.lifecycle``) or on first use. Connections
are taken only for the duration of a statement or transaction: an idle live reader holds none.

The database may be unreachable, or may have restarted under idle connections:
* borrowing waits at most ``DS_DB_ACQUIRE_TIMEOUT_SECS``, then answers 503 with Retry-After,
  so clients hear within seconds instead of hanging; and while the database is failing (a
  connection failed, or the pool's attempts to connect did, after the last statement that
  succeeded) at most ``OUTAGE_WAIT_SECS``: in an outage, waiting the whole timeout for a
  connection that cannot come only makes every request slow to hear 503;
* a connection that sat idle longer than ``IDLE_CHECK_SECS`` is checked (an empty query)
  before it is lent, so the connections a restart killed are replaced instead of failing the
  next requests; a busy connection is never checked, so the hot path pays nothing;
* a connection that fails while lent is discarded by the pool, and the failure answers 503;
* reconnection attempts back off for at most ``RECONNECT_TIMEOUT_SECS`` before starting over,
  so the process serves again within seconds of the database's return, however long it was
  away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from contextvars import ContextVar
from typing import Any, Self

import psycopg
from django.conf import settings
from psycopg import AsyncConnection
from psycopg.conninfo import make_conninfo
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from streams import metrics
from streams.errors import ServiceUnavailable

logger = logging.getLogger(__name__)

# Set while a connection closed on purpose (it carried a large statement) goes back to the
# pool, which warns of every closed connection given back: that warning is for faults only.
_closed_on_purpose: ContextVar[bool] = ContextVar("closed_on_purpose", default=False)


class _NoWarningForClosesOnPurpose(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_closed_on_purpose.get() and record.levelno == logging.WARNING)


logging.getLogger("psycopg.pool").addFilter(_NoWarningForClosesOnPurpose())

# A connection idle longer than this is checked before it is lent (one empty query).
IDLE_CHECK_SECS = 1.0
# Borrowing a connection that took longer than this counts as waiting for one (metrics).
WAIT_SECS = 0.0005
# What a 503 caused by the database asks clients to wait.
RETRY_AFTER_SECS = 2
# While the database is unreachable the pool retries connecting with a doubling backoff (1, 2,
# 4... s) for as long as this, then gives up, and the next request that needs a connection
# starts over at once. Without the bound (psycopg_pool's default is 300 s) the backoff grows
# with the outage, and once the database is back the process goes on answering 503 until its
# next attempt: after a 45 s outage, for up to 30 s more.
RECONNECT_TIMEOUT_SECS = 5.0
# How long a request waits for a connection before asking whether the database is failing
# (then it answers 503 at once; otherwise it waits out the acquisition timeout).
OUTAGE_WAIT_SECS = 0.5

# libpq keeps a connection's buffers as large as the largest statement it sent and the largest
# result it received, for the connection's life: after a 15 MiB append, 15 MiB (and more, the
# buffer doubles) stays with that connection, in every one of the pool's connections in turn.
# A connection that carried more than this is closed when given back and replaced...
BUFFER_KEEP_BYTES = 8 * 1024 * 1024
# ... except the few reserved for larger write transactions (DS_DB__LARGE_WRITE_CONNECTIONS):
# a replaced connection's next large statement runs on a new backend, which compiles the write
# functions again and faults its memory in again (a 14 MiB append 90-100 ms instead of 53-55 ms,
# docs/benchmarks.md). They keep buffers up to this; beyond it they are replaced too.
LARGE_BUFFER_KEEP_BYTES = 32 * 1024 * 1024

_pool: AsyncConnectionPool | None = None
# The connections reserved for write transactions over BUFFER_KEEP_BYTES (None: not opened yet).
_large_pool: AsyncConnectionPool | None = None
_pool_lock: asyncio.Lock | None = None
# When each connection was last given back, by id (a few entries: the pool's connections).
_returned_at: dict[int, float] = {}
# Connections (by id) to close when given back: they carried more than BUFFER_KEEP_BYTES.
_oversized: set[int] = set()
# Connections lent to a request that had given up waiting, on their way back (_give_back).
_giving_back: set[asyncio.Task[None]] = set()


def conninfo(alias: str = "default", *, url: str | None = None) -> str:
    """libpq connection string for a Django database alias (or for ``url`` when given),
    through the Unix socket of DS_DB__SOCKET_DIR when one is set (for the alias)."""
    if url:
        return make_conninfo(url, application_name="durable-streams")
    db = settings.DATABASES[alias]
    params: dict[str, str | int] = {"dbname": db["NAME"]}
    for key, name in (
        ("USER", "user"),
        ("PASSWORD", "password"),
        ("HOST", "host"),
        ("PORT", "port"),
    ):
        if db.get(key):
            params[name] = db[key]
    if settings.DS_DB_SOCKET_DIR:
        params["host"] = settings.DS_DB_SOCKET_DIR
    for key, value in (db.get("OPTIONS") or {}).items():
        if isinstance(value, str | int):
            params[key] = value
    params.setdefault("application_name", "durable-streams")
    return make_conninfo("", **params)


class _Health:
    """Is the database failing? When the last connection failure (a lent connection's, an
    idle one's check, a new connection's, the pool's own attempts included) came after the
    last statement that succeeded. Kept as moments, noted when they happen: the hot path only
    stores a time it already has."""

    last_success = 0.0
    last_failure = 0.0

    @classmethod
    def failed(cls) -> None:
        cls.last_failure = time.monotonic()

    @classmethod
    def failing(cls) -> bool:
        return cls.last_failure > cls.last_success


class _LastInFirstOutPool(AsyncConnectionPool):
    """A pool that lends the connection given back last (psycopg_pool lends the one given
    back first). The busiest connections stay the few the load needs, and their backends
    stay warm: their caches, their prepared statements, the memory they faulted in for large
    statements (a 14 MiB append costs a new backend 60-200 ms for its first five, 25-50 ms
    after). Taking turns, every connection of the pool cools in between, and one idle past
    IDLE_CHECK_SECS is checked (a round trip) before it is lent. PgBouncer lends the same way
    by default. (docs/decisions.md)"""

    async def _get_ready_connection(self, timeout: float | None) -> Any:
        # psycopg_pool takes the ready connection at the left of its deque, and appends the
        # ones given back at the right: the one given back last goes to the left first.
        # tests/store/test_pool.py checks this holds for the psycopg_pool installed.
        ready = self._pool
        if len(ready) > 1:
            ready.appendleft(ready.pop())
        return await super()._get_ready_connection(timeout)

    async def putconn(self, conn: Any) -> None:
        """A connection given back where nothing interrupts it. Giving it back, psycopg_pool
        may wait: for its lock (held, or free with tasks woken for it that have not run
        yet), then for a waiting client's, or for a rollback. A request cancelled there (its
        client left; a GET is cancelled then) left the connection neither lent nor kept, and
        the pool counted it for good (probe 9d: abandoned live reads took 2 of 3 connections
        of a growing pool; review: reads cut at random moments, 2 of 3). Such a give-back
        runs in a task of its own (two turns of the loop more); the usual one, which nothing
        can make wait, stays in the caller's task (tests/store/test_pool.py checks what this
        reads of psycopg_pool's and asyncio's state)."""
        lock = self._lock
        if (
            self._waiting
            or lock.locked()
            or lock._waiters
            or conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE
        ):
            await _unstoppable(super().putconn(conn))
        else:
            await super().putconn(conn)  # nothing it could wait for: no point to cancel it at


class _PoolConnection(AsyncConnection[TupleRow]):
    """The pool's connections: a failed attempt to connect is noted the moment it fails
    (_Health); the pool makes its attempts in its own workers, where no request sees them."""

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
        try:
            return await super().connect(conninfo, **kwargs)
        except psycopg.Error:
            _Health.failed()
            raise


async def _check_if_idle(conn: AsyncConnection) -> None:
    returned = _returned_at.get(id(conn))
    if returned is None or time.monotonic() - returned > IDLE_CHECK_SECS:
        try:
            await AsyncConnectionPool.check_connection(conn)
        except Exception:
            _Health.failed()
            raise


async def get_pool(*, large: bool = False) -> AsyncConnectionPool:
    """The process's pool, or with ``large`` its connections reserved for write transactions
    over BUFFER_KEEP_BYTES (the main pool when there are none: DS_DB__LARGE_WRITE_CONNECTIONS
    is 0)."""
    global _pool, _large_pool, _pool_lock
    large = _reserved(large)
    opened = _large_pool if large else _pool
    if opened is not None:
        return opened
    if _pool_lock is None:
        _pool_lock = asyncio.Lock()
    async with _pool_lock:
        if large and _large_pool is None:
            _large_pool = await _open(
                "durable-streams-large", 0, settings.DS_DB_LARGE_WRITE_CONNECTIONS
            )
        elif not large and _pool is None:
            _pool = await _open(
                "durable-streams", settings.DS_DB_POOL_MIN_SIZE, settings.DS_DB_POOL_MAX_SIZE
            )
    pool = _large_pool if large else _pool
    assert pool is not None
    return pool


def _reserved(large: bool) -> bool:
    """Does a large write transaction get a reserved connection (are there any)?"""
    return large and settings.DS_DB_LARGE_WRITE_CONNECTIONS > 0


async def _open(name: str, min_size: int, max_size: int) -> AsyncConnectionPool:
    # conninfo() carries Django's OPTIONS, the session options among them
    # (settings.DS_DB_SESSION_OPTIONS: the fork depth, and the lock timeout, past which a
    # statement fails with SQLSTATE 55P03, a 503 with Retry-After: streams.store.failures).
    pool: AsyncConnectionPool = _LastInFirstOutPool(
        conninfo(),
        min_size=min_size,
        max_size=max_size,
        kwargs={"autocommit": True},
        open=False,
        name=name,
        timeout=settings.DS_DB_ACQUIRE_TIMEOUT_SECS,
        reconnect_timeout=RECONNECT_TIMEOUT_SECS,
        check=_check_if_idle,
        connection_class=_PoolConnection,
    )
    # Not waiting for the first connections: with the database down the process still starts,
    # and requests answer 503 until it is back.
    await pool.open(wait=False)
    logger.info("database pool %s open (max %d connections)", name, max_size)
    return pool


def count_connections() -> None:
    """Update the pool's gauges (``ds_db_pool_connections``)."""
    if _pool is None:
        return
    stats = _pool.get_stats()
    metrics.POOL_CONNECTIONS.labels("open").set(stats.get("pool_size", 0))
    metrics.POOL_CONNECTIONS.labels("idle").set(stats.get("pool_available", 0))
    metrics.POOL_CONNECTIONS.labels("waiting").set(stats.get("requests_waiting", 0))


async def close_pool() -> None:
    global _pool, _large_pool
    for pool in (_pool, _large_pool):
        if pool is not None:
            await pool.close(timeout=5)
    _pool = _large_pool = None


class connection:
    """A pooled connection for one statement or transaction. The database being unreachable
    (no connection within the acquisition timeout, or the connection failing) is a 503 with
    Retry-After; errors the database reports about a statement pass through unchanged.

    A class rather than a generator-based context manager, and borrowing with getconn and
    putconn: this runs once per statement of the hot path (measured: 21 us -> 8 us per borrow
    without the pool's reset callback and the generator)."""

    __slots__ = ("_conn", "_large", "_pool")

    def __init__(self, *, large: bool = False) -> None:
        # A write transaction over BUFFER_KEEP_BYTES: one of the reserved connections.
        self._large = large

    async def __aenter__(self) -> AsyncConnection:
        if self._large:
            pool = await get_pool(large=True)
        else:
            pool = _pool if _pool is not None else await get_pool()
        self._pool = pool
        asked = time.perf_counter()
        try:
            conn = await self._borrow(pool)
        except PoolTimeout:
            metrics.POOL_TIMEOUTS.inc()
            raise ServiceUnavailable(
                "the database is unavailable; retry later", retry_after=RETRY_AFTER_SECS
            ) from None
        waited = time.perf_counter() - asked
        if waited > WAIT_SECS:
            metrics.POOL_WAITS.inc()
            metrics.POOL_WAIT_SECONDS.observe(waited)
        self._conn = conn
        return conn

    @staticmethod
    async def _borrow(pool: AsyncConnectionPool) -> AsyncConnection:
        """A connection; PoolTimeout after the acquisition timeout, or as soon as the database
        is failing once the request has waited OUTAGE_WAIT_SECS (asked again every
        OUTAGE_WAIT_SECS). With a connection idle the pool lends it at once (unless every idle
        one fails its check); otherwise the wait is a task of its own, so that the request
        keeps its place in the pool's queue while it asks."""
        timeout = settings.DS_DB_ACQUIRE_TIMEOUT_SECS
        if timeout <= OUTAGE_WAIT_SECS:
            return await pool.getconn()
        if pool.get_stats().get("pool_available", 0):
            try:
                return await pool.getconn(OUTAGE_WAIT_SECS)
            except PoolTimeout:
                if _Health.failing():
                    raise
            timeout -= OUTAGE_WAIT_SECS
        waiter = asyncio.ensure_future(pool.getconn(timeout))
        try:
            while True:
                done, _ = await asyncio.wait((waiter,), timeout=OUTAGE_WAIT_SECS)
                if done:
                    return waiter.result()
                if _Health.failing():
                    raise PoolTimeout("the database is failing")
        except BaseException:
            # Given up or cancelled: a connection lent meanwhile goes back.
            waiter.cancel()
            waiter.add_done_callback(lambda w: _give_back(pool, w))
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        conn = self._conn
        if len(_returned_at) > 1024:
            _returned_at.clear()
        now = _returned_at[id(conn)] = time.monotonic()
        if exc is None or (isinstance(exc, psycopg.Error) and not is_connection_failure(exc)):
            _Health.last_success = now  # the database answered
        if _oversized and id(conn) in _oversized:
            _oversized.discard(id(conn))
            metrics.POOL_DISCARDED.inc()
            await _unstoppable(_discard(self._pool, conn))
        else:
            await self._pool.putconn(conn)  # a broken connection is replaced by the pool
        if exc is not None and is_connection_failure(exc):
            _Health.failed()
            logger.warning("database connection failed: %s", str(exc).strip()[:200])
            raise ServiceUnavailable(
                "the database connection failed; retry later", retry_after=RETRY_AFTER_SECS
            ) from None


async def _discard(pool: AsyncConnectionPool, conn: AsyncConnection) -> None:
    """Close ``conn`` and give it back: the pool replaces it."""
    await conn.close()
    closing = _closed_on_purpose.set(True)
    try:
        await pool.putconn(conn)
    finally:
        _closed_on_purpose.reset(closing)


async def _unstoppable(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to its end, whether or not the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(work)
    _giving_back.add(task)
    task.add_done_callback(_giving_back.discard)
    await asyncio.shield(task)


def _give_back(pool: AsyncConnectionPool, waiter: asyncio.Future[AsyncConnection]) -> None:
    if waiter.cancelled() or waiter.exception() is not None:
        return
    task = asyncio.ensure_future(pool.putconn(waiter.result()))
    _giving_back.add(task)
    task.add_done_callback(_giving_back.discard)


class background_connection:
    """A pooled connection for background work of which many tasks run at once (one per state
    stream, one per sink): at most ``background_connections()`` of them at a time per process,
    so that, each waiting for a lock up to the lock timeout, they cannot take the connections
    requests need (probe 10l: 16 sinks whose tables were locked made unrelated appends and
    reads 503)."""

    def __init__(self) -> None:
        self._gate = _background_gate()
        self._connection = connection()

    async def __aenter__(self) -> AsyncConnection:
        await self._gate.acquire()
        try:
            return await self._connection.__aenter__()
        except BaseException:
            self._gate.release()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        try:
            await self._connection.__aexit__(exc_type, exc, tb)
        finally:
            self._gate.release()


def background_connections() -> int:
    """Connections background work of many tasks may hold at once: a third of the pool."""
    return max(1, settings.DS_DB_POOL_MAX_SIZE // 3)


def _background_gate() -> asyncio.Semaphore:
    return loop_semaphore("background connections", background_connections())


_semaphores: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Semaphore] = {}


def loop_semaphore(name: str, size: int) -> asyncio.Semaphore:
    """The running event loop's semaphore ``name`` (of ``size``, made the first time)."""
    loop = asyncio.get_running_loop()
    semaphore = _semaphores.get((loop, name))
    if semaphore is None:
        # A loop of its own per test or thread: the others' are done with.
        for key in [key for key in _semaphores if key[0] is not loop]:
            del _semaphores[key]
        semaphore = _semaphores[(loop, name)] = asyncio.Semaphore(size)
    return semaphore


def carried(conn: AsyncConnection, nbytes: int, *, large: bool = False) -> None:
    """A statement on the borrowed ``conn`` sent or received about ``nbytes``: past
    BUFFER_KEEP_BYTES (LARGE_BUFFER_KEEP_BYTES for a connection reserved for large writes) the
    connection is closed when given back, which frees its buffers."""
    if nbytes > (LARGE_BUFFER_KEEP_BYTES if _reserved(large) else BUFFER_KEEP_BYTES):
        _oversized.add(id(conn))


def is_connection_failure(exc: BaseException) -> bool:
    """Did the connection (not the statement) fail? Then the database is unreachable or went
    away, and whatever was sent may or may not have run."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    # No SQLSTATE: the client library lost the connection. Class 08: connection exceptions.
    # 57P01-57P05: the server is shutting down, crashed, is not accepting connections yet, the
    # database was dropped, or the session was idle past idle_session_timeout; 25P03: idle in
    # a transaction past its timeout (these two closed the connection, and were a 500: probe
    # 10j).
    return (
        sqlstate is None
        or sqlstate.startswith("08")
        or sqlstate in ("57P01", "57P02", "57P03", "57P04", "57P05", "25P03")
    )
