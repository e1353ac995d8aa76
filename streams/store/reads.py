"""Reads: stream metadata and ranges of messages (PROTOCOL.md 5.5, 5.6).

Reads take no locks. A read is bounded by the tail that the metadata statement saw, so the
answer (data, next offset, up-to-date, closed) describes one consistent moment even when appends
commit in between.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from streams.errors import BadRequest, Gone, NotFound
from streams.protocol.offsets import Offset
from streams.store.pool import carried, connection
from streams.store.types import ReadResult, Segment, StreamMeta

# The media type by the store's rule (ds_media_type), which judges appends: once per read.
_META_SQL = (
    "SELECT id, content_type, ds_media_type(content_type), next_seq, next_pos, closed,"
    " ttl_seconds, expires_at, deleted, chain_ids, chain_lo, chain_hi"
    " FROM ds_stream_meta(%s, %s)"
)
# A range of one segment's rows, aggregated by PostgreSQL into one value: the messages
# concatenated (joined with commas for JSON, so the body is that inside brackets), their count,
# the first position (to check the read starts on a message boundary) and the end. Python
# never touches a row: a catch-up of many tiny messages costs the event loop one value.
# Bounded by bytes (``pos < limit``: always at least the first message) and by count. The
# casts matter: psycopg sends small Python ints as smallint, and smallint + smallint overflows.
_RANGE_SELECT = (
    "SELECT count(*), min(seq), min(pos), max(seq), max(pos + octet_length(data)),"
    " string_agg(data, %(sep)s ORDER BY seq) FROM ds_message"
    " WHERE stream_id = {stream} AND seq >= %(seq)s::bigint AND seq < {hi}"
    " AND seq < %(seq)s::bigint + %(rows)s::bigint AND pos < %(limit)s::bigint"
)
_AGGREGATE_SQL = _RANGE_SELECT.format(stream="%(id)s", hi="%(hi)s")
# The same range as rows: for large messages, fetching them is 2-4x faster than aggregating
# them (string_agg copies its growing value again and again; docs/benchmarks.md), and there
# are few of them for Python to handle.
_ROWS_SQL = (
    "SELECT seq, pos, data FROM ds_message"
    " WHERE stream_id = %(id)s AND seq >= %(seq)s::bigint AND seq < %(hi)s"
    " AND seq < %(seq)s::bigint + %(rows)s::bigint AND pos < %(limit)s::bigint ORDER BY seq"
)
# Messages of at least this many bytes on average are fetched as rows, smaller ones aggregated.
LARGE_MESSAGE_BYTES = 4096
# A live reader's re-read of a stream that is not a fork: its tail and the new messages in ONE
# statement (one round trip, one snapshot). No row at all: the stream is gone.
_LIVE_SQL = (
    "SELECT s.next_seq, s.next_pos, s.closed, s.deleted_at IS NOT NULL, m.*"
    " FROM ds_stream AS s LEFT JOIN LATERAL ("
    + _RANGE_SELECT.format(stream="s.id", hi="s.next_seq")
    + ") AS m ON true WHERE s.id = %(id)s"
)


# A catch-up read in ONE statement: the stream (ds_stream_meta, TTL renewed) and, when it is not
# a fork and its messages ahead are small on average, the range aggregated as _RANGE_SELECT
# does. Otherwise (a fork, large messages: read_range) the range part is NULL.
_META_AND_RANGE_SQL = (
    "SELECT m.id, m.content_type, ds_media_type(m.content_type), m.next_seq, m.next_pos,"
    " m.closed, m.ttl_seconds, m.expires_at, m.deleted, m.chain_ids, m.chain_lo, m.chain_hi,"
    " r.* FROM ds_stream_meta(%(path)s, true) AS m LEFT JOIN LATERAL ("
    + _RANGE_SELECT.format(stream="m.id", hi="m.next_seq").replace(
        "%(sep)s",
        "(CASE WHEN ds_media_type(m.content_type) = 'application/json'"
        " THEN ','::bytea ELSE ''::bytea END)",
    )
    # The gate goes inside the subquery, not in ON: a join condition filters the aggregate
    # after it is computed, and string_agg over large messages is what the gate avoids.
    + " AND cardinality(m.chain_ids) = 1 AND NOT m.deleted AND m.next_seq > %(seq)s"
    " AND m.next_pos - %(pos)s < %(large)s::bigint * (m.next_seq - %(seq)s)"
    ") AS r ON true"
)


async def stream_meta(path: str, *, touch: bool) -> StreamMeta:
    """The stream at ``path``; ``touch`` renews a sliding TTL (reads do, HEAD does not).
    Raises NotFound (missing or expired) or Gone (soft-deleted)."""
    async with connection() as conn:
        cur = await conn.execute(_META_SQL, (path, touch))
        row = await cur.fetchone()
    return _meta(path, row)


async def read_from(
    path: str, start: Offset, max_bytes: int, max_messages: int
) -> tuple[StreamMeta, ReadResult]:
    """A catch-up read: the stream (its sliding TTL renewed) and its messages from ``start``
    (as ``read_range``), in one round trip for a stream that is not a fork."""
    params = {
        "path": path,
        "seq": start.seq,
        "pos": start.pos,
        "rows": max_messages,
        "limit": start.pos + max(max_bytes, 1),
        "large": LARGE_MESSAGE_BYTES,
    }
    async with connection() as conn:
        cur = await conn.execute(_META_AND_RANGE_SQL, params, binary=True)
        row = await cur.fetchone()
        carried(conn, _data_bytes(row))
    meta = _meta(path, row)
    assert row is not None
    # Not read with the metadata (a fork, large messages), or nothing read although the tail
    # is ahead: ds_stream_meta, a volatile function, sees a newer snapshot than the statement
    # around it, so appends committed in between show in the tail but not in the range. Then
    # the range is read on its own. (A range that stops short is still right: up to date is
    # judged against the tail, and the client reads on.)
    if row[12] is None or not row[12]:
        return meta, await read_range(meta, start, max_bytes, max_messages)
    check_offset(meta, start)
    chunk = _Chunk(start, separator(meta))
    chunk.add(row[12:])
    return meta, _result(meta, start, chunk)


def _meta(path: str, row: tuple[Any, ...] | None) -> StreamMeta:
    if row is None:
        raise NotFound("stream not found")
    sid, content_type, media_type, next_seq, next_pos, closed, ttl, expires_at, deleted = row[:9]
    if deleted:
        raise Gone("stream was deleted")
    ids, los, his = row[9], row[10], row[11]
    return StreamMeta(
        id=sid,
        path=path,
        content_type=content_type,
        media_type=media_type,
        tail=Offset(next_seq, next_pos),
        closed=closed,
        ttl_seconds=ttl,
        expires_at=expires_at,
        segments=tuple(Segment(i, lo, hi) for i, lo, hi in zip(ids, los, his, strict=True)),
    )


def check_offset(meta: StreamMeta, start: Offset) -> None:
    """An offset past the tail is not one this stream minted (PROTOCOL.md 8)."""
    tail = meta.tail
    if start.seq > tail.seq or (start.seq == tail.seq and start.pos != tail.pos):
        raise BadRequest("offset is beyond the end of the stream")


async def read_range(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> ReadResult:
    """Messages from ``start`` up to about ``max_bytes`` and at most ``max_messages`` (always
    at least one message), across the fork chain, bounded by the tail in ``meta``."""
    check_offset(meta, start)
    tail = meta.tail
    chunk = _Chunk(start, separator(meta))
    if start.seq < tail.seq:
        params = {"sep": chunk.separator, "limit": start.pos + max(max_bytes, 1)}
        # What the messages ahead weigh on average decides how they are fetched.
        large = (tail.pos - start.pos) >= LARGE_MESSAGE_BYTES * (tail.seq - start.seq)
        async with connection() as conn:
            # Oldest segment first: the chain is stored leaf-first.
            for segment in reversed(meta.segments):
                hi = tail.seq if segment.hi is None else min(segment.hi, tail.seq)
                lo = max(segment.lo, chunk.end.seq)
                if lo >= hi:
                    continue
                rows = max_messages - chunk.count
                cur = await conn.execute(
                    _ROWS_SQL if large else _AGGREGATE_SQL,
                    params | {"id": segment.stream_id, "seq": lo, "hi": hi, "rows": rows},
                    binary=True,
                )
                if large:
                    chunk.add_rows(await cur.fetchall())
                else:
                    row = await cur.fetchone()
                    assert row is not None  # an aggregate without GROUP BY: always one row
                    chunk.add(row)
                if chunk.count >= max_messages or chunk.end.seq < hi:
                    break  # the byte or count budget ended this read inside the segment
            carried(conn, chunk.end.pos - start.pos)
        if not chunk.count:
            raise BadRequest("offset does not belong to this stream")
    return _result(meta, start, chunk)


def _data_bytes(row: tuple[Any, ...] | None) -> int:
    """The size of the aggregated messages that end a row of _META_AND_RANGE_SQL or _LIVE_SQL."""
    data = row[-1] if row is not None else None
    return len(data) if data is not None else 0


def separator(meta: StreamMeta) -> bytes:
    """What goes between messages in a read's payload: commas for JSON (the body is the
    payload in brackets), nothing for bytes and text."""
    return b"," if meta.is_json else b""


class _Chunk:
    """Messages read, appended in stream order (aggregated ranges or rows, with the separator
    between them) and checked to continue exactly where the previous ones ended."""

    __slots__ = ("count", "end", "parts", "separator")

    def __init__(self, start: Offset, sep: bytes) -> None:
        self.end = start
        self.count = 0
        self.parts: list[bytes] = []
        self.separator = sep

    def add(self, row: tuple[Any, ...]) -> None:
        """``(count, first seq, first pos, last seq, end pos, data)`` from _RANGE_SELECT."""
        count, first_seq, first_pos, last_seq, end_pos, data = row
        if not count:
            return
        if (first_seq, first_pos) != (self.end.seq, self.end.pos):
            raise BadRequest("offset does not belong to this stream")
        if self.parts and self.separator:
            self.parts.append(self.separator)
        self.parts.append(bytes(data))
        self.count += count
        self.end = Offset(last_seq + 1, end_pos)

    def add_rows(self, rows: list[tuple[Any, ...]]) -> None:
        """``(seq, pos, data)`` rows from _ROWS_SQL, each continuing the one before."""
        for seq, pos, data in rows:
            if (seq, pos) != (self.end.seq, self.end.pos):
                raise BadRequest("offset does not belong to this stream")
            if self.parts and self.separator:
                self.parts.append(self.separator)
            self.parts.append(data)
            self.count += 1
            self.end = Offset(seq + 1, pos + len(data))


def _result(meta: StreamMeta, start: Offset, chunk: _Chunk) -> ReadResult:
    up_to_date = chunk.end == meta.tail
    return ReadResult(
        parts=tuple(chunk.parts),
        count=chunk.count,
        start=start,
        next_offset=chunk.end,
        up_to_date=up_to_date,
        closed_at_tail=up_to_date and meta.closed,
    )


async def reread(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> tuple[StreamMeta, ReadResult]:
    """A live reader's re-read after a wake-up: the stream's current state and what it holds
    from ``start``. Raises NotFound or Gone when the stream went away meanwhile."""
    if len(meta.segments) > 1:
        fresh = await stream_meta(meta.path, touch=False)
        if fresh.id != meta.id:
            raise NotFound("stream was deleted")
        return fresh, await read_range(fresh, start, max_bytes, max_messages)
    chunk = _Chunk(start, separator(meta))
    params = {
        "id": meta.id,
        "seq": start.seq,
        "rows": max_messages,
        "limit": start.pos + max(max_bytes, 1),
        "sep": chunk.separator,
    }
    async with connection() as conn:
        cur = await conn.execute(_LIVE_SQL, params, binary=True)
        row = await cur.fetchone()
        carried(conn, _data_bytes(row))
    if row is None:
        raise NotFound("stream was deleted")
    next_seq, next_pos, closed, deleted = row[:4]
    if deleted:
        raise Gone("stream was deleted")
    fresh = replace(meta, tail=Offset(next_seq, next_pos), closed=closed)
    check_offset(fresh, start)
    chunk.add(row[4:])
    return fresh, _result(fresh, start, chunk)
