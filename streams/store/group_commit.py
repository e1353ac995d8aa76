"""Group commit of appends to one stream (DESIGN.md, Storage: "one round trip + group commit").

Appends to one stream are serialized by its row lock, and with durable commits each transaction
waits for its own WAL flush while holding that lock. So inside one process, while a stream has
a batch in flight, later appends to it queue; when the batch commits, everything queued goes
in the next batch: one lock, one transaction, one flush for all of them. Each request is still
judged on its own inside the batch (``ds_append``), and is acknowledged only after the commit.

Across processes nothing changes: batches from different processes queue on the row lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.conf import settings

from streams import metrics
from streams.errors import ProtocolError, ServiceUnavailable
from streams.store.failures import refusal_for
from streams.store.types import AppendRequest, AppendResult
from streams.store.writes import append_batch

logger = logging.getLogger(__name__)

# Bounds on one batch, so a burst cannot build one giant transaction.
MAX_BATCH_REQUESTS = 256
MAX_BATCH_BYTES = 8 * 1024 * 1024


@dataclass
class _StreamQueue:
    pending: list[tuple[AppendRequest, asyncio.Future[AppendResult]]] = field(default_factory=list)
    running: bool = False


CommitListener = Callable[[list[AppendRequest], list[AppendResult | ProtocolError]], None]

_queues: dict[str, _StreamQueue] = {}
# Told about every batch after it was written (the service layer wakes live readers): the store
# does not import live delivery.
_listeners: list[CommitListener] = []


def on_commit(listener: CommitListener) -> None:
    _listeners.append(listener)


# Running writer tasks, referenced so they are not garbage-collected mid-flight.
_writers: set[asyncio.Task[None]] = set()


async def append(request: AppendRequest) -> AppendResult:
    """Append through the stream's queue; returns after commit or raises the request's error."""
    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    future: asyncio.Future[AppendResult] = loop.create_future()
    # If the client leaves, nobody awaits the outcome: mark it retrieved to keep logs quiet.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    queue = _queues.get(request.path)
    if queue is None:
        queue = _queues[request.path] = _StreamQueue()
    queue.pending.append((request, future))
    if not queue.running:
        queue.running = True
        # The writer is a task of its own: a client that disconnects mid-append cancels only
        # its wait, never the transaction other requests share.
        writer = loop.create_task(_drain(request.path, queue))
        _writers.add(writer)
        writer.add_done_callback(_writers.discard)
    result = await asyncio.shield(future)
    metrics.APPEND_SECONDS.observe(time.perf_counter() - started)
    return result


def _take_batch(
    queue: _StreamQueue,
) -> list[tuple[AppendRequest, asyncio.Future[AppendResult]]]:
    size = 0
    count = 0
    for request, _ in queue.pending:
        if count and (count >= MAX_BATCH_REQUESTS or size + request.size > MAX_BATCH_BYTES):
            break
        size += request.size
        count += 1
    batch, queue.pending = queue.pending[:count], queue.pending[count:]
    return batch


async def _drain(path: str, queue: _StreamQueue) -> None:
    try:
        while queue.pending:
            batch = _take_batch(queue)
            requests = [request for request, _ in batch]
            unreachable = None
            try:
                results = await append_batch(
                    path, requests, max_stream_bytes=settings.DS_MAX_STREAM_BYTES
                )
            except Exception as exc:  # noqa: BLE001 - each request gets its own verdict
                if isinstance(exc, ServiceUnavailable):
                    unreachable = exc
                results = await _after_failure(path, requests, exc)
            for listener in _listeners:
                try:
                    listener(requests, results)
                except Exception:  # a listener's failure must not fail acknowledged appends
                    logger.exception("commit listener failed")
            _count(requests, results)
            for (_, future), result in zip(batch, results, strict=True):
                _settle(future, result)
            if unreachable is not None:
                # The database is unreachable: what waits behind this batch would wait for
                # a connection as long again, to the same answer.
                for _, future in queue.pending:
                    _settle(future, unreachable)
                queue.pending.clear()
    finally:
        queue.running = False
        if _queues.get(path) is queue and not queue.pending:
            del _queues[path]


def _count(requests: list[AppendRequest], results: list[AppendResult | ProtocolError]) -> None:
    metrics.BATCH_REQUESTS.observe(len(requests))
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


def _settle(future: asyncio.Future[AppendResult], result: AppendResult | ProtocolError) -> None:
    if future.done():
        return
    if isinstance(result, ProtocolError):
        future.set_exception(result)
    else:
        future.set_result(result)


async def _after_failure(
    path: str, requests: list[AppendRequest], exc: Exception
) -> list[AppendResult | ProtocolError]:
    """The verdicts of a batch whose statement failed. A batch is one transaction, so nothing
    of it was stored. When the database was unreachable, every request answers that (503).
    Otherwise some request's input made the statement fail, an error nobody anticipated: each
    request is written again alone, so that only the request at fault fails and one bad
    request never takes the others down with it."""
    if isinstance(exc, ProtocolError):
        return [exc] * len(requests)
    if len(requests) == 1:
        refusal = refusal_for(exc)
        if refusal is None:
            logger.error("append to %r failed", path, exc_info=exc)
            refusal = ProtocolError("internal server error")
        else:
            logger.warning("append to %r refused by the store: %s", path, str(exc).strip()[:200])
        return [refusal]
    results: list[AppendResult | ProtocolError] = []
    for request in requests:
        try:
            results.extend(
                await append_batch(path, [request], max_stream_bytes=settings.DS_MAX_STREAM_BYTES)
            )
        except Exception as alone:  # noqa: BLE001 - judged alone, failing alone
            results.extend(await _after_failure(path, [request], alone))
    return results
