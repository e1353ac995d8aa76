"""Group commit of appends, within a stream and across streams (DESIGN.md, Storage).

With durable commits every transaction waits for its own WAL flush, and a stream's appends
are serialized by its row lock. So inside one process:

* per stream, while a batch is in flight, later appends queue, and when it commits everything
  queued goes in the next batch (one lock, one statement for all of them);
* across streams, at most ``MAX_TRANSACTIONS`` transactions are in flight at once; streams whose
  appends are ready while every slot is busy wait, and the next free slot takes all of them in
  ONE statement (``ds_append_streams``: one transaction, one commit, one WAL flush), each
  stream's batch judged as it would be alone.

A lone append never waits: with a slot free it is written at once, in its caller's own task (a
writer task of its own cost 2-5% more server CPU per append, side by side; a caller cancelled
while its statement runs cancels the write: docs/decisions.md says what that skips, and the
console, whose view Django cancels when its client leaves, shields the call). Each request is
judged on its own (``ds_append``), is acknowledged only after the commit, and an error nobody
anticipated fails only its own request (``_after_failure``). Across processes, transactions
simply queue on the row locks, taken in path order everywhere.

A transaction waits at most ``LOCK_SLICE_MS`` for a stream's lock: a row held longer (by an
operator's session, say) sends its stream's batch back to the queue (``_requeue``), and the
stream is contended: its batches are written alone, in a slot of their own
(``MAX_CONTENDED_TRANSACTIONS``), so that no other stream waits behind it again. Each append
fails (503) once it has waited the lock timeout in all (``_expire``: on time, whether its batch
is being tried or waiting its turn).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import psycopg
from django.conf import settings

from streams import metrics
from streams.errors import ProtocolError, ServiceUnavailable
from streams.store.failures import refusal_for
from streams.store.types import AppendRequest, AppendResult
from streams.store.writes import append_batch, append_batches, held_streams

logger = logging.getLogger(__name__)

# Bounds on one stream's batch, so a burst cannot build one giant statement...
MAX_BATCH_REQUESTS = 256
MAX_BATCH_BYTES = 8 * 1024 * 1024
# ... and on one transaction across streams.
MAX_TRANSACTION_STREAMS = 64
MAX_TRANSACTION_BYTES = 16 * 1024 * 1024
# A transaction whose first stream has this much data waiting is a large one (_in_flight_large).
LARGE_TRANSACTION_BYTES = 256 * 1024
# What a message costs beside its bytes, counted as that many bytes when appends are weighed
# against the bounds above: 100,000 messages of one byte (200 KB) took 0.6-1.8 s to write, in
# the slot of small appends, and every other stream's appends waited (probe 7c).
MESSAGE_WEIGHT = 1024
# How many ready streams past a large one waiting for a slot are looked at for small appends.
SMALL_LOOKAHEAD = 16
# How long (ms) a transaction waits for a stream's lock before its slot goes to other streams
# (at most the lock timeout): with one slot per process, a row an operator's session held made
# every other stream's appends wait the full lock timeout, 15 s (probe 10e).
LOCK_SLICE_MS = 1000
# Transactions of contended streams in flight at once per process (each holds a connection
# while it waits for its lock).
MAX_CONTENDED_TRANSACTIONS = 1
# How long (seconds) a stream that missed its lock stays contended without appends waiting.
CONTENDED_MEMORY_SECS = 60.0

Pending = tuple[AppendRequest, "asyncio.Future[AppendResult]"]
# The slot a transaction takes: of small appends, of large ones, or of a contended stream.
Kind = Literal["small", "large", "contended"]
Batch = tuple[str, list[Pending]]
Result = AppendResult | ProtocolError
CommitListener = Callable[[list[AppendRequest], list[Result]], None]


@dataclass
class _StreamQueue:
    pending: list[Pending] = field(default_factory=list)
    # A batch of this stream is being written: its next waits (one per stream in flight).
    running: bool = False
    # Its last batch did not get a lock in a slice: its next is written alone, in the slot of
    # contended streams; until then, its appends are failed as their time runs out (expiry).
    contended: bool = False
    expiry: asyncio.TimerHandle | None = None

    def large(self) -> bool:
        """Whether its next batch makes a large transaction."""
        waiting = self.pending[:MAX_BATCH_REQUESTS]
        return sum(weight(request) for request, _ in waiting) >= LARGE_TRANSACTION_BYTES


def weight(request: AppendRequest) -> int:
    """What an append weighs against the bounds of batches and transactions: its bytes, and
    ``MESSAGE_WEIGHT`` a message."""
    return request.size + len(request.messages) * MESSAGE_WEIGHT


_queues: dict[str, _StreamQueue] = {}
# Streams with appends waiting and no batch in flight, oldest first (a dict: an ordered set);
# contended ones apart.
_ready: dict[str, None] = {}
_contended_ready: dict[str, None] = {}
# When each stream last missed its lock (time.monotonic()), until one of its batches gets it:
# at most MAX_CONTENDED_LATELY of them (all forgotten when full).
_contended_lately: dict[str, float] = {}
MAX_CONTENDED_LATELY = 10_000
# Transactions in flight: of small appends (at most max_transactions(): fewer, larger batches
# cost less CPU per append) and of large data (up to the pool's size less two: writing a MiB
# takes PostgreSQL milliseconds, and large appends to different streams run in parallel).
_in_flight = 0
_in_flight_large = 0
_in_flight_contended = 0
# Told about every batch after it was written (the service layer wakes live readers): the store
# does not import live delivery.
_listeners: list[CommitListener] = []
# Running writer tasks, referenced so they are not garbage-collected mid-flight.
_writers: set[asyncio.Task[None]] = set()


def on_commit(listener: CommitListener) -> None:
    _listeners.append(listener)


def max_transactions() -> int:
    """Write transactions in flight at once per process (DS_DB__WRITE_TRANSACTIONS), at most
    the pool's size less two, so reads always find a connection."""
    return max(1, min(settings.DS_DB_WRITE_TRANSACTIONS, settings.DS_DB_POOL_MAX_SIZE - 2))


async def append(request: AppendRequest) -> AppendResult:
    """Append through the stream's queue; returns after commit or raises the request's error."""
    started = time.perf_counter()
    future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
    # If the client leaves, nobody awaits the outcome: mark it retrieved to keep logs quiet.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    request.queued_at = time.monotonic()
    queue = _queues.get(request.path) or _new_queue(request.path)
    queue.pending.append((request, future))
    if not queue.running:
        _make_ready(request.path, queue)
        if len(_ready) == 1 and len(queue.pending) == 1 and not queue.contended:
            # Alone: written here. Cancelled, it still gives back its slot and its stream's
            # queue (_write); what queued behind it meanwhile goes in the next transaction.
            transaction = _take_transaction()
            if transaction is not None:
                await _write(*transaction)
                if future.done():  # else the stream's lock was held: requeued (_write)
                    result = future.result()
                    metrics.APPEND_SECONDS.observe(time.perf_counter() - started)
                    return result
        _dispatch()
    # Batched with others: the writer is a task of its own, so a caller cancelled mid-append
    # cancels only its wait, never the transaction other requests share.
    result = await asyncio.shield(future)
    metrics.APPEND_SECONDS.observe(time.perf_counter() - started)
    return result


async def append_together(requests: list[AppendRequest]) -> list[Result]:
    """Appends to one stream queued at once, so that they are written in one batch when the
    batch bounds allow (a caller that judged them all against one validation version of the
    stream: the store judges a batch against the version read with the row). Each request's
    result or refusal, in order; shielded like batched appends."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    futures: list[asyncio.Future[AppendResult]] = []
    path = requests[0].path
    queue = _queues.get(path) or _new_queue(path)
    queued_at = time.monotonic()
    for request in requests:
        assert request.path == path, "appends together are to one stream"
        request.queued_at = queued_at
        future: asyncio.Future[AppendResult] = loop.create_future()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        queue.pending.append((request, future))
        futures.append(future)
    if not queue.running:
        _make_ready(path, queue)
    _dispatch()
    outcomes = await asyncio.shield(asyncio.gather(*futures, return_exceptions=True))
    elapsed = time.perf_counter() - started
    results: list[Result] = []
    for outcome in outcomes:
        if isinstance(outcome, AppendResult | ProtocolError):
            metrics.APPEND_SECONDS.observe(elapsed)
            results.append(outcome)
        else:
            raise outcome
    return results


def _new_queue(path: str) -> _StreamQueue:
    """A stream's queue, contended from the start when its lock was missed lately: a queue
    emptied by its 503s forgot it, and the next append to the held row was written with other
    streams again, or in the write slot, each time holding them up a slice (review)."""
    queue = _queues[path] = _StreamQueue()
    missed = _contended_lately.get(path)
    if missed is not None:
        if time.monotonic() - missed < CONTENDED_MEMORY_SECS:
            queue.contended = True
        else:
            del _contended_lately[path]
    return queue


def _make_ready(path: str, queue: _StreamQueue) -> None:
    if not queue.contended:
        _ready[path] = None
        return
    _contended_ready[path] = None
    if queue.expiry is None:
        # Contended from the start (_new_queue): its appends too answer 503 at their lock
        # timeout, not after their turn in the contended slot (review).
        _expire(path)


def _dispatch() -> None:
    """Start transactions for ready streams while slots are free."""
    global _in_flight_contended
    loop = asyncio.get_running_loop()
    transactions: list[tuple[list[Batch], Kind]] = []
    while (transaction := _take_transaction()) is not None:
        transactions.append(transaction)
    while _contended_ready and _in_flight_contended < MAX_CONTENDED_TRANSACTIONS:
        path = next(iter(_contended_ready))
        del _contended_ready[path]
        queue = _queues[path]
        queue.running = True
        _in_flight_contended += 1
        transactions.append(([(path, _take_batch(queue))], "contended"))
    for batches, kind in transactions:
        writer = loop.create_task(_write(batches, kind))
        _writers.add(writer)
        writer.add_done_callback(_writers.discard)


def _take_transaction() -> tuple[list[Batch], Kind] | None:
    """The next transaction of small or large appends (of streams not contended), its slot
    taken; None when no stream is ready or no slot is free."""
    global _in_flight, _in_flight_large
    large = _next_kind()
    if large is None:
        return None
    batches: list[Batch] = []
    size = 0
    # A large transaction takes about one stream's data, so large appends to several streams
    # are written in parallel; a small one takes every small stream ready.
    most = LARGE_TRANSACTION_BYTES if large else MAX_TRANSACTION_BYTES
    for path in list(_ready):
        if len(batches) >= MAX_TRANSACTION_STREAMS or size >= most:
            break
        queue = _queues[path]
        if not large and queue.large():
            continue  # left for a large transaction's slot
        del _ready[path]
        queue.running = True
        batch = _take_batch(queue)
        size += sum(weight(request) for request, _ in batch)
        batches.append((path, batch))
    if large:
        _in_flight_large += 1
        return batches, "large"
    _in_flight += 1
    return batches, "small"


def _next_kind() -> bool | None:
    """Whether the next transaction is a large one, when one can start: of the oldest ready
    stream's kind when a slot of that kind is free. While large appends fill theirs, small
    ones ready behind them take the small appends' slot rather than wait for the large
    (probe 7c: eight 8 MiB appends made another stream's small append wait 600 ms)."""
    if not _ready:
        return None
    small_free = _in_flight < max_transactions()
    if not _queues[next(iter(_ready))].large():
        return False if small_free else None
    if _in_flight + _in_flight_large + _in_flight_contended < max(
        1, settings.DS_DB_POOL_MAX_SIZE - 2
    ):
        return True
    if small_free:
        for n, path in enumerate(_ready):
            if not _queues[path].large():
                return False
            if n >= SMALL_LOOKAHEAD:
                break
    return None


def _take_batch(queue: _StreamQueue) -> list[Pending]:
    size = 0
    count = 0
    for request, _ in queue.pending:
        weighs = weight(request)
        if count and (count >= MAX_BATCH_REQUESTS or size + weighs > MAX_BATCH_BYTES):
            break
        size += weighs
        count += 1
    batch, queue.pending = queue.pending[:count], queue.pending[count:]
    return batch


async def _write(batches: list[Batch], kind: Kind) -> None:
    global _in_flight, _in_flight_large, _in_flight_contended
    try:
        metrics.BATCH_REQUESTS.observe(sum(len(batch) for _, batch in batches))
        outcomes, held = await _outcomes(batches)
        for (path, batch), (results, unreachable) in zip(batches, outcomes, strict=True):
            if results is None:
                _requeue(path, batch, contended=path in held)
            else:
                _settled(path, _queues[path])
                _conclude(path, batch, results, unreachable)
    finally:
        if kind == "large":
            _in_flight_large -= 1
        elif kind == "small":
            _in_flight -= 1
        else:
            _in_flight_contended -= 1
        for path, _ in batches:
            queue = _queues[path]
            queue.running = False
            if queue.pending:
                _make_ready(path, queue)
            else:
                _forget(path, queue)
        _dispatch()


def _forget(path: str, queue: _StreamQueue) -> None:
    """A stream with nothing waiting and nothing in flight (contended lately or not:
    ``_contended_lately``)."""
    if queue.expiry is not None:
        queue.expiry.cancel()
        queue.expiry = None
    del _queues[path]


def _settled(path: str, queue: _StreamQueue) -> None:
    """Its last batch got its locks: no longer contended."""
    if queue.contended:
        queue.contended = False
        _contended_lately.pop(path, None)
    if queue.expiry is not None:
        queue.expiry.cancel()
        queue.expiry = None


async def _outcomes(
    batches: list[Batch],
) -> tuple[list[tuple[list[Result] | None, ServiceUnavailable | None]], set[str]]:
    """Each batch's results (None: written in no transaction, to be tried again) and the
    error that says the database is unreachable, if so; and the streams whose locks were held
    (contended: their batches were not written)."""
    requests = [[request for request, _ in batch] for _, batch in batches]
    paths = [path for path, _ in batches]
    if len(batches) > 1:
        try:
            written = await append_batches(
                list(zip(paths, requests, strict=True)),
                max_stream_bytes=settings.DS_MAX_STREAM_BYTES,
                lock_wait_ms=_lock_slice_ms(),
            )
            return [(results, None) for results in written], set()
        except ServiceUnavailable as unreachable:
            return [([unreachable] * len(reqs), unreachable) for reqs in requests], set()
        except psycopg.errors.LockNotAvailable:
            # Some lock was not had in the slice: every batch goes back, the streams whose
            # rows are held contended (tried alone, in their own slot), the others to the next
            # transaction. (All contended, the streams not held waited a slice behind each
            # held one: 9 s with 8 rows held, review.) No row held: a table is, all wait.
            try:
                held = await held_streams(paths, lock_wait_ms=_lock_slice_ms())
            except Exception as exc:  # noqa: BLE001 - not known: every stream waits
                # (The question failing, cancelled or cut, left the batches in no queue and
                # their appends never answered: review.)
                logger.warning("could not tell which streams' rows are held: %s", exc)
                held = set()
            return [(None, None) for _ in batches], held or set(paths)
        except Exception:  # noqa: BLE001 - some batch failed: each is judged alone now
            logger.warning("a transaction of %d streams failed; writing each alone", len(batches))
    outcomes = [await _alone(path, reqs) for path, reqs in zip(paths, requests, strict=True)]
    held = {path for path, (results, _) in zip(paths, outcomes, strict=True) if results is None}
    return outcomes, held


def _lock_slice_ms() -> int:
    """How long a transaction waits for a stream's lock: ``LOCK_SLICE_MS``, at most the lock
    timeout (0: none)."""
    if settings.DS_DB_LOCK_TIMEOUT_MS > 0:
        return min(LOCK_SLICE_MS, settings.DS_DB_LOCK_TIMEOUT_MS)
    return LOCK_SLICE_MS


async def _alone(
    path: str, requests: list[AppendRequest]
) -> tuple[list[Result] | None, ServiceUnavailable | None]:
    try:
        results = await append_batch(
            path,
            requests,
            max_stream_bytes=settings.DS_MAX_STREAM_BYTES,
            lock_wait_ms=_lock_slice_ms(),
        )
        return results, None
    except Exception as exc:  # noqa: BLE001 - each request gets its own verdict
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return None, None
        unreachable = exc if isinstance(exc, ServiceUnavailable) else None
        return await _after_failure(path, requests, exc), unreachable


def _requeue(path: str, batch: list[Pending], *, contended: bool) -> None:
    """A batch written in no transaction: back to the head of its stream's queue. When the
    stream's lock was held, the stream is contended (written alone, in its own slot) and what
    has waited the lock timeout answers 503 (``_expire``)."""
    queue = _queues[path]
    queue.pending[:0] = batch
    if contended:
        queue.contended = True
        if len(_contended_lately) >= MAX_CONTENDED_LATELY:
            _contended_lately.clear()
        _contended_lately[path] = time.monotonic()
        _expire(path)


def _expire(path: str) -> None:
    """Answer 503 to the appends of a contended stream waiting for their turn that have waited
    the lock timeout (nobody's input is at fault), and set a timer for the next: probe 10i saw
    appends answered 25-49 s after a 15 s lock timeout, their batches waiting for the slot of
    contended streams."""
    queue = _queues.get(path)
    if queue is None or not queue.contended:
        return
    if queue.expiry is not None:
        queue.expiry.cancel()
        queue.expiry = None
    timeout = settings.DS_DB_LOCK_TIMEOUT_MS / 1000
    if timeout <= 0:  # no lock timeout: they wait for as long as the lock lasts
        return
    now = time.monotonic()
    late = 0  # the queue is in the order the appends came: the late ones lead it
    while late < len(queue.pending) and queue.pending[late][0].queued_at + timeout <= now:
        late += 1
    if late:
        expired, queue.pending = queue.pending[:late], queue.pending[late:]
        busy = ServiceUnavailable("the store is busy; retry later")
        logger.warning("appends to %r: a lock they need was held past the lock timeout", path)
        _conclude(path, expired, [busy] * len(expired), None)
    if queue.pending:
        due = queue.pending[0][0].queued_at + timeout
        queue.expiry = asyncio.get_running_loop().call_later(due - now, _expire, path)
    elif not queue.running:
        _contended_ready.pop(path, None)
        _forget(path, queue)


def _conclude(
    path: str, batch: list[Pending], results: list[Result], unreachable: ServiceUnavailable | None
) -> None:
    requests = [request for request, _ in batch]
    for listener in _listeners:
        try:
            listener(requests, results)
        except Exception:  # a listener's failure must not fail acknowledged appends
            logger.exception("commit listener failed")
    _count(requests, results)
    for (_, future), result in zip(batch, results, strict=True):
        _settle(future, result)
    if unreachable is not None:
        # The database is unreachable: what waits behind this batch would wait for a
        # connection as long again, to the same answer.
        queue = _queues[path]
        for _, future in queue.pending:
            _settle(future, unreachable)
        queue.pending.clear()


def _count(requests: list[AppendRequest], results: list[Result]) -> None:
    stored = 0
    for request, result in zip(requests, results, strict=True):
        if isinstance(result, ProtocolError):
            metrics.APPENDS.labels(result.code.lower()).inc()
        elif result.duplicate:
            metrics.APPENDS.labels("duplicate").inc()
        else:
            metrics.APPENDS.labels("appended").inc()
            stored += request.size
    if stored:
        metrics.APPEND_BYTES.inc(stored)


def _settle(future: asyncio.Future[AppendResult], result: Result) -> None:
    if future.done():
        return
    if isinstance(result, ProtocolError):
        future.set_exception(result)
    else:
        future.set_result(result)


async def _after_failure(path: str, requests: list[AppendRequest], exc: Exception) -> list[Result]:
    """The verdicts of a batch whose statement failed. A batch is one transaction, so nothing
    of it was stored. When the database was unreachable, every request answers that (503).
    Otherwise some request's input made the statement fail, an error nobody anticipated: each
    request is written again alone, so that only the request at fault fails and one bad
    request never takes the others down with it."""
    if isinstance(exc, ProtocolError):
        return [exc] * len(requests)
    refusal = refusal_for(exc)
    if isinstance(refusal, ServiceUnavailable):
        # A statement timeout, conflicts past their retries, or a lock timeout (of the
        # requests written alone below): nobody's input is at fault, and each request alone
        # would wait as long again (probe 10e: eight appends to a stream whose row was held
        # answered after 60 s, four lock timeouts, each).
        logger.warning("appends to %r: %s (%s)", path, refusal.message, str(exc).strip()[:200])
        return [refusal] * len(requests)
    if len(requests) == 1:
        if refusal is None:
            logger.error("append to %r failed", path, exc_info=exc)
            refusal = ProtocolError("internal server error")
        else:
            logger.warning("append to %r refused by the store: %s", path, str(exc).strip()[:200])
        return [refusal]
    results: list[Result] = []
    for request in requests:
        try:
            results.extend(
                await append_batch(path, [request], max_stream_bytes=settings.DS_MAX_STREAM_BYTES)
            )
        except Exception as alone:  # noqa: BLE001 - judged alone, failing alone
            results.extend(await _after_failure(path, [request], alone))
    return results
