"""The storage contract, called directly (STYLE.md: the store is tested on its own).

One test per outcome of each write, each asserting the error the protocol answers (class,
status and the headers the protocol requires on it), and hand-built mixed batches whose
requests are judged independently: deterministic, no timing, no HTTP. Invariants
(streams/store/writes.py): offsets strictly increase; an append is stored entirely or not at
all; a duplicate of an accepted producer request stores nothing and succeeds; one refused
request never affects another.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from functools import partial
from typing import Any

import psycopg
import pytest

from streams.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    OffsetGone,
    PayloadTooLarge,
    ProtocolError,
    StreamClosed,
    ValidationStale,
)
from streams.protocol.headers import ProducerTuple
from streams.protocol.offsets import Offset
from streams.store import group_commit, pool, prepared, reads, retention, writes
from streams.store.failures import refusal_for
from streams.store.outcomes import SQL_TYPES, DeleteOutcome
from streams.store.types import (
    AppendRequest,
    AppendResult,
    CreateRequest,
    CreateResult,
    ForkSpec,
    TrimResult,
)
from yjs.replicas import version_of

MAX = 1 << 30
TEXT = "text/plain"


def run(scenario: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run a scenario on a fresh event loop with a pool of its own (on the test database)."""

    async def main() -> Any:
        pool._pool, pool._large_pool, pool._pool_lock = None, None, None
        try:
            return await scenario()
        finally:
            await pool.close_pool()

    return asyncio.run(main())


@pytest.fixture
def path(database_url: str) -> str:
    return f"store/{time.time_ns()}"


async def create(path: str, content_type: str = TEXT, **kwargs: Any) -> Any:
    request = CreateRequest(
        path=path,
        content_type=content_type,
        ttl_seconds=kwargs.pop("ttl_seconds", None),
        expires_at=None,
        closed=kwargs.pop("closed", False),
        messages=kwargs.pop("messages", []),
        **kwargs,
    )
    return await writes.create_stream(request, max_stream_bytes=kwargs.get("max", MAX))


def append(
    path: str,
    data: bytes = b"x",
    *,
    producer: tuple[str, int, int] | None = None,
    media: str | None = TEXT,
    close: bool = False,
    stream_seq: str | None = None,
    validation_version: int | None = None,
) -> AppendRequest:
    request = AppendRequest(
        path=path,
        media_type=media if data else None,
        messages=[data] if data else [],
        close=close,
        producer=ProducerTuple(*producer) if producer else None,
        stream_seq=stream_seq,
    )
    request.validation_version = validation_version
    return request


async def batch(
    path: str, *requests: AppendRequest, max_bytes: int = MAX
) -> list[AppendResult | ProtocolError]:
    return await writes.append_batch(path, list(requests), max_stream_bytes=max_bytes)


async def content(path: str) -> bytes:
    meta = await reads.stream_meta(path, touch=False)
    if meta.tail.seq == 0:
        return b""
    return (await reads.read_range(meta, Offset(0, 0), MAX, 1 << 20)).payload


async def _lock_waiters(database_url: str, count: int) -> None:
    """Until ``count`` statements of the database wait for a lock (at most 30 s)."""
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        for _ in range(3000):
            row = await (
                await conn.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).fetchone()
            if row is not None and row[0] >= count:
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"{count} statements never waited for a lock")


def expect(result: Any, error: type[ProtocolError], status: int, **headers: str) -> None:
    assert type(result) is error, result
    assert result.status == status
    for name, value in headers.items():
        assert result.headers[name.replace("_", "-")] == value, result.headers


# -- create -----------------------------------------------------------------------------------


def test_create_outcomes(path: str) -> None:
    async def scenario() -> None:
        made = await create(path, messages=[b"ab"])
        assert made.created and made.tail == Offset(1, 2)
        again = await create(path, messages=[b"ab"])
        assert not again.created and again.stream_id == made.stream_id  # exists
        with pytest.raises(Conflict) as conflict:  # conflict
            await create(path, content_type="application/json")
        assert conflict.value.status == 409
        fork = ForkSpec(source_path=f"{path}-missing", offset=None)
        with pytest.raises(NotFound):  # source_not_found
            await create(f"{path}-fork0", fork=fork)
        fork = ForkSpec(source_path=path, offset=None)
        with pytest.raises(Conflict):  # content_type_mismatch
            await create(f"{path}-fork1", content_type="application/json", fork=fork)
        with pytest.raises(BadRequest):  # fork_offset_invalid
            await create(f"{path}-fork2", fork=ForkSpec(path, Offset(0, 1)))
        with pytest.raises(BadRequest):  # sub_offset_invalid
            await create(f"{path}-fork3", fork=ForkSpec(path, Offset(0, 0), sub_offset=3))
        with pytest.raises(PayloadTooLarge):  # too_large
            await writes.create_stream(
                CreateRequest(f"{path}-big", TEXT, None, None, False, [b"x" * 10]),
                max_stream_bytes=5,
            )
        forked = await create(f"{path}-fork", content_type=None, fork=fork)
        assert forked.created and forked.tail == Offset(1, 2)
        assert await writes.delete_stream(path) is DeleteOutcome.SOFT_DELETED
        with pytest.raises(Conflict):  # source_gone
            await create(f"{path}-fork4", content_type=None, fork=fork)

    run(scenario)


def test_delete_outcomes(path: str) -> None:
    async def scenario() -> None:
        await create(path)
        assert await writes.delete_stream(path) is DeleteOutcome.DELETED
        with pytest.raises(NotFound):
            await writes.delete_stream(path)
        await create(path)
        await create(f"{path}-fork", content_type=None, fork=ForkSpec(path, None))
        assert await writes.delete_stream(path) is DeleteOutcome.SOFT_DELETED
        with pytest.raises(Gone):
            await writes.delete_stream(path)

    run(scenario)


# -- trims and reads of trimmed streams (issue 14) ---------------------------------------------


def test_trim_outcomes(path: str) -> None:
    """One per outcome of ds_trim; reads before the start are OffsetGone with the start."""

    async def scenario() -> None:
        await create(path, messages=[b"ab"])
        await batch(path, append(path, b"cd"), append(path, b"ef"))
        trimmed = await retention.trim(path, Offset(2, 4))  # trimmed
        assert trimmed == TrimResult(True, Offset(2, 4), Offset(3, 6))
        again = await retention.trim(path, Offset(1, 2))  # unchanged
        assert again == TrimResult(False, Offset(2, 4), Offset(3, 6))
        with pytest.raises(BadRequest):  # offset_invalid: inside a message
            await retention.trim(path, Offset(2, 5))
        with pytest.raises(BadRequest):  # offset_invalid: past the tail
            await retention.trim(path, Offset(4, 8))
        with pytest.raises(NotFound):  # not_found
            await retention.trim(f"{path}-missing", None)
        meta = await reads.stream_meta(path, touch=False)
        assert meta.start == Offset(2, 4)
        for gone in (Offset(0, 0), Offset(1, 2)):
            with pytest.raises(OffsetGone) as error:
                await reads.read_range(meta, gone, MAX, 100)
            assert error.value.status == 410
            assert error.value.headers == {"Stream-Start-Offset": str(Offset(2, 4))}
        assert (await reads.read_from(path, None, MAX, 100))[1].payload == b"ef"
        with pytest.raises(OffsetGone):  # fork_offset_gone
            await create(f"{path}-fork", content_type=None, fork=ForkSpec(path, Offset(1, 2)))
        await create(f"{path}-fork", content_type=None, fork=ForkSpec(path, None))
        assert await writes.delete_stream(path) is DeleteOutcome.SOFT_DELETED
        with pytest.raises(Gone):  # gone
            await retention.trim(path, None)

    run(scenario)


# -- append: one test per outcome ---------------------------------------------------------------


def test_appended_and_duplicate(path: str) -> None:
    async def scenario() -> None:
        await create(path)
        (first,) = await batch(path, append(path, b"a", producer=("p", 0, 0)))
        assert isinstance(first, AppendResult) and not first.duplicate
        assert first.next_offset == Offset(1, 1) and first.producer_seq == 0
        (again,) = await batch(path, append(path, b"a", producer=("p", 0, 0)))
        assert isinstance(again, AppendResult) and again.duplicate
        assert again.next_offset == Offset(1, 1)
        assert await content(path) == b"a"

    run(scenario)


def test_only_a_sliding_ttl_makes_appends_renew_accessed_at(path: str, pg: Any) -> None:
    """accessed_at is what a sliding TTL counts from (PROTOCOL.md 5.1), and it is indexed:
    an append changes it only on a stream with a TTL, so the append of any other stream
    updates its row in place (a HOT update, no new entry in every index of ds_stream)."""
    accessed = "SELECT accessed_at FROM ds_stream WHERE path = %s"

    async def scenario() -> None:
        await create(path)
        await create(f"{path}-ttl", ttl_seconds=3600)
        untouched = pg.execute(accessed, [path]).fetchone()[0]
        renewed = pg.execute(accessed, [f"{path}-ttl"]).fetchone()[0]
        for stream in (path, f"{path}-ttl"):
            (result,) = await batch(stream, append(stream, b"a"))
            assert isinstance(result, AppendResult)
        assert pg.execute(accessed, [path]).fetchone()[0] == untouched
        assert pg.execute(accessed, [f"{path}-ttl"]).fetchone()[0] > renewed

    run(scenario)


def test_not_found_and_gone(path: str) -> None:
    async def scenario() -> None:
        (missing,) = await batch(path, append(path))
        expect(missing, NotFound, 404)
        await create(path)
        await create(f"{path}-fork", content_type=None, fork=ForkSpec(path, None))
        await writes.delete_stream(path)
        (gone,) = await batch(path, append(path))
        expect(gone, Gone, 410)

    run(scenario)


def test_producer_outcomes(path: str) -> None:
    """Canonical order (STYLE.md): epoch 403 -> duplicate 204 -> closed 409 -> gap 409."""

    async def scenario() -> None:
        await create(path)
        await batch(path, append(path, producer=("p", 1, 0)))
        (stale,) = await batch(path, append(path, producer=("p", 0, 5)))
        expect(stale, Forbidden, 403, Producer_Epoch="1")
        (not_zero,) = await batch(path, append(path, producer=("p", 2, 3)))
        expect(not_zero, BadRequest, 400)
        (gap,) = await batch(path, append(path, producer=("p", 1, 4)))
        expect(gap, Conflict, 409, Producer_Expected_Seq="1", Producer_Received_Seq="4")
        (new_gap,) = await batch(path, append(path, producer=("q", 0, 2)))
        expect(new_gap, Conflict, 409, Producer_Expected_Seq="0", Producer_Received_Seq="2")
        assert await content(path) == b"x"

    run(scenario)


def test_closed_outcomes(path: str) -> None:
    async def scenario() -> None:
        await create(path)
        (closing,) = await batch(path, append(path, b"last", close=True, producer=("p", 0, 0)))
        assert isinstance(closing, AppendResult) and closing.closed
        (closed,) = await batch(path, append(path))
        expect(
            closed, StreamClosed, 409, Stream_Closed="true", Stream_Next_Offset=str(Offset(1, 4))
        )
        (again,) = await batch(path, append(path, b"", close=True))
        assert isinstance(again, AppendResult) and not again.duplicate  # already_closed
        (retry,) = await batch(path, append(path, b"last", close=True, producer=("p", 0, 0)))
        assert isinstance(retry, AppendResult) and retry.duplicate

    run(scenario)


def test_content_type_stream_seq_size_and_validation(path: str) -> None:
    async def scenario() -> None:
        await create(path)
        (mismatch,) = await batch(path, append(path, media="application/json"))
        expect(mismatch, Conflict, 409)
        await batch(path, append(path, stream_seq="b"))
        (regression,) = await batch(path, append(path, stream_seq="a"))
        expect(regression, Conflict, 409)
        (too_large,) = await batch(path, append(path, b"x" * 100), max_bytes=50)
        expect(too_large, PayloadTooLarge, 413)
        (stale,) = await batch(path, append(path, validation_version=7))
        expect(stale, ValidationStale, 503)
        assert await content(path) == b"x"

    run(scenario)


# -- mixed batches ------------------------------------------------------------------------------


def test_mixed_batch_judges_each_request_alone(path: str) -> None:
    """One batch: good, duplicate, gap, stale epoch, wrong type, good. Each gets the verdict it
    would get alone, in order; only the good ones are stored, contiguously."""

    async def scenario() -> None:
        await create(path)
        await batch(path, append(path, b"0", producer=("p", 1, 0)))
        results = await batch(
            path,
            append(path, b"1", producer=("p", 1, 1)),
            append(path, b"1", producer=("p", 1, 1)),  # duplicate of the request before it
            append(path, b"2", producer=("p", 1, 9)),  # gap
            append(path, b"3", producer=("p", 0, 0)),  # stale epoch
            append(path, b"4", media="application/json"),  # wrong content type
            append(path, b"5", producer=("p", 1, 2)),
        )
        good, duplicate, gap, stale, mismatch, last = results
        assert isinstance(good, AppendResult) and good.next_offset == Offset(2, 2)
        assert isinstance(duplicate, AppendResult) and duplicate.duplicate
        expect(gap, Conflict, 409, Producer_Expected_Seq="2")
        expect(stale, Forbidden, 403)
        expect(mismatch, Conflict, 409)
        assert isinstance(last, AppendResult) and last.next_offset == Offset(3, 3)
        assert await content(path) == b"015"

    run(scenario)


def test_a_request_the_store_cannot_keep_fails_alone(path: str) -> None:
    """A request that makes the batch's statement fail (an index row over PostgreSQL's limit;
    the HTTP layer bounds Producer-Id, the store must not rely on it) fails with a 4xx of its
    own; the other requests of the batch are stored, once, in order (issue 8, defect 1)."""

    async def scenario() -> list[Any]:
        await create(path)
        requests = [
            append(path, b"a"),
            append(path, b"b", producer=(secrets.token_urlsafe(6000), 0, 0)),
            append(path, b"c", producer=("q", 0, 0)),
        ]
        loop = asyncio.get_running_loop()
        futures = [loop.create_task(group_commit.append(r)) for r in requests]
        return [*(await asyncio.gather(*futures, return_exceptions=True)), await content(path)]

    first, bad, third, stored = run(scenario)
    assert isinstance(first, AppendResult) and isinstance(third, AppendResult)
    assert isinstance(bad, ProtocolError) and 400 <= bad.status < 500, bad
    assert stored == b"ac"


def test_a_value_psycopg_will_not_send_is_the_requests_fault(pg: Any) -> None:
    """A NUL in a text parameter is refused by psycopg before it reaches PostgreSQL (a
    DataError without SQLSTATE): a 400, like PostgreSQL's own data exceptions, never a 500 (the
    subscription fuzzer found it through a description holding a NUL)."""
    with pytest.raises(psycopg.DataError) as refused:
        pg.execute("SELECT %s::text", ["a\x00b"])
    assert refused.value.sqlstate is None
    refusal = refusal_for(refused.value)
    assert isinstance(refusal, BadRequest)
    # It says why (psycopg's words), not an empty "SQLSTATE".
    assert "NUL" in str(refusal) and "SQLSTATE" not in str(refusal), str(refusal)


def test_outcome_types_match_the_database(pg: Any) -> None:
    """The database's ENUM types hold exactly the outcomes Python maps."""
    for type_name, outcomes in SQL_TYPES.items():
        labels = pg.execute(f"SELECT enum_range(NULL::{type_name})::text[]").fetchone()[0]
        assert labels == [outcome.value for outcome in outcomes], type_name


Scenario = Callable[[], Awaitable[None]]


def test_mixed_batches_on_several_streams_in_one_transaction(path: str) -> None:
    """One transaction carries batches of three streams (writes.append_batches); each request
    gets the verdict it would get alone, and each stream holds only its accepted appends."""

    async def scenario() -> tuple[list[list[Any]], list[bytes]]:
        paths = [f"{path}-b", f"{path}-a", f"{path}-c"]  # not in lock (path) order
        for stream in paths:
            await create(stream)
            await batch(stream, append(stream, b"0", producer=("p", 1, 0)))
        results = await writes.append_batches(
            [
                (paths[0], [append(paths[0], b"1", producer=("p", 1, 1)),
                            append(paths[0], b"1", producer=("p", 1, 1))]),  # duplicate
                (paths[1], [append(paths[1], b"2", producer=("p", 1, 5)),  # gap
                            append(paths[1], b"3", producer=("p", 1, 1))]),
                (paths[2], [append(paths[2], b"4", producer=("p", 0, 1)),  # stale epoch
                            append(paths[2], b"5")]),
            ],
            max_stream_bytes=MAX,
        )  # fmt: skip
        return results, [await content(stream) for stream in paths]

    (first, second, third), stored = run(scenario)
    assert isinstance(first[0], AppendResult) and not first[0].duplicate
    assert isinstance(first[1], AppendResult) and first[1].duplicate
    expect(second[0], Conflict, 409, Producer_Expected_Seq="1", Producer_Received_Seq="5")
    assert isinstance(second[1], AppendResult) and second[1].next_offset == Offset(2, 2)
    expect(third[0], Forbidden, 403, Producer_Epoch="1")
    assert isinstance(third[1], AppendResult) and third[1].next_offset == Offset(2, 2)
    assert stored == [b"01", b"03", b"05"]


def test_a_transaction_of_several_streams_judges_as_each_stream_alone(path: str, pg: Any) -> None:
    """ds_append_streams writes streams of plain appends together and sends the rest through
    ds_append: whichever way a stream goes, each request gets what ds_append gives it alone.
    The same batches run across streams (one transaction) and stream by stream on a twin of
    every stream; results, tails, stored messages and notifications must be the same."""
    json_type = "application/json"

    def requests(stream: str) -> list[AppendRequest]:
        name = stream.rsplit("/", 1)[1].split("-")[0]
        if name == "json":  # several requests, several messages each
            batch = [
                AppendRequest(stream, json_type, [b'{"a":1}', b"[2]", b'"x"']),
                AppendRequest(stream, json_type, [b"3"]),
            ]
        elif name == "mismatch":  # the second request's media type is not the stream's
            batch = [append(stream, b"ok"), append(stream, b"no", media=json_type)]
        elif name == "toolarge":  # fits alone, not with the request after it
            batch = [append(stream, b"x" * 30), append(stream, b"y" * 30)]
        elif name == "stale":
            batch = [append(stream, b"v", validation_version=3)]
        elif name == "producer":
            batch = [append(stream, b"p", producer=("p", 0, 0)), append(stream, b"q")]
        else:  # plain, ttl, closed, watched, missing
            batch = [append(stream, b"a"), append(stream, b"bc")]
        return batch  # fmt: skip

    names = ["json", "mismatch", "toolarge", "stale", "producer", "plain", "ttl", "closed",
             "watched", "missing"]  # fmt: skip

    async def prepare(suffix: str) -> list[str]:
        streams = [f"{path}/{name}-{suffix}" for name in names]
        for stream in streams:
            name = stream.rsplit("/", 1)[1].split("-")[0]
            if name == "missing":
                continue
            await create(
                stream,
                json_type if name == "json" else TEXT,
                ttl_seconds=3600 if name == "ttl" else None,
                closed=name == "closed",
                messages=[b"0"] if name == "plain" else [],
            )
        pg.execute(
            "UPDATE ds_stream SET watched_until = now() + interval '1 hour' WHERE path = %s",
            [streams[names.index("watched")]],
        )
        return streams

    def stored(stream: str) -> list[tuple[Any, ...]]:
        return pg.execute(
            "SELECT m.seq, m.pos, m.data, m.batch_end FROM ds_message AS m"
            " JOIN ds_stream AS s ON s.id = m.stream_id WHERE s.path = %s ORDER BY m.seq",
            [stream],
        ).fetchall()

    def tails(streams: list[str]) -> list[tuple[Any, ...]]:
        return [
            pg.execute(
                "SELECT next_seq, next_pos, closed, ttl_seconds IS NULL OR accessed_at > now()"
                " - interval '1 minute', (SELECT array_agg((p.producer_id, p.epoch, p.last_seq))"
                " FROM ds_producer AS p WHERE p.stream_id = s.id)"
                " FROM ds_stream AS s WHERE path = %s",
                [stream],
            ).fetchone()
            for stream in streams
        ]

    def shape(result: Any) -> Any:
        if isinstance(result, AppendResult):
            return ("ok", result.next_offset, result.closed, result.duplicate,
                    result.producer_epoch, result.producer_seq)  # fmt: skip
        return (type(result).__name__, result.status, sorted(result.headers.items()))

    def notifications(listener: psycopg.Connection[Any]) -> list[str]:
        # The payload without the stream id: "<id>:<next seq>:o:<first seq>:..."
        return [n.payload.split(":", 1)[1] for n in listener.notifies(timeout=0.5, stop_after=1)]

    with psycopg.connect(pg.info.dsn, autocommit=True) as listener:
        listener.execute("LISTEN ds_streams")

        async def together() -> list[Any]:
            streams = await prepare("together")
            return await writes.append_batches(
                [(stream, requests(stream)) for stream in streams], max_stream_bytes=50
            )

        async def alone() -> list[Any]:
            streams = await prepare("alone")
            return [await writes.append_batch(stream, requests(stream), max_stream_bytes=50)
                    for stream in streams]  # fmt: skip

        results_together = run(together)
        notified_together = notifications(listener)
        results_alone = run(alone)
        notified_alone = notifications(listener)

    assert [[shape(r) for r in rs] for rs in results_together] == [
        [shape(r) for r in rs] for rs in results_alone
    ]
    together_streams = [f"{path}/{name}-together" for name in names]
    alone_streams = [f"{path}/{name}-alone" for name in names]
    assert tails(together_streams) == tails(alone_streams)
    assert [stored(s) for s in together_streams] == [stored(s) for s in alone_streams]
    assert notified_together == notified_alone and len(notified_together) == 1
    # What the batch did, spelled out: a few of the verdicts the twins agree on.
    by_name = dict(zip(names, results_together, strict=True))
    assert [shape(r)[0] for r in by_name["mismatch"]] == ["ok", "Conflict"]
    assert [shape(r)[0] for r in by_name["toolarge"]] == ["ok", "PayloadTooLarge"]
    assert [shape(r)[0] for r in by_name["closed"]] == ["StreamClosed", "StreamClosed"]
    assert [shape(r)[0] for r in by_name["missing"]] == ["NotFound", "NotFound"]
    assert shape(by_name["json"][1])[1] == Offset(4, 14)


def test_a_transaction_of_several_streams_takes_any_path(path: str) -> None:
    """Paths go to ds_append_streams as one array in PostgreSQL's text form: quotes,
    backslashes, commas, braces, spaces, NULL and non-ASCII must each reach their stream."""
    names = ['q"uote', "back\\slash", "com,ma", "{brace}", "sp ace", "NULL", "ünï", "a/b"]

    async def scenario() -> tuple[list[list[Any]], list[bytes]]:
        streams = [f"{path}/{name}" for name in names]
        for stream in streams:
            await create(stream)
        results = await writes.append_batches(
            [(stream, [append(stream, stream.encode())]) for stream in streams],
            max_stream_bytes=MAX,
        )
        return results, [await content(stream) for stream in streams]

    results, stored = run(scenario)
    assert all(isinstance(r, AppendResult) for rs in results for r in rs), results
    assert stored == [f"{path}/{name}".encode() for name in names]


def test_plain_appends_to_several_streams_are_written_without_ds_append(path: str, pg: Any) -> None:
    """The streams of a transaction whose requests are all plain appends are written by one
    statement, never by ds_append (the per-stream path, three times the cost): with ds_append
    made to fail inside a transaction, such a batch still succeeds. (The test above shows that
    both ways answer alike.)"""
    run(lambda: create(f"{path}-a"))
    run(lambda: create(f"{path}-b"))
    with pg.transaction(force_rollback=True):
        pg.execute(
            "CREATE OR REPLACE FUNCTION ds_append(p_path text, p_requests jsonb,"
            " p_lengths int[], p_owners int[], p_data bytea, p_max_stream_bytes bigint)"
            " RETURNS TABLE (outcome ds_append_outcome, next_seq bigint, next_pos bigint,"
            " closed boolean, producer_epoch bigint, producer_seq bigint, expected_seq bigint,"
            " stream_id bigint) LANGUAGE plpgsql AS $$ BEGIN RAISE 'ds_append called'; END $$"
        )
        plain = [
            (f"{path}-a", [append(f"{path}-a", b"a")]),
            (f"{path}-b", [append(f"{path}-b", b"b"), append(f"{path}-b", b"cd")]),
        ]
        _, params = writes.append_streams_params(plain, MAX)
        # The statement's own placeholders ($1...): a raw cursor on the test's connection.
        sql = writes.APPEND_STREAMS.sql.decode()
        rows = psycopg.RawCursor(pg).execute(sql, params).fetchall()
        assert [row[:4] for row in rows] == [(1, "appended", 1, 1), (2, "appended", 1, 1),
                                             (2, "appended", 2, 3)]  # fmt: skip
        # A producer's append is not plain: it goes through ds_append.
        producer = [(f"{path}-a", [append(f"{path}-a", b"e", producer=("p", 0, 0))])]
        _, params = writes.append_streams_params(producer, MAX)
        failing = pytest.raises(psycopg.errors.RaiseException, match="ds_append called")
        with failing, pg.transaction():
            psycopg.RawCursor(pg).execute(sql, params)


def test_a_request_failing_a_transaction_of_several_streams_fails_alone(path: str) -> None:
    """Group commit across streams: when one stream's batch makes the shared transaction fail,
    every other stream's appends are stored, once, and only the request at fault fails."""

    async def scenario() -> list[Any]:
        paths = [f"{path}-{n}" for n in range(6)]
        for stream in paths:
            await create(stream)
        bad = append(paths[3], b"!", producer=(secrets.token_urlsafe(6000), 0, 0))
        requests = [append(stream, stream[-1:].encode()) for stream in paths] + [bad]
        # Every write slot taken while the appends arrive, so that they wait together and the
        # slot that frees takes all seven streams in one transaction.
        group_commit._in_flight = group_commit.max_transactions()
        tasks = [asyncio.ensure_future(group_commit.append(r)) for r in requests]
        await asyncio.sleep(0)
        assert len(group_commit._ready) == 6
        group_commit._in_flight = 0
        group_commit._dispatch()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [*results, *[await content(stream) for stream in paths]]

    outcome = run(scenario)
    results, stored = outcome[:7], outcome[7:]
    assert all(isinstance(r, AppendResult) for r in results[:6]), results
    assert isinstance(results[6], ProtocolError) and 400 <= results[6].status < 500
    assert stored == [str(n).encode() for n in range(6)]


@pytest.mark.parametrize("heavy", ["many-messages", "many-bytes"])
def test_a_small_append_does_not_wait_behind_a_heavy_one(path: str, heavy: str) -> None:
    """Another stream's heavy append is ready first and every slot of large appends is busy:
    the small appends' slot takes the small append alone. Before, 100,000 one-byte messages
    (200 KB, under the bytes that make an append large) went in the small slot together with
    it, and a large append by bytes held the small slot idle until a large slot freed (probe
    7c: another stream's appends waited 0.5-1.2 s and 600 ms). Both are stored in the end."""
    heavy_path, small_path = f"{path}-heavy", f"{path}-small"

    async def scenario() -> tuple[list[str], bool, bytes, bytes]:
        await create(heavy_path)
        await create(small_path)
        if heavy == "many-messages":
            request = append(heavy_path)
            request.messages = [b"1"] * 100_000
            request.size = len(request.messages)
        else:
            request = append(heavy_path, b"L" * (1 << 20))
        slots = max(1, group_commit.settings.DS_DB_POOL_MAX_SIZE - 2)
        group_commit._in_flight = group_commit.max_transactions()
        group_commit._in_flight_large = slots - group_commit._in_flight
        tasks = [asyncio.ensure_future(group_commit.append(request))]
        tasks.append(asyncio.ensure_future(group_commit.append(append(small_path, b"s"))))
        await asyncio.sleep(0)
        assert list(group_commit._ready) == [heavy_path, small_path]
        # The small appends' slot frees, and only that (small ones in flight take large slots).
        group_commit._in_flight, group_commit._in_flight_large = 0, slots
        taken = group_commit._take_transaction()
        assert taken is not None, "nothing taken for the free slot"
        batches, kind = taken
        await group_commit._write(batches, kind)
        group_commit._in_flight_large = 0
        group_commit._dispatch()
        await asyncio.gather(*tasks)
        return [p for p, _ in batches], kind, await content(heavy_path), await content(small_path)

    taken_paths, kind, heavy_content, small_content = run(scenario)
    assert (taken_paths, kind) == ([small_path], "small")
    assert small_content == b"s"
    assert heavy_content == (b"1" * 100_000 if heavy == "many-messages" else b"L" * (1 << 20))


def test_catch_up_read_is_planned_for_one_stream(pg: Any) -> None:
    """The catch-up read joins ds_stream_meta to a range of messages: the planner must expect
    one stream. With the default estimate of 1000 rows a stream with many messages looks
    costly enough (over jit_above_cost) for PostgreSQL to JIT-compile the plan first: ~150 ms
    for a read of 1 ms."""
    params = {"path": "x", "seq": 0, "pos": 0, "rows": 10_000, "bytes": 1 << 22}
    params["large"] = reads.LARGE_MESSAGE_BYTES
    plan = pg.execute("EXPLAIN (FORMAT JSON) " + reads._META_AND_RANGE_SQL, params).fetchone()[0]
    (meta,) = [
        node for node in _plan_nodes(plan[0]["Plan"]) if node["Node Type"] == "Function Scan"
    ]
    assert meta["Function Name"] == "ds_stream_meta" and meta["Plan Rows"] == 1


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node] + [n for child in node.get("Plans", []) for n in _plan_nodes(child)]


def test_an_append_is_acknowledged_only_once_its_transaction_committed(path: str, pg: Any) -> None:
    """A statement's rows arrive before its transaction commits (autocommit commits at the
    end of the exchange), and the commit can still fail: an append is a success only once
    PostgreSQL says the whole exchange is done. A deferred trigger that refuses one message at
    commit stands for the commit failing (or the connection dying then): that append, alone
    or in a transaction of several streams, must fail and nothing of its transaction stay."""
    refused = b"refused at commit"
    pg.execute(
        "CREATE FUNCTION ds_test_refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF NEW.data = 'refused at commit'::bytea THEN"
        " RAISE EXCEPTION 'refused at commit' USING ERRCODE = 'check_violation'; END IF;"
        " RETURN NULL; END $$"
    )
    pg.execute(
        "CREATE CONSTRAINT TRIGGER ds_test_refuse_at_commit AFTER INSERT ON ds_message"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ds_test_refuse_at_commit()"
    )
    try:

        async def outcome(write: Awaitable[Any]) -> Any:
            try:  # the store raises for a statement that failed (group_commit judges it)
                return await write
            except psycopg.Error as exc:
                return exc

        async def scenario() -> tuple[Any, Any, list[bytes]]:
            streams = [f"{path}-a", f"{path}-b"]
            for stream in streams:
                await create(stream)
            alone = await outcome(batch(streams[0], append(streams[0], refused)))
            together = await outcome(
                writes.append_batches(
                    [(streams[0], [append(streams[0], b"not kept")]),
                     (streams[1], [append(streams[1], refused)])],
                    max_stream_bytes=MAX,
                )
            )  # fmt: skip
            return alone, together, [await content(stream) for stream in streams]

        alone, together, stored = run(scenario)
    finally:
        pg.execute("DROP TRIGGER ds_test_refuse_at_commit ON ds_message")
        pg.execute("DROP FUNCTION ds_test_refuse_at_commit()")
    assert isinstance(alone, psycopg.errors.CheckViolation), alone
    assert isinstance(together, psycopg.errors.CheckViolation), together
    assert stored == [b"", b""]


def test_a_large_append_sent_whole_is_stored_exactly(path: str) -> None:
    """An append over LARGE_SEND_BYTES to a database on this machine (a Unix socket) is sent in
    blocking mode (streams.store.prepared._send_whole); what is stored is what was sent, and
    the connection goes on serving in non-blocking mode."""
    data = bytes(range(256)) * (3 * prepared.LARGE_SEND_BYTES // 256) + b"end"

    async def scenario() -> tuple[bool, bytes, Any]:
        await create(path)
        async with pool.connection() as conn:
            over_socket = (conn.pgconn.host or b"").startswith(b"/")
        (result,) = await batch(path, append(path, data))
        (after,) = await batch(path, append(path, b"small"))
        async with pool.connection() as conn:
            blocking = conn.pgconn.nonblocking == 0
        return over_socket and not blocking, await content(path), (result, after)

    served, stored, (result, after) = run(scenario)
    assert served, "the pool must reach the test database over the local cluster's socket"
    assert stored == data + b"small"
    assert isinstance(result, AppendResult) and result.next_offset == Offset(1, len(data))
    assert isinstance(after, AppendResult) and after.next_offset == Offset(2, len(data) + 5)


@pytest.mark.parametrize("reserved", [2, 0])
def test_a_connection_that_carried_a_large_statement_is_replaced(
    path: str, settings: Any, caplog: pytest.LogCaptureFixture, reserved: int
) -> None:
    """libpq keeps a connection's buffers as large as the largest statement it sent or result it
    received: a connection that carried more than BUFFER_KEEP_BYTES is closed when given back
    (its memory freed) and the pool opens another. Small statements keep their connection.
    Write transactions that large go to the connections reserved for them
    (DS_DB__LARGE_WRITE_CONNECTIONS), which keep their buffers, so the next large write does
    not start on a new backend; with none reserved, they use the pool and replace their
    connection. Closed on purpose, a connection is no fault: no warning of a closed connection
    is logged (psycopg_pool warned of each, one line per large append in a production log)."""
    caplog.set_level(logging.INFO, logger="psycopg.pool")
    settings.DS_DB_POOL_MAX_SIZE = 1  # one connection: every statement uses it
    settings.DS_DB_LARGE_WRITE_CONNECTIONS = reserved
    large = b"L" * (pool.BUFFER_KEEP_BYTES + 1)

    async def backend(*, large: bool = False) -> int:
        async with pool.connection(large=large) as conn:
            return conn.info.backend_pid

    async def scenario() -> list[int]:
        await create(path)
        first = await backend()
        await batch(path, append(path, b"small"))
        after_small = await backend()
        await batch(path, append(path, large))  # sent
        after_write = await backend()
        large_before = await backend(large=True)
        await batch(path, append(path, large))
        large_after = await backend(large=True)
        meta = await reads.stream_meta(path, touch=False)
        await reads.read_range(meta, Offset(1, 5), MAX, 10)  # received
        after_read = await backend()
        return [first, after_small, after_write, large_before, large_after, after_read]

    first, after_small, after_write, large_before, large_after, after_read = run(scenario)
    assert first == after_small
    if reserved:
        assert after_write == after_small  # the pool's connection did not carry it
        assert large_after == large_before  # the reserved one kept its buffers
    else:
        assert after_write != after_small
        assert large_after != large_before  # the pool's one connection, replaced
    assert after_read != after_write
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_appends_queued_together_are_judged_against_one_version(pg: Any) -> None:
    """A Yjs document stream's validation version is its id and message count (yjs migration
    0003). Appends queued together at that version go in one batch and are all stored; the
    same appends submitted one by one are split (the first is written alone), and the rest,
    judged against the count the first moved on, are refused as stale."""
    path = f"__ds/yjs/store-tests/docs/{time.time_ns()}"

    async def scenario() -> tuple[int, list[Any], list[Any], bytes]:
        stream_id = (await create(path, "application/octet-stream")).stream_id
        media = "application/octet-stream"
        at = partial(version_of, stream_id)
        together = await group_commit.append_together(
            [append(path, data, media=media, validation_version=at(0)) for data in (b"a", b"b")]
        )
        alone = await asyncio.gather(
            *(
                group_commit.append(append(path, data, media=media, validation_version=at(2)))
                for data in (b"c", b"d")
            ),
            return_exceptions=True,
        )
        return stream_id, together, alone, await content(path)

    stream_id, together, alone, stored = run(scenario)
    assert [type(r) for r in together] == [AppendResult, AppendResult], together
    assert [type(r) for r in alone] == [AppendResult, ValidationStale], alone
    assert stored == b"abc"
    version = pg.execute("SELECT validation_version FROM ds_stream WHERE path = %s", (path,))
    assert version.fetchone() == (version_of(stream_id, 3),)


def test_an_append_after_a_transaction_rolled_back_on_its_connection(
    path: str, settings: Any
) -> None:
    """psycopg answers a rollback on a connection where it prepared statements of its own with
    DEALLOCATE ALL, which drops the append statements this store prepared there too (through
    libpq). The next append on that connection prepares them again instead of failing (it was a
    500: prepared statement "ds_append" does not exist)."""
    settings.DS_DB_POOL_MAX_SIZE = 1  # one connection: every statement uses it

    async def scenario() -> tuple[bytes, bool]:
        await create(path)
        first = await batch(path, append(path, b"a"))
        async with pool.connection() as conn:
            for _ in range(8):  # past psycopg's prepare threshold
                await conn.execute("SELECT %s::int", (1,))
            with pytest.raises(ZeroDivisionError):
                async with conn.transaction():
                    raise ZeroDivisionError
            cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements")
            dropped = (await cur.fetchone()) == (0,)
        second = await batch(path, append(path, b"b"))
        assert all(isinstance(r, AppendResult) for r in first + second), (first, second)
        return await content(path), dropped

    stored, dropped = run(scenario)
    assert dropped  # what the test sets up: the connection has no prepared statement left
    assert stored == b"ab"


def test_a_lone_append_cancelled_mid_write_leaves_its_stream_writable(
    path: str, database_url: str
) -> None:
    """A lone append is written in its caller's task (group_commit.append). Cancelled while
    its statement waits (here for the stream's row lock, held by the test), it gives back its
    transaction slot and its stream's queue: the next append is written, and an append that
    queued behind it meanwhile is answered too. Its statement is cancelled in PostgreSQL
    before the queue moves on (prepared._settle): closing its connection left it waiting for
    the lock in its backend, to be written after the appends behind it ("bac" once, in CI) or
    before them ("abc"), though the lock was never free while its caller waited."""
    _assert_cancelled_append_not_written(path, database_url)


def test_a_cancel_request_the_backend_ignored_is_sent_again(
    path: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend still reading its statement ignores a cancel request: _settle asks again
    until the statement ends. Here the first request is lost on purpose. (The first version
    waited with ``asyncio.timeout``, which under Python 3.11 lets the pending CancelledError
    through rather than time out: it closed the connection, and "a" was written.)"""
    real = psycopg.AsyncConnection.cancel_safe
    requests: list[bool] = []

    async def first_lost(self: psycopg.AsyncConnection[Any], **kwargs: Any) -> None:
        requests.append(bool(requests))
        if len(requests) > 1:
            await real(self, **kwargs)

    monkeypatch.setattr(psycopg.AsyncConnection, "cancel_safe", first_lost)
    _assert_cancelled_append_not_written(path, database_url)
    assert requests[:2] == [False, True]


def test_a_statement_that_does_not_settle_in_time_loses_its_connection(
    path: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When PostgreSQL does not end the statement within SETTLE_SECS (every cancel request
    lost here), the connection is closed and replaced, and the stream's queue moves on: "b"
    and "c" are answered and stored in order. The abandoned statement may still write "a"
    once the lock is free (docs/decisions.md), never twice."""

    async def lost(self: psycopg.AsyncConnection[Any], **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(psycopg.AsyncConnection, "cancel_safe", lost)
    monkeypatch.setattr(prepared, "SETTLE_SECS", 0.5)
    results, in_flight, stored = _cancelled_lone_append(path, database_url)
    assert all(isinstance(r, AppendResult) for r in results), results
    assert in_flight == 0
    assert stored in (b"bc", b"abc", b"bac"), stored


def _assert_cancelled_append_not_written(path: str, database_url: str) -> None:
    """Append "a" alone while the test holds the stream's row lock, queue "b" behind it,
    cancel "a", release the lock, append "c": b and c are answered and stored, "a" never."""
    results, in_flight, stored = _cancelled_lone_append(path, database_url)
    assert all(isinstance(r, AppendResult) for r in results), results
    assert in_flight == 0
    # The lock was held until "a" was cancelled: it was never written, and b, c are in order.
    assert stored == b"bc", stored


def _cancelled_lone_append(path: str, database_url: str) -> tuple[list[Any], int, bytes]:
    """The scenario above: the answers to "b" and "c", the transactions still in flight, and
    what the stream holds."""

    async def scenario() -> tuple[list[Any], int, bytes]:
        await create(path)
        holder = await psycopg.AsyncConnection.connect(database_url)
        try:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM ds_stream WHERE path = %s FOR UPDATE", [path])
                lone = asyncio.ensure_future(group_commit.append(append(path, b"a")))
                await _lock_waiters(database_url, 1)
                behind = asyncio.ensure_future(group_commit.append(append(path, b"b")))
                await asyncio.sleep(0.05)
                lone.cancel()
                await asyncio.gather(lone, return_exceptions=True)
        finally:
            await holder.close()
        results = [await behind, await group_commit.append(append(path, b"c"))]
        return results, group_commit._in_flight, await content(path)

    return run(scenario)


def test_a_batch_of_creates_judges_each_and_records_them_in_order(path: str, pg: Any) -> None:
    """Creates in one statement (writes.create_streams: ds_create_streams): each gets the
    verdict it would get alone (created, an idempotent repeat, a conflict, a fork, initial
    messages, an expiry), in the caller's order whatever the path order; the registry holds
    one insert per stream created, in path order, at consecutive offsets."""
    expires = datetime(2099, 1, 2, 3, 4, 5, tzinfo=UTC)

    def request(name: str, content_type: str = TEXT, **kwargs: Any) -> CreateRequest:
        return CreateRequest(
            path=f"{path}/{name}",
            content_type=content_type,
            ttl_seconds=None,
            expires_at=kwargs.pop("expires_at", None),
            closed=False,
            messages=kwargs.pop("messages", []),
            **kwargs,
        )

    async def scenario() -> tuple[list[Any], bytes, bytes]:
        await create(f"{path}/b-existing")
        requests = [
            request("d-messages", messages=[b"one", b"two"]),
            request("b-existing"),  # an idempotent repeat
            request("b-existing", "application/json"),  # a conflict
            request("c-fork", fork=ForkSpec(f"{path}/b-existing", None, 0)),
            request("a-expiring", expires_at=expires),
            request("e-bad-fork", fork=ForkSpec(f"{path}/missing", None, 0)),
        ]
        results = await writes.create_streams(requests, max_stream_bytes=MAX)
        return results, await content(f"{path}/d-messages"), await content(f"{path}/c-fork")

    registry_tail = pg.execute("SELECT next_seq FROM ds_stream WHERE path = '__registry__'")
    (before,) = registry_tail.fetchone()
    results, messages, fork = run(scenario)
    created, existing, conflict, forked, expiring, bad = results
    assert isinstance(created, CreateResult) and created.created and created.tail.seq == 2
    assert isinstance(existing, CreateResult) and not existing.created
    assert isinstance(conflict, Conflict)
    assert isinstance(forked, CreateResult) and forked.created
    assert isinstance(expiring, CreateResult) and expiring.created
    assert isinstance(bad, ProtocolError) and 400 <= bad.status < 500
    assert messages == b"onetwo" and fork == b""
    row = pg.execute(
        "SELECT expires_at FROM ds_stream WHERE path = %s", [f"{path}/a-expiring"]
    ).fetchone()
    assert row == (expires,)
    events = pg.execute(
        "SELECT m.seq, convert_from(m.data, 'UTF8')::jsonb ->> 'key' FROM ds_message AS m"
        " JOIN ds_stream AS s ON s.id = m.stream_id"
        " WHERE s.path = '__registry__' AND m.seq >= %s AND m.data::text LIKE %s ORDER BY m.seq",
        [before, "%" + path.encode().hex() + "%"],
    ).fetchall()
    keys = [key for _, key in events]
    names = ("b-existing", "a-expiring", "c-fork", "d-messages")  # created alone, then the batch
    assert keys == [f"{path}/{n}" for n in names], events
    seqs = [seq for seq, _ in events[1:]]
    assert seqs == list(range(seqs[0], seqs[0] + 3))


def test_a_batch_of_creates_that_creates_nothing_leaves_the_registry_alone(
    path: str, database_url: str
) -> None:
    """Creates that all find their stream there (idempotent repeats) announce nothing, so they
    must not wait for the registry's lock (held here by the test, as a long create batch
    would hold it)."""

    async def scenario() -> list[Any]:
        await create(f"{path}/a")
        await create(f"{path}/b")
        holder = await psycopg.AsyncConnection.connect(database_url)
        try:
            async with holder.transaction():
                await holder.execute(
                    "SELECT 1 FROM ds_stream WHERE path = '__registry__' FOR UPDATE"
                )
                repeats = [CreateRequest(f"{path}/{n}", TEXT, None, None, False, []) for n in "ab"]
                return await asyncio.wait_for(
                    writes.create_streams(repeats, max_stream_bytes=MAX), timeout=10
                )
        finally:
            await holder.close()

    results = run(scenario)
    assert all(isinstance(r, CreateResult) and not r.created for r in results), results


def test_watch_renewals_skip_a_held_row_and_say_which_marks_ran_out(
    path: str, pg: Any, database_url: str
) -> None:
    """Probe 10i: the renewal of a process's watch marks locked every stream's row in one
    statement, so one row another session held made it wait for the lock timeout and fail for
    every stream; the marks ran out, and appends through other processes stopped reaching this
    process's readers. A renewal (``writes.renew_watches``) skips a held row (renewed at the next
    round) without waiting, and says whose mark had run out, so their readers read again."""
    held, other, lapsed = (f"{path}-held", f"{path}-other", f"{path}-lapsed")

    async def scenario() -> list[int]:
        ids = [(await create(name)).stream_id for name in (held, other, lapsed)]
        await writes.watch_streams(ids, 60)
        return ids

    ids = run(scenario)
    pg.execute(
        "UPDATE ds_stream SET watched_until = now() - interval '1 s' WHERE id = %s", [ids[2]]
    )
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT 1 FROM ds_stream WHERE id = %s FOR UPDATE", [ids[0]])
        renewed = run(lambda: writes.renew_watches(ids, 60))
        holder.rollback()
    assert renewed == {ids[1]: False, ids[2]: True}
    marks = pg.execute(
        "SELECT id, watched_until > now() + interval '50 s' FROM ds_stream WHERE id = ANY(%s)",
        [ids],
    ).fetchall()
    assert dict(marks) == {ids[0]: True, ids[1]: True, ids[2]: True}


def test_a_watch_mark_about_to_run_out_waits_for_its_busy_row(
    path: str, pg: Any, database_url: str
) -> None:
    """Review: a row busy with other processes' appends can be found held at every renewal
    until its mark runs out, and then appends through those processes stop notifying this
    one's readers. A mark that would run out before two more checks waits for its row a
    moment (here the row is held for 0.3 s)."""
    from streams.live import WATCH_SECS, LiveHub, Subscription

    async def scenario() -> tuple[float, float]:
        stream_id = (await create(path)).stream_id
        await writes.watch_streams([stream_id], 60)
        hub = LiveHub()
        hub._subscriptions[stream_id] = {Subscription()}
        hub._marked[stream_id] = time.monotonic() - (WATCH_SECS - 5)  # runs out in 5 s
        before = hub._marked[stream_id]
        with psycopg.connect(database_url) as holder:
            holder.execute("SELECT 1 FROM ds_stream WHERE id = %s FOR UPDATE", [stream_id])
            asyncio.get_running_loop().call_later(0.3, holder.rollback)
            await hub._renew_or_warn([stream_id], "renew")
        return before, hub._marked[stream_id]

    before, after = run(scenario)
    assert after > before, "the mark was not renewed"
    (renewed,) = pg.execute(
        "SELECT watched_until > now() + interval '50 s' FROM ds_stream WHERE path = %s", [path]
    ).fetchone()
    assert renewed
