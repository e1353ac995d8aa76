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
from streams.store.pool import get_pool
from streams.store.types import ReadResult, Segment, StreamMeta

# The media type by the store's rule (ds_media_type), which judges appends: once per read.
_META_SQL = (
    "SELECT id, content_type, ds_media_type(content_type), next_seq, next_pos, closed,"
    " ttl_seconds, expires_at, deleted, chain_ids, chain_lo, chain_hi"
    " FROM ds_stream_meta(%s, %s)"
)
_ROWS_SQL = (
    "SELECT seq, pos, data FROM ds_message"
    " WHERE stream_id = %s AND seq >= %s AND seq < %s AND pos < %s ORDER BY seq"
)
# A live reader's re-read of a stream that is not a fork: its tail and the new rows in ONE
# statement (one round trip, one snapshot). No row at all: the stream is gone.
_LIVE_SQL = (
    "SELECT s.next_seq, s.next_pos, s.closed, s.deleted_at IS NOT NULL, m.seq, m.pos, m.data"
    " FROM ds_stream AS s LEFT JOIN LATERAL ("
    "   SELECT seq, pos, data FROM ds_message"
    "    WHERE stream_id = s.id AND seq >= %(seq)s AND seq < s.next_seq AND pos < %(limit)s"
    "    ORDER BY seq) AS m ON true"
    " WHERE s.id = %(id)s ORDER BY m.seq"
)


async def stream_meta(path: str, *, touch: bool) -> StreamMeta:
    """The stream at ``path``; ``touch`` renews a sliding TTL (reads do, HEAD does not).
    Raises NotFound (missing or expired) or Gone (soft-deleted)."""
    pool = await get_pool()
    async with pool.connection() as conn:
        cur = await conn.execute(_META_SQL, (path, touch))
        row = await cur.fetchone()
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


async def read_range(meta: StreamMeta, start: Offset, max_bytes: int) -> ReadResult:
    """Messages from ``start`` up to about ``max_bytes`` (always at least one message), across
    the fork chain, bounded by the tail in ``meta``."""
    check_offset(meta, start)
    tail = meta.tail
    messages: list[bytes] = []
    next_offset = start
    if start.seq < tail.seq:
        byte_limit = start.pos + max(max_bytes, 1)
        pool = await get_pool()
        async with pool.connection() as conn:
            # Oldest segment first: the chain is stored leaf-first.
            for segment in reversed(meta.segments):
                hi = tail.seq if segment.hi is None else min(segment.hi, tail.seq)
                lo = max(segment.lo, next_offset.seq)
                if lo >= hi:
                    continue
                cur = await conn.execute(
                    _ROWS_SQL, (segment.stream_id, lo, hi, byte_limit), binary=True
                )
                rows = await cur.fetchall()
                next_offset = _collect(rows, messages, next_offset)
                if not rows or rows[-1][0] + 1 < hi:
                    break  # the byte budget ended this read inside the segment
        if not messages:
            raise BadRequest("offset does not belong to this stream")
    return _result(meta, start, messages, next_offset)


def _collect(rows: list[tuple[Any, ...]], messages: list[bytes], start: Offset) -> Offset:
    """Add the ``(seq, pos, data)`` rows to ``messages``, checking that they continue exactly
    from ``start``; the offset after them."""
    next_offset = start
    for seq, pos, data in rows:
        if seq != next_offset.seq or pos != next_offset.pos:
            raise BadRequest("offset does not belong to this stream")
        messages.append(bytes(data))
        next_offset = Offset(seq + 1, pos + len(data))
    return next_offset


def _result(meta: StreamMeta, start: Offset, messages: list[bytes], end: Offset) -> ReadResult:
    up_to_date = end == meta.tail
    return ReadResult(
        messages=messages,
        start=start,
        next_offset=end,
        up_to_date=up_to_date,
        closed_at_tail=up_to_date and meta.closed,
    )


async def reread(meta: StreamMeta, start: Offset, max_bytes: int) -> tuple[StreamMeta, ReadResult]:
    """A live reader's re-read after a wake-up: the stream's current state and what it holds
    from ``start``. Raises NotFound or Gone when the stream went away meanwhile."""
    if len(meta.segments) > 1:
        fresh = await stream_meta(meta.path, touch=False)
        if fresh.id != meta.id:
            raise NotFound("stream was deleted")
        return fresh, await read_range(fresh, start, max_bytes)
    pool = await get_pool()
    async with pool.connection() as conn:
        cur = await conn.execute(
            _LIVE_SQL,
            {"id": meta.id, "seq": start.seq, "limit": start.pos + max(max_bytes, 1)},
            binary=True,
        )
        rows = await cur.fetchall()
    if not rows:
        raise NotFound("stream was deleted")
    next_seq, next_pos, closed, deleted = rows[0][:4]
    if deleted:
        raise Gone("stream was deleted")
    fresh = replace(meta, tail=Offset(next_seq, next_pos), closed=closed)
    check_offset(fresh, start)
    messages: list[bytes] = []
    # Without new messages the one row has a NULL message part (a LEFT JOIN).
    found = [row[4:] for row in rows] if rows[0][4] is not None else []
    return fresh, _result(fresh, start, messages, _collect(found, messages, start))
