"""Writes: create, append, delete. Each is one call of a SQL function (``sql/functions.sql``)
in one round trip, so the stream's row lock is never held across the network.

Invariants (PROTOCOL.md 5.2, 5.2.1, 8): offsets of a stream strictly increase; an append is
stored entirely or not at all; a duplicate of an accepted producer request stores nothing and
succeeds; data, tail, producer ledger and closure commit together.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection

from streams.errors import OffsetGone, ProtocolError
from streams.protocol.offsets import Offset
from streams.store import prepared
from streams.store.conflicts import retried
from streams.store.outcomes import (
    APPEND_SUCCESSES,
    CREATE_ERRORS,
    CREATE_SUCCESSES,
    DELETE_ERRORS,
    DELETE_SUCCESSES,
    AppendOutcome,
    CreateOutcome,
    DeleteOutcome,
    append_error,
)
from streams.store.pool import BUFFER_KEEP_BYTES, carried, connection
from streams.store.types import AppendRequest, AppendResult, CreateRequest, CreateResult

logger = logging.getLogger(__name__)

_CREATE_SQL = (
    "SELECT outcome, id, content_type, next_seq, next_pos, closed"
    " FROM ds_create(%s, %s, %s, %s, %s, %b::bytea[], %s, %s, %s, %s, %s, %s, %s, %s)"
)
_CREATE_STREAMS_SQL = (
    "SELECT ord, outcome, id, content_type, next_seq, next_pos, closed"
    " FROM ds_create_streams(%s::jsonb, %b::bytea[], %s)"
)
# Scalar parameters only: psycopg's per-element type detection for list parameters cost more
# than the whole SQL function (docs/decisions.md).
_APPEND_COLUMNS = (
    prepared.text,  # outcome
    prepared.integer,  # next_seq
    prepared.integer,  # next_pos
    prepared.boolean,  # closed
    prepared.integer,  # producer_epoch
    prepared.integer,  # producer_seq
    prepared.integer,  # expected_seq
    prepared.integer,  # stream_id
)
# ds_lock_wait sets how long ($7 ms; NULL: the session's lock timeout) the statement waits for
# the stream's lock (APPEND_STREAMS's $17: for each stream's), as its argument is evaluated,
# before ds_append runs. (A transaction block around the two left the connection in error after
# a timeout, and the prepared statements' runner gave up such a connection: review.)
_APPEND = prepared.Statement(
    "ds_append",
    "SELECT outcome, next_seq, next_pos, closed, producer_epoch, producer_seq, expected_seq,"
    " stream_id FROM ds_append(ds_lock_wait($1, $7), $2::jsonb, $3::int[], $4::int[], $5, $6)",
    binary=[5],
    columns=_APPEND_COLUMNS,
)


APPEND_STREAMS = prepared.Statement(
    "ds_append_streams",
    "SELECT ordinal, outcome, next_seq, next_pos, closed, producer_epoch, producer_seq,"
    " expected_seq, stream_id FROM ds_append_streams(ds_lock_wait($1, $17)::text[], $2::jsonb,"
    " $3::int[], $4::bigint[], $5::int[], $6::int[], $7::text[], $8::bigint[], $9::int[],"
    " $10::int[], $11::int[], $12::int[], $13::bigint[], $14::boolean[], $15, $16)",
    binary=[15],
    columns=(prepared.integer, *_APPEND_COLUMNS),
)


async def _execute(sql: str, params: tuple[Any, ...] | dict[str, Any]) -> list[tuple[Any, ...]]:
    async def execute(conn: AsyncConnection[Any]) -> list[tuple[Any, ...]]:
        cur = await conn.execute(sql, params)
        return await cur.fetchall()

    return await _retried(params, execute)


async def _run(statement: prepared.Statement, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """``_execute`` of a statement of the append path (streams.store.prepared)."""
    return await _retried(params, lambda conn: prepared.run(conn, statement, params))


async def _retried(
    params: tuple[Any, ...] | dict[str, Any],
    execute: Callable[[AsyncConnection[Any]], Awaitable[list[tuple[Any, ...]]]],
) -> list[tuple[Any, ...]]:
    size = _data_bytes(params)
    # Over BUFFER_KEEP_BYTES: on a connection reserved for large writes (streams.store.pool).
    large = size > BUFFER_KEEP_BYTES

    async def attempt() -> list[tuple[Any, ...]]:
        async with connection(large=large) as conn:
            rows = await execute(conn)
            carried(conn, size, large=large)
            return rows

    return await retried(attempt, "a write")


def _data_bytes(params: tuple[Any, ...] | dict[str, Any]) -> int:
    """About how many bytes of data a statement's parameters carry (its bytes and lists of
    bytes: messages)."""
    values = params.values() if isinstance(params, dict) else params
    size = 0
    for value in values:
        if isinstance(value, bytes):
            size += len(value)
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            size += sum(map(len, value))
    return size


async def create_stream(request: CreateRequest, *, max_stream_bytes: int) -> CreateResult:
    (row,) = await _execute(_CREATE_SQL, _create_params(request, max_stream_bytes))
    return _create_result(row)


def _create_params(request: CreateRequest, max_stream_bytes: int) -> tuple[Any, ...]:
    """``ds_create``'s arguments."""
    return (
        request.path,
        request.content_type,
        request.ttl_seconds,
        request.expires_at,
        request.closed,
        request.messages,
        max_stream_bytes,
        *_fork_and_owner(request),
    )


def _create_description(request: CreateRequest) -> list[Any]:
    """One create of ``ds_create_streams`` (its ``r ->> 0`` to ``r ->> 12``): the arguments of
    ``ds_create`` as JSON, with the number of its messages in place of them."""
    expires_at = request.expires_at
    return [
        request.path,
        request.content_type,
        request.ttl_seconds,
        expires_at.isoformat() if expires_at is not None else None,
        request.closed,
        len(request.messages),
        *_fork_and_owner(request),
    ]


def _fork_and_owner(request: CreateRequest) -> tuple[Any, ...]:
    """The fork's source, offset and sub-offset, the creator and the retention policy."""
    fork = request.fork
    retention = request.retention
    return (
        fork.source_path if fork else None,
        fork.offset.seq if fork and fork.offset else None,
        fork.offset.pos if fork and fork.offset else None,
        fork.sub_offset if fork else 0,
        request.created_by,
        retention.max_age if retention else None,
        retention.max_bytes if retention else None,
    )


def _create_result(row: tuple[Any, ...]) -> CreateResult:
    outcome = CreateOutcome(row[0])
    if outcome is CreateOutcome.FORK_OFFSET_GONE:
        # The row carries the source's start in place of the tail (ds_create).
        raise OffsetGone(
            str(Offset(row[3], row[4])),
            "Stream-Fork-Offset is before the source's earliest retained position or inside"
            " its compacted history",
        )
    if outcome not in CREATE_SUCCESSES:
        raise CREATE_ERRORS[outcome]()
    _, stream_id, content_type, next_seq, next_pos, closed = row
    return CreateResult(
        created=outcome is CreateOutcome.CREATED,
        stream_id=stream_id,
        content_type=content_type,
        tail=Offset(next_seq, next_pos),
        closed=closed,
    )


async def delete_stream(path: str) -> DeleteOutcome:
    ((value,),) = await _execute("SELECT ds_delete(%s)", (path,))
    outcome = DeleteOutcome(value)
    if outcome not in DELETE_SUCCESSES:
        raise DELETE_ERRORS[outcome]()
    return outcome


async def watch_streams(
    stream_ids: list[int], seconds: float, *, lock_wait_ms: int | None = None
) -> None:
    """Mark ``stream_ids`` watched for ``seconds`` (from now, the database's clock):
    ``ds_watch_streams``, which says why this cannot deadlock and need not be durable.
    ``lock_wait_ms``: wait at most that long for the rows (else the session's lock timeout)."""
    ids = "{" + ",".join(map(str, stream_ids)) + "}"
    await _execute(
        "SELECT ds_watch_streams(ds_lock_wait(%s, %s)::bigint[], %s)", (ids, lock_wait_ms, seconds)
    )


async def renew_watches(stream_ids: list[int], seconds: float) -> dict[int, bool]:
    """Renew the marks of ``stream_ids`` whose rows nobody else holds: each renewed, with
    whether its mark had run out (``ds_renew_watches``)."""
    rows = await _execute("SELECT * FROM ds_renew_watches(%s::bigint[], %s)", (stream_ids, seconds))
    return {stream_id: lapsed for stream_id, lapsed in rows}


async def append_batch(
    path: str,
    requests: list[AppendRequest],
    *,
    max_stream_bytes: int,
    lock_wait_ms: int | None = None,
) -> list[AppendResult | ProtocolError]:
    """Append several requests to one stream in one transaction; one result per request, in
    order, each either a success or the error that request must answer. ``lock_wait_ms``:
    wait at most that long for the stream's lock (else the session's lock timeout), failing
    with SQLSTATE 55P03 past it."""
    params = _append_params(path, requests, max_stream_bytes)
    rows = await _run(_APPEND, (*params, lock_wait_ms))
    return _append_results(requests, rows)


async def held_streams(paths: list[str], *, lock_wait_ms: int) -> set[str]:
    """Of the streams at ``paths``, those whose rows another transaction holds now
    (``ds_held_streams``)."""
    rows = await _execute("SELECT ds_held_streams(%s::text[], %s)", (paths, lock_wait_ms))
    return {path for (path,) in rows}


async def append_batches(
    batches: list[tuple[str, list[AppendRequest]]],
    *,
    max_stream_bytes: int,
    lock_wait_ms: int | None = None,
) -> list[list[AppendResult | ProtocolError]]:
    """Append batches to several streams in ONE statement (ds_append_streams: one
    transaction, one commit, one WAL flush for all), each stream's batch judged as
    ``append_batch`` judges it, the streams locked in path order (the order every process
    locks streams in). If any stream's batch fails, nothing is stored and the error is raised
    (the caller judges each batch alone then). ``lock_wait_ms``: as ``append_batch``'s, for
    every stream's lock."""
    order, params = append_streams_params(batches, max_stream_bytes, lock_wait_ms)
    rows = await _run(APPEND_STREAMS, params)
    by_stream: list[list[tuple[Any, ...]]] = [[] for _ in batches]
    for row in rows:
        by_stream[order[row[0] - 1]].append(row[1:])
    return [
        _append_results(requests, stream_rows)
        for (_, requests), stream_rows in zip(batches, by_stream, strict=True)
    ]


def append_streams_params(
    batches: list[tuple[str, list[AppendRequest]]],
    max_stream_bytes: int,
    lock_wait_ms: int | None = None,
) -> tuple[list[int], tuple[Any, ...]]:
    """The order in which ``append_batches`` locks the streams of ``batches`` (indices, in
    path order), and the parameters of its statement (``APPEND_STREAMS``)."""
    order = sorted(range(len(batches)), key=lambda i: batches[i][0])
    batch = _StreamsBatch()
    for ordinal, i in enumerate(order, start=1):
        batch.add(ordinal, batches[i][1])
    params = (
        _text_array([batches[i][0] for i in order]),
        json.dumps(batch.descriptors),
        *(_int_array(values) for values in (batch.messages, batch.sizes, batch.first_message,
                                            batch.first_byte)),
        _text_array(batch.media),
        _int_array(batch.versions),
        *(_int_array(values) for values in (batch.lengths, batch.owners, batch.streams,
                                            batch.seqs, batch.poss)),
        "{" + ",".join("t" if end else "f" for end in batch.ends) + "}",
        b"".join(batch.data),
        max_stream_bytes,
        lock_wait_ms,
    )  # fmt: skip
    return order, params


def _int_array(values: list[int] | list[int | None]) -> str:
    """An array of integers as PostgreSQL's text form: cheaper to send than a list (psycopg
    would look at every element's type)."""
    return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"


def _text_array(values: list[str | None]) -> str:
    """An array of text as PostgreSQL's text form, every element quoted."""
    quoted = (
        "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for v in values
    )
    return "{" + ",".join(quoted) + "}"


class _StreamsBatch:
    """The parameters of ds_append_streams, built stream by stream (in lock order): per
    stream, where its messages and bytes are and, when its requests are all plain appends, their
    media type and validation version; per message, its place in its stream and request."""

    def __init__(self) -> None:
        self.descriptors: list[list[list[Any]]] = []
        self.messages: list[int] = []
        self.sizes: list[int] = []
        self.first_message: list[int] = []
        self.first_byte: list[int] = []
        self.media: list[str | None] = []
        self.versions: list[int | None] = []
        self.lengths: list[int] = []
        self.owners: list[int] = []
        self.streams: list[int] = []
        self.seqs: list[int] = []
        self.poss: list[int] = []
        self.ends: list[bool] = []
        self.data: list[bytes] = []
        self._bytes = 0

    def add(self, ordinal: int, requests: list[AppendRequest]) -> None:
        self.descriptors.append([_descriptor(request) for request in requests])
        self.first_message.append(len(self.lengths) + 1)
        self.first_byte.append(self._bytes + 1)
        plain = _plain(requests)
        self.media.append(requests[0].media_type if plain else None)
        self.versions.append(requests[0].validation_version if plain else None)
        count = 0
        size = 0
        for owner, request in enumerate(requests, start=1):
            last = len(request.messages) - 1
            for index, message in enumerate(request.messages):
                self.lengths.append(len(message))
                self.owners.append(owner)
                self.streams.append(ordinal)
                self.seqs.append(count)
                self.poss.append(size)
                self.ends.append(index == last)
                self.data.append(message)
                count += 1
                size += len(message)
        self.messages.append(count)
        self.sizes.append(size)
        self._bytes += size


def _plain(requests: list[AppendRequest]) -> bool:
    """Are these requests all plain appends (data of one media type and validation version,
    no producer, close or Stream-Seq), which ds_append_streams may write together?"""
    first = requests[0]
    return all(
        request.messages
        and request.producer is None
        and not request.close
        and request.stream_seq is None
        and request.media_type == first.media_type
        and request.validation_version == first.validation_version
        for request in requests
    )


async def create_streams(
    requests: list[CreateRequest], *, max_stream_bytes: int
) -> list[CreateResult | ProtocolError]:
    """Several creates in ONE statement (ds_create_streams: one transaction, one commit, one
    WAL flush, one append to the __registry__ stream for all: state/sql), each judged as
    ``create_stream`` judges it, in path order (the order every process locks streams in). If
    any create fails, nothing is stored and the error is raised (the caller creates each alone
    then)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].path)
    described = [_create_description(requests[i]) for i in order]
    data = [message for i in order for message in requests[i].messages]
    rows = await _execute(_CREATE_STREAMS_SQL, (json.dumps(described), data, max_stream_bytes))
    results: list[CreateResult | ProtocolError] = [ProtocolError("no result")] * len(requests)
    for row in rows:
        try:
            results[order[row[0] - 1]] = _create_result(row[1:])
        except ProtocolError as error:
            results[order[row[0] - 1]] = error
    return results


def _append_params(
    path: str, requests: list[AppendRequest], max_stream_bytes: int
) -> tuple[Any, ...]:
    descriptors, lengths, owners, data = _flatten(requests)
    return (
        path,
        json.dumps(descriptors),
        "{" + ",".join(lengths) + "}",
        "{" + ",".join(owners) + "}",
        b"".join(data),
        max_stream_bytes,
    )


def _flatten(
    requests: list[AppendRequest],
) -> tuple[list[list[Any]], list[str], list[str], list[bytes]]:
    """ds_append's flat form of one stream's requests: a descriptor per request, each
    message's length and (1-based) request, and the messages' bytes."""
    descriptors = []
    lengths: list[str] = []
    owners: list[str] = []
    data: list[bytes] = []
    for index, request in enumerate(requests, start=1):
        descriptors.append(_descriptor(request))
        lengths.extend(str(len(message)) for message in request.messages)
        owners.extend([str(index)] * len(request.messages))
        data.extend(request.messages)
    return descriptors, lengths, owners, data


def _descriptor(request: AppendRequest) -> list[Any]:
    """One request as ds_append's p_requests element."""
    producer = request.producer
    return [
        request.media_type,
        request.close,
        producer.producer_id if producer else None,
        producer.epoch if producer else None,
        producer.seq if producer else None,
        request.stream_seq,
        len(request.messages),
        request.size,
        request.validation_version,
    ]


def _append_results(
    requests: list[AppendRequest], rows: list[tuple[Any, ...]]
) -> list[AppendResult | ProtocolError]:
    return [_append_result(request, row) for request, row in zip(requests, rows, strict=True)]


def _append_result(request: AppendRequest, row: tuple[Any, ...]) -> AppendResult | ProtocolError:
    value, next_seq, next_pos, closed, epoch, producer_seq, expected_seq, stream_id = row
    outcome = AppendOutcome(value)
    tail = Offset(next_seq, next_pos) if next_seq is not None else None
    if outcome in APPEND_SUCCESSES:
        assert tail is not None
        return AppendResult(
            stream_id=stream_id,
            next_offset=tail,
            closed=closed,
            duplicate=outcome is AppendOutcome.DUPLICATE,
            producer_epoch=epoch,
            producer_seq=producer_seq,
        )
    return append_error(
        outcome,
        tail=str(tail) if tail is not None else None,
        epoch=epoch,
        expected_seq=expected_seq,
        received_seq=request.producer.seq if request.producer is not None else None,
    )
