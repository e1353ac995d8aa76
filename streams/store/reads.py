"""Reads: stream metadata and ranges of messages (PROTOCOL.md 5.5, 5.6).

Reads take no locks. A read is bounded by the tail that the metadata statement saw, so the
answer (data, next offset, up-to-date, closed) describes one consistent moment even when appends
commit in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from psycopg import AsyncConnection, AsyncCursor
from psycopg.adapt import Buffer, Loader
from psycopg.pq import Format

from streams.errors import BadRequest, Gone, NotFound, OffsetGone
from streams.protocol.offsets import Offset
from streams.store.conflicts import retried
from streams.store.pool import carried, connection
from streams.store.types import ReadResult, Retention, Segment, StreamMeta

# The columns of a stream's metadata, as ds_stream_meta returns them (the media type by the
# store's rule, ds_media_type, which judges appends: once per read).
_META_COLUMNS = (
    "m.id, m.content_type, ds_media_type(m.content_type), m.next_seq, m.next_pos, m.closed,"
    " m.ttl_seconds, m.expires_at, m.deleted, m.chain_ids, m.chain_lo, m.chain_hi,"
    " m.first_seq, m.first_pos, m.resume_seq, m.compacted_seq, m.retention_max_age,"
    " m.retention_max_bytes"
)
_META_WIDTH = 18
_META_SQL = f"SELECT {_META_COLUMNS} FROM ds_stream_meta(%s, %s) AS m"
# A range of one segment's rows, aggregated by PostgreSQL into one value: the messages
# concatenated (joined with commas for JSON, so the body is that inside brackets), their count,
# the first position (to check the read starts on a message boundary) and the end. Python
# never touches a row: a catch-up of many tiny messages costs the event loop one value.
# Bounded by bytes (``pos < start + bytes``: always at least the first message) and by count.
# The casts matter: psycopg sends small Python ints as smallint, and smallint + smallint
# overflows.
_RANGE_SELECT = (
    "SELECT count(*), min(seq), min(pos), max(seq), max(pos + octet_length(data)),"
    " string_agg(data, {sep} ORDER BY seq) FROM ds_message"
    " WHERE stream_id = {stream} AND seq >= {seq} AND seq < {hi}"
    " AND seq < {seq} + %(rows)s::bigint AND pos < {pos} + %(bytes)s::bigint"
)
_AGGREGATE_SQL = _RANGE_SELECT.format(
    sep="%(sep)s", stream="%(id)s", seq="%(seq)s::bigint", hi="%(hi)s", pos="%(pos)s::bigint"
)
# The same range as rows: for large messages, fetching them is 2-4x faster than aggregating
# them (string_agg copies its growing value again and again; docs/benchmarks.md), and there
# are few of them for Python to handle.
_ROWS_SQL = (
    "SELECT seq, pos, data FROM ds_message"
    " WHERE stream_id = %(id)s AND seq >= %(seq)s::bigint AND seq < %(hi)s"
    " AND seq < %(seq)s::bigint + %(rows)s::bigint AND pos < %(pos)s::bigint + %(bytes)s::bigint"
    " ORDER BY seq"
)
# A range of one segment where compaction may have left gaps (below the stream's
# compacted_seq): the messages from the first stored one at or after `seq`, at most `rows` of
# them and about `bytes` from `base` (NULL: from the first one found), aggregated as above; then
# whether more are stored in the segment after those returned (the budget ended the read: it
# may also end before the first one, in a later segment), and where the stored
# message before `seq` ends (to check the start fits the gap it falls in).
_GAPS_SQL = (
    "WITH first AS (SELECT pos FROM ds_message WHERE stream_id = %(id)s"
    "  AND seq >= %(seq)s::bigint AND seq < %(hi)s ORDER BY seq LIMIT 1),"
    " r AS (SELECT m.seq, m.pos, m.data FROM ds_message AS m, first"
    "  WHERE m.stream_id = %(id)s AND m.seq >= %(seq)s::bigint AND m.seq < %(hi)s"
    "  AND m.pos < coalesce(%(base)s::bigint, first.pos) + %(bytes)s::bigint"
    "  ORDER BY m.seq LIMIT %(rows)s::bigint)"
    " SELECT count(*), min(r.seq), min(r.pos), max(r.seq), max(r.pos + octet_length(r.data)),"
    " string_agg(r.data, %(sep)s ORDER BY r.seq),"
    " EXISTS (SELECT 1 FROM ds_message AS n WHERE n.stream_id = %(id)s"
    "  AND n.seq > coalesce((SELECT max(seq) FROM r), %(seq)s::bigint - 1) AND n.seq < %(hi)s),"
    " (SELECT p.seq FROM ds_message AS p WHERE p.stream_id = %(id)s AND p.seq < %(seq)s::bigint"
    "  AND p.seq >= %(lo)s ORDER BY p.seq DESC LIMIT 1),"
    " (SELECT p.pos + octet_length(p.data) FROM ds_message AS p WHERE p.stream_id = %(id)s"
    "  AND p.seq < %(seq)s::bigint AND p.seq >= %(lo)s ORDER BY p.seq DESC LIMIT 1)"
    " FROM r"
)
# Messages of at least this many bytes on average are fetched as rows, smaller ones aggregated.
LARGE_MESSAGE_BYTES = 4096
# A live reader's re-read of a stream that is not a fork: its tail, start and compaction bound
# and the new messages in ONE statement (one round trip, one snapshot); the range only where
# the stream has no gaps. No row at all: the stream is gone.
_LIVE_SQL = (
    "SELECT s.next_seq, s.next_pos, s.closed, s.deleted_at IS NOT NULL, s.first_seq,"
    " s.first_pos, s.resume_seq, s.compacted_seq, m.*"
    " FROM ds_stream AS s LEFT JOIN LATERAL ("
    + _RANGE_SELECT.format(
        sep="%(sep)s", stream="s.id", seq="%(seq)s::bigint", hi="s.next_seq", pos="%(pos)s::bigint"
    )
    + " AND %(seq)s::bigint >= greatest(s.first_seq, s.compacted_seq)"
    ") AS m ON true WHERE s.id = %(id)s"
)


# A catch-up read in ONE statement: the stream (ds_stream_meta, TTL renewed) and, when it is not
# a fork, the read starts where it has no gaps, and its messages ahead are small on average,
# the range aggregated as _RANGE_SELECT does. Otherwise (a fork, large messages, compacted
# history: read_range) the range part is NULL. A NULL start (`offset=-1`) is the stream's.
_META_AND_RANGE_SQL = (
    f"SELECT {_META_COLUMNS}, r.* FROM ds_stream_meta(%(path)s, true) AS m"
    " CROSS JOIN LATERAL (SELECT coalesce(%(seq)s::bigint, m.first_seq) AS seq,"
    " coalesce(%(pos)s::bigint, m.first_pos) AS pos) AS st"
    " LEFT JOIN LATERAL ("
    + _RANGE_SELECT.format(
        sep="(CASE WHEN ds_media_type(m.content_type) = 'application/json'"
        " THEN ','::bytea ELSE ''::bytea END)",
        stream="m.id",
        seq="st.seq",
        hi="m.next_seq",
        pos="st.pos",
    )
    # The gate goes inside the subquery, not in ON: a join condition filters the aggregate
    # after it is computed, and string_agg over large messages is what the gate avoids.
    + " AND cardinality(m.chain_ids) = 1 AND NOT m.deleted AND m.next_seq > st.seq"
    " AND st.seq >= greatest(m.first_seq, m.compacted_seq)"
    " AND m.next_pos - st.pos < %(large)s::bigint * (m.next_seq - st.seq)"
    ") AS r ON true"
)


async def stream_meta(path: str, *, touch: bool) -> StreamMeta:
    """The stream at ``path``; ``touch`` renews a sliding TTL (reads do, HEAD does not).
    Raises NotFound (missing or expired) or Gone (soft-deleted)."""

    async def attempt() -> tuple[Any, ...] | None:
        async with connection() as conn:
            cur = await conn.execute(_META_SQL, (path, touch))
            return await cur.fetchone()

    # The TTL's renewal and the expiry of an expired stream take row locks.
    return _meta(path, await retried(attempt, "a read"))


async def tails(stream_ids: list[int]) -> dict[int, tuple[int, bool]]:
    """The next sequence number, and whether it is closed, of each of ``stream_ids`` that
    still exists: what live delivery reads while notifications cannot reach it
    (streams.live)."""
    async with connection() as conn:
        cur = await conn.execute(
            "SELECT id, next_seq, closed FROM ds_stream"
            " WHERE id = ANY(%s::bigint[]) AND deleted_at IS NULL",
            (stream_ids,),
        )
        return {
            stream_id: (next_seq, closed) for stream_id, next_seq, closed in await cur.fetchall()
        }


async def read_from(
    path: str, start: Offset | None, max_bytes: int, max_messages: int
) -> tuple[StreamMeta, ReadResult]:
    """A catch-up read: the stream (its sliding TTL renewed) and its messages from ``start``
    (None: the stream's earliest retained position), as ``read_range``, in one round trip for
    a stream that is not a fork and has no gaps there."""
    params = {
        "path": path,
        "seq": start.seq if start is not None else None,
        "pos": start.pos if start is not None else None,
        "rows": max_messages,
        "bytes": max(max_bytes, 1),
        "large": LARGE_MESSAGE_BYTES,
    }

    async def attempt() -> tuple[Any, ...] | None:
        async with connection() as conn:
            cur = await conn.execute(_META_AND_RANGE_SQL, params, binary=True)
            row = await cur.fetchone()
            carried(conn, _data_bytes(row))
            return row

    row = await retried(attempt, "a read")  # as stream_meta
    meta = _meta(path, row)
    assert row is not None
    start = meta.start if start is None else start
    # Not read with the metadata (a fork, large messages, compacted history), or nothing read
    # although the tail is ahead: ds_stream_meta, a volatile function, sees a newer snapshot
    # than the statement around it, so appends committed in between show in the tail but not
    # in the range. Then the range is read on its own. (A range that stops short is still
    # right: up to date is judged against the tail, and the client reads on.)
    if row[_META_WIDTH] is None or not row[_META_WIDTH]:
        return meta, await read_range(meta, start, max_bytes, max_messages)
    check_start(meta, start)
    chunk = _Chunk(start, separator(meta))
    chunk.add(row[_META_WIDTH:])
    return meta, _result(meta, start, chunk)


def _meta(path: str, row: tuple[Any, ...] | None) -> StreamMeta:
    if row is None:
        raise NotFound("stream not found")
    sid, content_type, media_type, next_seq, next_pos, closed, ttl, expires_at, deleted = row[:9]
    if deleted:
        raise Gone("stream was deleted")
    ids, los, his = row[9], row[10], row[11]
    first_seq, first_pos, resume_seq, compacted_seq, max_age, max_bytes = row[12:_META_WIDTH]
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
        start=Offset(first_seq, first_pos),
        resume_seq=resume_seq,
        compacted_seq=compacted_seq,
        retention=Retention(max_age, max_bytes),
    )


def check_offset(meta: StreamMeta, start: Offset) -> None:
    """An offset past the tail is not one this stream minted (PROTOCOL.md 8)."""
    tail = meta.tail
    if start.seq > tail.seq or (start.seq == tail.seq and start.pos != tail.pos):
        raise BadRequest("offset is beyond the end of the stream")


def check_start(meta: StreamMeta, start: Offset) -> None:
    """Where a read may start: not past the tail (400), not before what the stream retains
    (PROTOCOL.md 5.6: 410 Gone, with where the stream starts now)."""
    check_offset(meta, start)
    if meta.gone(start):
        if start < meta.start:
            raise OffsetGone(str(meta.start))
        # Not before the start: behind a delete a compaction dropped, which a reader resuming
        # there would miss (its message named the start as the earliest retained: review).
        raise OffsetGone(
            str(meta.start),
            f"offset is before events a compaction dropped: read again from {meta.start}",
        )


async def read_range(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> ReadResult:
    """Messages from ``start`` up to about ``max_bytes`` and at most ``max_messages`` (always
    at least one message), across the fork chain, bounded by the tail in ``meta``. A read of
    compacted history continues at the next message kept. If the stream was trimmed or
    compacted since ``meta`` was read, the read is judged again on its new state."""
    check_start(meta, start)
    try:
        return await _read_range(meta, start, max_bytes, max_messages)
    except _NotContiguous:
        fresh = await stream_meta(meta.path, touch=False)
        if fresh.id != meta.id:
            raise NotFound("stream was deleted") from None
        check_start(fresh, start)
        if start.seq >= fresh.compacted_seq:
            raise
        fresh = replace(fresh, tail=meta.tail, closed=meta.closed)
        return await _read_range(fresh, start, max_bytes, max_messages)


async def _read_range(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> ReadResult:
    if start.seq < meta.compacted_seq:
        if start == meta.start and start.seq < meta.resume_seq:
            return await _read_past_resume(meta, start, max_bytes, max_messages)
        return await _read_with_gaps(meta, start, max_bytes, max_messages)
    tail = meta.tail
    chunk = _Chunk(start, separator(meta))
    if start.seq < tail.seq:
        params = {"sep": chunk.separator, "pos": start.pos, "bytes": max(max_bytes, 1)}
        # What the messages ahead weigh on average decides how they are fetched.
        large = (tail.pos - start.pos) >= LARGE_MESSAGE_BYTES * (tail.seq - start.seq)
        async with connection() as conn:
            cursor = _viewing_cursor(conn) if large else conn.cursor(binary=True)
            for segment, lo, hi in _spans(meta, chunk):
                rows = max_messages - chunk.count
                cur = await cursor.execute(
                    _ROWS_SQL if large else _AGGREGATE_SQL,
                    params | {"id": segment.stream_id, "seq": lo, "hi": hi, "rows": rows},
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
            raise _NotContiguous("offset does not belong to this stream")
    return _result(meta, start, chunk)


# A read from the start of compacted history goes on past the last dropped delete, up to this,
# in pages of at least RESUME_PAGE_BYTES.
RESUME_READ_MAX_BYTES = 64 * 1024 * 1024
RESUME_PAGE_BYTES = 1024 * 1024


async def _read_past_resume(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> ReadResult:
    """A read from the start of compacted history in which compaction dropped a delete: it
    goes on, page after page, until it ends past that delete (``resume_seq``) or at the tail.
    A reader resuming below ``resume_seq`` is refused (410: it could have read what the delete
    removed), so a read that stopped there handed out a next offset that answered 410, and the
    410 pointed back to the start: a reader of more than one page from -1 went round for ever
    (found by a probe, with 10,050 kept events). Past ``RESUME_READ_MAX_BYTES`` it stops where
    it is (docs/gaps.md)."""
    pages = [await _read_with_gaps(meta, start, max_bytes, max_messages)]
    size = pages[0].size
    # Pages of at least 1 MiB: a read held small (streams.held_answers) still takes few queries.
    page_bytes = max(max_bytes, RESUME_PAGE_BYTES)
    while (
        pages[-1].next_offset.seq < meta.resume_seq
        and not pages[-1].up_to_date
        and size < RESUME_READ_MAX_BYTES
    ):
        page = await _read_with_gaps(meta, pages[-1].next_offset, page_bytes, max_messages)
        pages.append(page)
        size += page.size
    if len(pages) == 1:
        return pages[0]
    sep = separator(meta)
    parts: list[bytes | memoryview] = []
    for page in pages:
        if page.count and parts and sep:
            parts.append(sep)
        parts.extend(page.parts)
    last = pages[-1]
    return replace(last, parts=tuple(parts), count=sum(page.count for page in pages), start=start)


class _ViewLoader(Loader):
    """bytea as a view of the result's own memory (it keeps the result alive), not a copy
    of it: a large read's messages are copied once more anyway, into the blocks it is sent
    in (streams.http.responses), and the copy into bytes was 15% of a binary catch-up's
    server CPU (docs/benchmarks.md)."""

    format = Format.BINARY

    def load(self, data: Buffer) -> Buffer:
        return data


def _viewing_cursor(conn: AsyncConnection) -> AsyncCursor[Any]:
    """A binary cursor whose bytea values are memoryviews (_ViewLoader)."""
    cursor = conn.cursor(binary=True)
    cursor.adapters.register_loader("bytea", _ViewLoader)
    return cursor


async def _read_with_gaps(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> ReadResult:
    """A read from compacted history, where stored messages may have gaps between them: from
    the first message stored at or after ``start``. The start must fit the gap it falls in
    (each message holds at least one byte). The read ends at its budget (at the end of the
    last message read: a position the stream minted) or at the tail."""
    tail = meta.tail
    chunk = _Chunk(start, separator(meta))
    params: dict[str, Any] = {"sep": chunk.separator, "bytes": max(max_bytes, 1), "base": None}
    first = True
    exhausted = False
    async with connection() as conn:
        for segment, lo, hi in _spans(meta, chunk):
            rows = max_messages - chunk.count
            cur = await conn.execute(
                _GAPS_SQL,
                params
                | {"id": segment.stream_id, "seq": lo, "hi": hi, "rows": rows, "lo": segment.lo},
                binary=True,
            )
            row = await cur.fetchone()
            assert row is not None
            count, first_seq, first_pos, _, _, _, more, prev_seq, prev_end = row
            if first:
                _check_gap(start, prev_seq, prev_end, (first_seq, first_pos) if count else None)
                first = False
            if count:
                chunk.add(row[:6], gaps=True)
                params["base"] = params["base"] if params["base"] is not None else first_pos
            if more or chunk.count >= max_messages:
                exhausted = True
                break
        carried(conn, chunk.end.pos - start.pos)
    if first:
        _check_gap(start, None, None, None)
    if not exhausted:
        # Nothing stored between the last message read and the tail: all compacted away.
        if not (start.seq <= tail.seq and tail.pos - start.pos >= tail.seq - start.seq):
            raise BadRequest("offset does not belong to this stream")
        chunk.end = tail
    return _result(meta, start, chunk)


def _spans(meta: StreamMeta, chunk: _Chunk) -> Iterator[tuple[Segment, int, int]]:
    """The segments a read goes through, oldest first (the chain is stored leaf-first), each
    with the range of seq still to read in it, from where the read has come (``chunk``, which
    grows as the caller reads) to the tail in ``meta``."""
    tail = meta.tail.seq
    for segment in reversed(meta.segments):
        hi = tail if segment.hi is None else min(segment.hi, tail)
        lo = max(segment.lo, chunk.end.seq)
        if lo < hi:
            yield segment, lo, hi


def _check_gap(
    start: Offset,
    prev_seq: int | None,
    prev_end: int | None,
    following: tuple[int, int] | None,
) -> None:
    """Does ``start`` fit between the stored message before it (``prev_seq``, ending at
    ``prev_end``) and the one after (``following``: seq and pos), every message in between
    holding at least one byte?"""
    if (
        prev_seq is not None
        and prev_end is not None
        and (start.pos < prev_end or start.pos - prev_end < start.seq - prev_seq - 1)
    ):
        raise BadRequest("offset does not belong to this stream")
    if following is not None:
        seq, pos = following
        if (
            (seq == start.seq and pos != start.pos)
            or start.pos > pos
            or (pos - start.pos < seq - start.seq)
        ):
            raise BadRequest("offset does not belong to this stream")


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

    def add(self, row: tuple[Any, ...], *, gaps: bool = False) -> None:
        """``(count, first seq, first pos, last seq, end pos, data)`` from _RANGE_SELECT
        (``gaps``: from _GAPS_SQL, which may start past the end of what came before)."""
        count, first_seq, first_pos, last_seq, end_pos, data = row
        if not count:
            return
        if gaps:
            if first_seq < self.end.seq or first_pos < self.end.pos:
                raise BadRequest("offset does not belong to this stream")
        elif (first_seq, first_pos) != (self.end.seq, self.end.pos):
            raise _NotContiguous("offset does not belong to this stream")
        if self.parts and self.separator:
            self.parts.append(self.separator)
        self.parts.append(bytes(data))
        self.count += count
        self.end = Offset(last_seq + 1, end_pos)

    def add_rows(self, rows: list[tuple[Any, ...]]) -> None:
        """``(seq, pos, data)`` rows from _ROWS_SQL, each continuing the one before."""
        for seq, pos, data in rows:
            if (seq, pos) != (self.end.seq, self.end.pos):
                raise _NotContiguous("offset does not belong to this stream")
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


def nothing_at(meta: StreamMeta, offset: Offset) -> ReadResult:
    """An empty read at ``offset`` of the stream in ``meta``."""
    return _result(meta, offset, _Chunk(offset, b""))


async def reread(
    meta: StreamMeta, start: Offset, max_bytes: int, max_messages: int
) -> tuple[StreamMeta, ReadResult]:
    """A live reader's re-read after a wake-up: the stream's current state and what it holds
    from ``start``. Raises NotFound or Gone when the stream went away meanwhile, OffsetGone
    when it was trimmed past ``start``."""
    if len(meta.segments) > 1:
        fresh = await stream_meta(meta.path, touch=False)
        if fresh.id != meta.id:
            raise NotFound("stream was deleted")
        return fresh, await read_range(fresh, start, max_bytes, max_messages)
    chunk = _Chunk(start, separator(meta))
    params = {
        "id": meta.id,
        "seq": start.seq,
        "pos": start.pos,
        "rows": max_messages,
        "bytes": max(max_bytes, 1),
        "sep": chunk.separator,
    }
    async with connection() as conn:
        cur = await conn.execute(_LIVE_SQL, params, binary=True)
        row = await cur.fetchone()
        carried(conn, _data_bytes(row))
    if row is None:
        raise NotFound("stream was deleted")
    next_seq, next_pos, closed, deleted, first_seq, first_pos, resume_seq, compacted_seq = row[:8]
    if deleted:
        raise Gone("stream was deleted")
    fresh = replace(
        meta,
        tail=Offset(next_seq, next_pos),
        closed=closed,
        start=Offset(first_seq, first_pos),
        resume_seq=resume_seq,
        compacted_seq=compacted_seq,
    )
    check_start(fresh, start)
    if start.seq < compacted_seq:
        return fresh, await read_range(fresh, start, max_bytes, max_messages)
    # One snapshot: the rows are exactly those of the stream state above.
    try:
        chunk.add(row[8:])
    except _NotContiguous:
        raise BadRequest("offset does not belong to this stream") from None
    return fresh, _result(fresh, start, chunk)


class _NotContiguous(BadRequest):
    """The rows found do not continue where the read is: a bad offset, or the stream was
    trimmed or compacted since its metadata was read."""
