"""Compaction: merging a document's snapshot and the updates since into a new snapshot
(YJS-PROTOCOL.md 8).

* Trigger: an append leaves more than ``YJS_COMPACTION_THRESHOLD_BYTES`` of updates since the
  last snapshot; the process that made the append schedules it (``after_append``).
* One at a time per document across every server process: a PostgreSQL advisory lock; a
  process that cannot take it leaves the work to the one that holds it.
* Off the event loop: the whole compaction (reads, the pycrdt merge, writes) runs in a worker
  thread on Django's own database connection.
* Crash-safe order: store the new snapshot and move the pointer in one transaction, then delete
  the old snapshot. At every point the pointer names a stored snapshot (or none), and the
  updates are never touched, so the document stays readable.
* Updates appended while compacting have offsets past the new snapshot's; readers continue
  from the snapshot's Stream-Next-Offset and see them.
* Updates pycrdt cannot merge: POSTs refuse the updates that cannot be merged on their own
  (yjs.updates.check_updates), but updates can also fail only together with the rest of the
  document. Such a failure is recorded on the document's row (error and time, shown in the
  admin) and logged once; automatic compaction then leaves the document alone, since the
  updates that break the merge stay in every later one (docs/gaps.md). The document stays
  readable and writable. ``compact_yjs --force`` and the admin retry; a success clears it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from streams import metrics
from streams.models import Message
from streams.protocol.offsets import Offset
from streams.store import pool as store_pool
from streams.store.failures import log_failure
from yjs.engine import EngineTimeout, EngineUnavailable, Refused, blocking_engine
from yjs.framing import read_frames
from yjs.models import YjsDocument, YjsSnapshot

logger = logging.getLogger(__name__)

# Advisory locks are (class, key) pairs; this class is "Yjs compaction", the key a stream id.
LOCK_CLASS = 0x59_6A_73  # "Yjs"


@dataclass(frozen=True)
class Compaction:
    document: str
    covers: Offset
    updates: int
    update_bytes: int
    snapshot_bytes: int
    seconds: float


@dataclass(frozen=True)
class CompactionFailure:
    """The document's updates cannot be merged (``error``, recorded at ``failed_at``).
    ``now``: this call tried and failed; otherwise an earlier failure, not retried."""

    document: str
    error: str
    failed_at: datetime
    now: bool


# Longest error text recorded on a document (pycrdt's messages are short; this bounds them).
MAX_ERROR_CHARS = 2000


def bytes_since_snapshot(document: YjsDocument) -> int:
    base = document.snapshot.pos if document.snapshot is not None else 0
    return document.stream.next_pos - base


def updates_since_snapshot(document: YjsDocument, end_seq: int | None = None) -> list[bytes]:
    """The document's content as updates: its snapshot, then every update stored after it
    (up to ``end_seq``)."""
    old = document.snapshot
    updates = [bytes(old.data)] if old is not None else []
    rows = Message.objects.filter(stream_id=document.pk, seq__gte=old.seq if old is not None else 0)
    if end_seq is not None:
        rows = rows.filter(seq__lt=end_seq)
    for data in rows.order_by("seq").values_list("data", flat=True).iterator(chunk_size=2000):
        updates.extend(read_frames(bytes(data)))
    return updates


def compact(stream_id: int, *, force: bool = False) -> Compaction | CompactionFailure | None:
    """Compact one document now if it is over the threshold (or ``force``); None when there
    was nothing to do or another process is compacting it. A CompactionFailure when its
    updates cannot be merged, now or (without ``force``, which retries) earlier."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_CLASS, stream_id])
        if not cursor.fetchone()[0]:
            return None
    try:
        return _compact_locked(stream_id, force)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_CLASS, stream_id])


def _compact_locked(stream_id: int, force: bool) -> Compaction | CompactionFailure | None:
    started = time.monotonic()
    document = (
        YjsDocument.objects.select_related("snapshot", "stream")
        .filter(pk=stream_id, stream__deleted_at__isnull=True)
        .first()
    )
    if document is None:
        return None
    if document.compaction_failed_at is not None and not force:
        return CompactionFailure(
            str(document), document.compaction_error, document.compaction_failed_at, now=False
        )
    old = document.snapshot
    base = old.covers if old is not None else Offset(0, 0)
    tail = Offset(document.stream.next_seq, document.stream.next_pos)
    pending = bytes_since_snapshot(document)
    if tail.seq == base.seq or (not force and pending <= settings.YJS_COMPACTION_THRESHOLD_BYTES):
        return None

    updates = updates_since_snapshot(document, end_seq=tail.seq)
    update_count = len(updates) - (1 if old is not None else 0)
    try:
        # In the engine's process: pycrdt holds Python's lock, for seconds on large documents.
        snapshot = blocking_engine().snapshot(updates)
    except Refused as exc:
        return _record_failure(document, tail, str(exc))

    with transaction.atomic():
        new = YjsSnapshot.objects.create(
            document_id=stream_id, seq=tail.seq, pos=tail.pos, data=snapshot
        )
        moved = YjsDocument.objects.filter(pk=stream_id, snapshot_id=document.snapshot_id).update(
            snapshot_id=new.pk,
            compactions=document.compactions + 1,
            compaction_error="",
            compaction_failed_at=None,
        )
        if not moved:  # the document was deleted (or re-pointed) meanwhile
            transaction.set_rollback(True)
            return None
    if old is not None:
        YjsSnapshot.objects.filter(pk=old.pk).delete()
    return Compaction(
        document=str(document),
        covers=tail,
        updates=update_count,
        update_bytes=pending,
        snapshot_bytes=len(snapshot),
        seconds=time.monotonic() - started,
    )


def _record_failure(document: YjsDocument, tail: Offset, error: str) -> CompactionFailure:
    """Record on the document's row that its updates (before ``tail``) cannot be merged, and
    log it: once, as automatic compaction does not try again."""
    error = error[:MAX_ERROR_CHARS]
    failed_at = timezone.now()
    YjsDocument.objects.filter(pk=document.pk).update(
        compaction_error=error, compaction_failed_at=failed_at
    )
    logger.error(
        "compaction of %s failed: its updates before %s cannot be merged (%s); it is not"
        " compacted automatically any more (compact_yjs --force retries)",
        document,
        tail,
        error,
    )
    return CompactionFailure(str(document), error, failed_at, now=True)


def compact_in_thread(stream_id: int) -> Compaction | CompactionFailure | None:
    """``compact`` for a worker thread: its database connection is closed afterwards."""
    try:
        return compact(stream_id)
    finally:
        connection.close()


# -- scheduling from the server (async) --------------------------------------------------------

# Position each document's snapshot covers, and its latest tail, as last seen here (hints:
# compaction re-checks in the database).
_covered: dict[int, int] = {}
_tails: dict[int, int] = {}
# Documents tracked at most: past it the hints start over (they were kept for every document
# ever appended to, deleted ones included: probe 9a).
MAX_TRACKED = 10_000
_running: set[int] = set()
_tasks: set[asyncio.Task[None]] = set()


def after_append(stream_id: int, tail: Offset) -> None:
    """Called after an append to a document commits: compact when over the threshold."""
    if stream_id not in _tails and len(_tails) >= MAX_TRACKED:
        _tails.clear()
        _covered.clear()
    _tails[stream_id] = max(tail.pos, _tails.get(stream_id, 0))
    _maybe_schedule(stream_id)


def _maybe_schedule(stream_id: int) -> None:
    since = _tails.get(stream_id, 0) - _covered.get(stream_id, 0)
    if since <= settings.YJS_COMPACTION_THRESHOLD_BYTES or stream_id in _running:
        return
    _running.add(stream_id)
    task = asyncio.get_running_loop().create_task(_compact_soon(stream_id))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def _gate() -> asyncio.Semaphore:
    """Compactions running at once in this process: one. Each takes one of Django's pooled
    connections (four by default) for as long as it runs, locks included: ten documents whose
    rows an operator held made the admin and the REST API answer 503 (probe 10l)."""
    return store_pool.loop_semaphore("yjs compactions", 1)


async def _compact_soon(stream_id: int) -> None:
    try:
        async with _gate():
            result = await asyncio.to_thread(compact_in_thread, stream_id)
        if isinstance(result, CompactionFailure):
            # Logged and recorded when it happened. Look again (a cheap read of that record,
            # unless someone has compacted it since) only after another threshold of updates.
            metrics.YJS_COMPACTIONS.labels("unmergeable").inc()
            _covered[stream_id] = _tails.get(stream_id, 0)
        elif result is not None:
            _count(result)
            _covered[stream_id] = result.covers.pos
            logger.info(
                "compacted %s: %d updates (%d bytes) -> %d bytes in %.3fs",
                result.document,
                result.updates,
                result.update_bytes,
                result.snapshot_bytes,
                result.seconds,
            )
        else:
            await _refresh_covered(stream_id)
            # Another process may be compacting it right now: look again in a moment, not in
            # a tight loop.
            await asyncio.sleep(0.25)
    except (EngineTimeout, EngineUnavailable) as exc:  # not the updates' fault: no record
        metrics.YJS_COMPACTIONS.labels("error").inc()
        logger.warning("compaction of document %s put off: merging %s", stream_id, exc)
        _covered[stream_id] = _tails.get(stream_id, 0)  # wait for new updates before retrying
    except Exception as exc:  # noqa: BLE001 - logged; retried at the next threshold (8.4)
        metrics.YJS_COMPACTIONS.labels("error").inc()
        log_failure(logger, f"compaction of document {stream_id}", exc)
        _covered[stream_id] = _tails.get(stream_id, 0)  # wait for new updates before retrying
    finally:
        _running.discard(stream_id)
    # Appends that crossed the threshold again while this ran were not scheduled: look now.
    _maybe_schedule(stream_id)


def _count(result: Compaction) -> None:
    metrics.YJS_COMPACTIONS.labels("compacted").inc()
    metrics.YJS_COMPACTION_SECONDS.observe(result.seconds)
    metrics.YJS_COMPACTION_BYTES.labels("updates").inc(result.update_bytes)
    metrics.YJS_COMPACTION_BYTES.labels("snapshot").inc(result.snapshot_bytes)


async def _refresh_covered(stream_id: int) -> None:
    """Nothing was compacted here (another process did it, or it was not needed): learn the
    current snapshot position so the next appends are judged against it. Without a document
    row (deleted since the append, or a create interrupted before its row) the document is
    forgotten: otherwise its recorded tail stays past the threshold and it is rescheduled
    forever. An append after the next PUT records it again."""
    async with store_pool.connection() as conn:
        cur = await conn.execute(
            "SELECT s.pos FROM yjs_document AS d"
            " LEFT JOIN yjs_snapshot AS s ON s.id = d.snapshot_id WHERE d.stream_id = %s",
            (stream_id,),
        )
        row = await cur.fetchone()
    if row is None:
        _tails.pop(stream_id, None)
        _covered.pop(stream_id, None)
    else:
        _covered[stream_id] = row[0] or 0
