"""The append statements, run through libpq directly (psycopg's ``pq`` binding) rather than
through psycopg's cursors.

An append is one statement, and psycopg's machinery around it (a cursor, the adaptation of
every parameter by type, a generator driving libpq and an event-loop wait per step, rows made
by loaders) cost more of the server's time than the statement's own work in PostgreSQL: 235 us
against 145 us of this process's CPU per ``ds_append`` here, measured side by side
(docs/benchmarks.md). The callers know their parameters' types and their rows' columns, so
each statement here says them once: parameters go as bytes (text, or binary for ``bytea``),
columns come back as text and are parsed by one function each.

Each statement is prepared once per connection, under a name of its own (psycopg's are
``_pg3_*``), on the connections of ``streams.store.pool``, which run in autocommit mode: a
statement is its own transaction, and the connection is idle again when its rows are read.
An error PostgreSQL reports is raised as psycopg raises it (``psycopg.errors``), so callers
judge it the same way. A caller cancelled mid-statement first has PostgreSQL cancel the
statement and waits for the exchange to end (``_settle``), as psycopg does for its own; a
connection still mid-statement then (the socket failed, no answer) is closed, so the pool
replaces it rather than lend it in an unknown state.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from psycopg import AsyncConnection, OperationalError, errors, pq

from streams import tracing

Param = str | bytes | int | bool | None
Column = Callable[[bytes], Any]


def text(value: bytes) -> str:
    return value.decode()


def boolean(value: bytes) -> bool:
    return value == b"t"


integer: Column = int

# The statements prepared on each connection, by name.
_prepared: weakref.WeakKeyDictionary[AsyncConnection[Any], set[bytes]] = weakref.WeakKeyDictionary()


class Statement:
    """A statement with PostgreSQL's placeholders (``$1``...), the placeholders whose values
    go binary (``bytea``; the others go as text) and a parser per column."""

    __slots__ = ("columns", "formats", "name", "sql", "text")

    def __init__(self, name: str, sql: str, binary: Sequence[int], columns: Sequence[Column]):
        self.name = name.encode()
        self.text = sql
        self.sql = sql.encode()
        count = max(map(int, re.findall(r"\$(\d+)", sql)), default=0)
        self.formats = [1 if n in binary else 0 for n in range(1, count + 1)]
        self.columns = tuple(columns)


async def run(
    conn: AsyncConnection[Any], statement: Statement, params: Sequence[Param]
) -> list[tuple[Any, ...]]:
    """The rows of ``statement`` with ``params`` on ``conn`` (a connection of the pool)."""
    with tracing.statement(statement.text):
        result = await _execute(conn, statement, params)
    columns = statement.columns
    get = result.get_value
    return [
        tuple(
            None if (value := get(row, col)) is None else parse(value)
            for col, parse in enumerate(columns)
        )
        for row in range(result.ntuples)
    ]


async def _execute(
    conn: AsyncConnection[Any], statement: Statement, params: Sequence[Param]
) -> pq.abc.PGresult:
    """The statement's result. A connection's prepared statements can vanish under this
    module: psycopg sends ``DEALLOCATE ALL`` when a transaction on a connection where it
    prepared statements of its own rolls back (an error or a cancellation inside ``async with
    conn.transaction()``). PostgreSQL refuses to bind a statement it does not have before
    running anything, so the statements are prepared again and it is sent once more."""
    try:
        return await _execute_once(conn, statement, params)
    except errors.InvalidSqlStatementName:
        _prepared.pop(conn, None)
        return await _execute_once(conn, statement, params)


async def _execute_once(
    conn: AsyncConnection[Any], statement: Statement, params: Sequence[Param]
) -> pq.abc.PGresult:
    pgconn = conn.pgconn
    values = [_encode(value) for value in params]
    prepared = _prepared.setdefault(conn, set())
    try:
        if statement.name not in prepared:
            pgconn.send_prepare(statement.name, statement.sql)
            await _flush(pgconn)
            await _result(pgconn)
            prepared.add(statement.name)
        if _send_blocking(pgconn, values):
            _send_whole(pgconn, statement, values)
        else:
            pgconn.send_query_prepared(statement.name, values, statement.formats)
            await _flush(pgconn)
        result = await _result(pgconn)
    except BaseException as exc:
        cancelled = isinstance(exc, asyncio.CancelledError)
        try:
            if cancelled:
                await _settle(conn)
        finally:
            # Kept when idle after an error PostgreSQL reported, or after a cancelled execute
            # (a cancelled prepare may or may not exist now); else the pool replaces it.
            if not (
                pgconn.transaction_status == pq.TransactionStatus.IDLE
                and (isinstance(exc, errors.Error) or (cancelled and statement.name in prepared))
            ):
                pgconn.finish()
        if isinstance(exc, OSError):
            raise OperationalError(f"connection failed: {exc}") from exc
        raise
    return result


# How long a cancelled caller waits for PostgreSQL to end its statement (_settle), and how
# often it asks again meanwhile.
SETTLE_SECS = 5.0
RECANCEL_SECS = 0.2


async def _settle(conn: AsyncConnection[Any]) -> None:
    """The caller was cancelled mid-statement: ask PostgreSQL to cancel the statement and wait
    for the exchange to end, as psycopg does for its own statements. Closing the connection
    instead would leave the statement running in its backend, which notices the closed socket
    only when it answers: an append waiting for its stream's lock would be written after the
    appends that queued behind it meanwhile. The request is repeated every RECANCEL_SECS: a
    backend still reading the statement when the request arrives ignores it. Once settled the
    statement has either committed or never will, and the connection is idle again. If
    PostgreSQL does not answer within SETTLE_SECS (gone, or unreachable), the connection is
    closed as before.

    The waits are ``asyncio.wait`` on a task of the exchange, not ``asyncio.timeout``: the
    caller's task is being cancelled, and before Python 3.12 a timeout inside a task with a
    cancellation pending lets the CancelledError through instead of its TimeoutError."""
    pgconn = conn.pgconn
    if pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_SECS
    exchange = loop.create_task(_finish_exchange(pgconn))
    try:
        while not exchange.done() and loop.time() < deadline:
            with contextlib.suppress(errors.Error):  # the cancel request failed: try again
                await conn.cancel_safe(timeout=max(0.0, deadline - loop.time()))
            await asyncio.wait({exchange}, timeout=RECANCEL_SECS)
    finally:
        if not exchange.done():
            exchange.cancel()  # not answering: the caller closes the connection...
            # ... once the task stopped waiting on its socket (whose descriptor is reused).
            await asyncio.wait({exchange})
        if exchange.done() and not exchange.cancelled():
            exchange.exception()  # retrieved: what failed there is not the caller's to report


async def _finish_exchange(pgconn: pq.abc.PGconn) -> None:
    """Send what is left of the statement and read its results to the end. Its outcome
    (cancelled as asked, or failed on its own) is not the cancelled caller's to report."""
    with contextlib.suppress(errors.Error, OSError):
        await _flush(pgconn)
        await _result(pgconn)


# Statements whose parameters are larger than this are sent in blocking mode over a Unix
# socket (_send_blocking).
LARGE_SEND_BYTES = 1024 * 1024


def _send_blocking(pgconn: pq.abc.PGconn, values: list[bytes | None]) -> bool:
    """Is this a large statement to a PostgreSQL on this machine (a Unix socket: libpq's host
    is its directory)? Such a one is sent in blocking mode (_send_whole). Over TCP the database
    may be far, or unreachable for minutes, and a blocked send would stop every request of
    the process: there libpq stays non-blocking."""
    return (pgconn.host or b"").startswith(b"/") and (
        sum(len(value) for value in values if value) > LARGE_SEND_BYTES
    )


def _send_whole(pgconn: pq.abc.PGconn, statement: Statement, values: list[bytes | None]) -> None:
    """Send a large statement at once, libpq waiting for the socket itself. In non-blocking
    mode libpq writes what the socket takes and moves the rest of its buffer to the buffer's
    start, at every write: a 14 MiB append was moved about 70 times over a Unix socket, 25 ms
    of the server's CPU in ``memmove`` (docs/benchmarks.md). The event loop waits meanwhile
    for the local server to read it, which it does as one message, at once."""
    pgconn.nonblocking = 0
    try:
        pgconn.send_query_prepared(statement.name, values, statement.formats)
        pgconn.flush()
    finally:
        pgconn.nonblocking = 1


def _encode(value: Param) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, int):
        return str(value).encode()
    raise TypeError(f"a parameter of {type(value).__name__}: send it as text")


async def _flush(pgconn: pq.abc.PGconn) -> None:
    """Send what libpq buffered (all of it at once but for large parameters)."""
    while pgconn.flush():
        await _ready(pgconn.socket, writing=True)


async def _result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult:
    """The statement's result, once libpq has read all the server answered, up to the end of
    the exchange: only then has an autocommit statement's transaction committed. Its rows come
    first, and the commit can still fail after them (a deferred trigger, the server going
    away): any error in the exchange is raised, the rows never returned then. libpq is never
    asked for a result it has not read yet (it would block the event loop for it)."""
    first: pq.abc.PGresult | None = None
    error: pq.abc.PGresult | None = None
    while True:
        pgconn.consume_input()
        while pgconn.is_busy():
            await _ready(pgconn.socket, writing=False)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            break
        if result.status == pq.ExecStatus.FATAL_ERROR:
            error = error or result
        elif result.status in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            first = first or result
        else:
            raise errors.InternalError(f"unexpected result {result.status!r}")
    if error is not None:
        raise _error(error)
    if first is None:
        raise errors.InternalError("no result")
    return first


def _error(result: pq.abc.PGresult) -> errors.Error:
    """The error PostgreSQL reported, as psycopg raises it; one without a SQLSTATE is libpq's
    own (the connection failed): an OperationalError, as psycopg makes it."""
    if not result.error_field(pq.DiagnosticField.SQLSTATE):
        message = (result.error_message or b"connection failed").decode(errors="replace")
        return OperationalError(message.strip())
    return errors.error_from_result(result, encoding="utf-8")


async def _ready(fd: int, *, writing: bool) -> None:
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    if writing:
        loop.add_writer(fd, _wake, waiter)
    else:
        loop.add_reader(fd, _wake, waiter)
    try:
        await waiter
    finally:
        if writing:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
