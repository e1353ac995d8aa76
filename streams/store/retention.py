"""Retention in the store: trims, purges and the retention sweep's pages (``sql/retention.sql``).

Invariants: a stream's start only moves forward, always to a retained position (a message's
start or the tail), so offsets of retained messages never change; a trim holds the stream's
row lock for one short transaction that writes its new start; the rows below are deleted
later, in bounded batches that take no stream lock, and rows a fork still reads through its
source are kept until no fork needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from streams.protocol.offsets import Offset
from streams.store.conflicts import retried
from streams.store.outcomes import TRIM_ERRORS, TRIM_SUCCESSES, TrimOutcome
from streams.store.pool import connection
from streams.store.types import TrimResult


async def trim(path: str, before: Offset | None) -> TrimResult:
    """Drop everything of the stream at ``path`` before ``before`` (None: everything, the
    tail). Raises NotFound, Gone, or BadRequest for an offset that is not a retained position;
    an offset at or before the current start changes nothing."""

    async def attempt() -> tuple[Any, ...] | None:
        async with connection() as conn:
            cur = await conn.execute(
                "SELECT outcome, first_seq, first_pos, next_seq, next_pos FROM ds_trim(%s, %s, %s)",
                (path, before.seq if before else None, before.pos if before else None),
            )
            return await cur.fetchone()

    row = await retried(attempt, "a trim")
    assert row is not None
    outcome = TrimOutcome(row[0])
    if outcome not in TRIM_SUCCESSES:
        raise TRIM_ERRORS[outcome]()
    return TrimResult(
        trimmed=outcome is TrimOutcome.TRIMMED,
        start=Offset(row[1], row[2]),
        tail=Offset(row[3], row[4]),
    )


@dataclass(frozen=True, slots=True)
class PurgeClaim:
    """A stream this process purges; no other takes it before its lease ends."""

    stream_id: int
    path: str
    # The claim's due time: the stream leaves the queue only if nobody queued it again.
    token: datetime


async def purge_claim(lease_secs: float) -> PurgeClaim | None:
    """Take the stream that waits longest for a purge (no other process takes it for
    ``lease_secs``); None when none is due."""
    async with connection() as conn:
        cur = await conn.execute(
            "SELECT stream_id, path, claim FROM ds_purge_claim(%s)", (lease_secs,)
        )
        row = await cur.fetchone()
    return PurgeClaim(row[0], row[1] or f"#{row[0]}", row[2]) if row else None


async def purge_step(claim: PurgeClaim, from_seq: int | None, batch: int) -> tuple[int | None, int]:
    """Delete one batch of a claimed stream's rows that nobody reads any more, in one short
    transaction: (where the next batch starts, or None when done; rows deleted)."""
    async with connection() as conn:
        cur = await conn.execute(
            "SELECT next_from, deleted FROM ds_purge(%s, %s, %s, %s)",
            (claim.stream_id, claim.token, from_seq, batch),
        )
        row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A stream under a retention policy, from a page of the sweep: where it starts and where
    its policy says it should start (ahead when it must be trimmed)."""

    stream_id: int
    path: str
    start: Offset
    target: Offset

    @property
    def due(self) -> bool:
        return self.target > self.start


async def retention_page(
    after_id: int,
    limit: int,
    *,
    default_age: int | None,
    default_bytes: int | None,
    mark_interval: float,
) -> list[Candidate]:
    """Streams after ``after_id`` (by id, at most ``limit``) under a retention policy, their
    time index marked when due. Takes no stream lock."""
    async with connection() as conn:
        cur = await conn.execute(
            "SELECT stream_id, path, first_seq, first_pos, target_seq, target_pos"
            " FROM ds_retention_page(%s, %s, %s, %s, %s)",
            (after_id, limit, default_age, default_bytes, mark_interval),
        )
        rows = await cur.fetchall()
    return [Candidate(r[0], r[1], Offset(r[2], r[3]), Offset(r[4], r[5])) for r in rows]


async def retention_trim(stream_id: int, target: Offset) -> bool:
    """Trim a stream to ``target`` for its policy (one short transaction under its lock);
    False when it was locked by someone else or is already trimmed that far."""
    async with connection() as conn:
        cur = await conn.execute(
            "SELECT ds_retention_trim(%s, %s, %s)", (stream_id, target.seq, target.pos)
        )
        row = await cur.fetchone()
    return bool(row and row[0])


async def default_applies(stream_id: int, path: str) -> bool:
    """Does the server-wide default retention apply to this stream (it has no policy of its
    own)? Not to internal streams, nor to those an app keeps whole (registered state
    streams)."""
    if path.startswith("__"):
        return False
    async with connection() as conn:
        cur = await conn.execute("SELECT NOT ds_hook_keeps_history(%s)", (stream_id,))
        row = await cur.fetchone()
    return bool(row and row[0])
