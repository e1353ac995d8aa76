"""Each process's copy of the documents written to it, to check a POST against the whole
document before it is appended.

An update can merge on its own and still break the document it joins: Yrs refuses to
integrate an item whose parent turns out not to be a type, whichever of the two arrives
second. Clients apply what they read update by update (YJS-PROTOCOL.md 12.3 leaves the
validation to them), so such an update, once stored, would fail every client's initial sync:
one writer could spoil a document for every reader. So a document POST is applied, update by
update, to a pycrdt Doc holding the document as stored, and refused (400) if Yrs cannot
integrate it; only then is it appended.

* The Doc: built from the document's snapshot and the updates after it, kept by the process
  (at most ``YJS_CHECKED_DOCUMENTS`` documents, the least recently written dropped), and caught
  up from the stream before each check (one statement).
* Order across processes: the append carries, as the stream's validation version, the message
  count the checked Doc reflects. A trigger keeps a document stream's validation version equal
  to its message count (yjs migration 0003), and the store compares the two under the stream's
  row lock, so an append overtaken since its check is refused (``ValidationStale``), and the
  Doc, which holds the POST's updates by then, is caught up with what overtook it: Yrs refuses
  the same items in either order, so that is the check of the POST after them. Within a
  process, one POST per document is checked and appended at a time (one group-commit batch
  judges its requests against one version).
* Fairness across processes: a POST overtaken once waits for the document's turn (a
  transaction-scoped advisory lock), and POSTs that see the turn taken wait for it as well,
  so writers on several processes take turns instead of overtaking one another for ever. A
  document written by one process at a time never takes it.
* A Doc that a refused update or a failed append may have changed is dropped, and the next
  POST rebuilds it.
* A document whose stored updates cannot be integrated (stored before this check existed) is
  written without the check, as before; that is logged once per build.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from pycrdt import Doc

from streams.errors import BadRequest, NotFound, ValidationStale
from streams.store.pool import carried, connection
from streams.store.types import AppendResult
from yjs.framing import read_frames
from yjs.updates import UnmergeableUpdates, apply_updates

logger = logging.getLogger(__name__)

# Checks lost to appends of other processes in a row before the POST is answered 503 (the
# store's ValidationStale): each retry rebuilds the Doc, so this bounds a POST's work.
ATTEMPTS = 5
# Applying more bytes or updates than this at once runs in a worker thread.
INLINE_BYTES = 64 * 1024
INLINE_UPDATES = 4

_SNAPSHOT_SQL = (
    "SELECT s.seq, s.data FROM ds_stream AS st"
    " LEFT JOIN yjs_document AS d ON d.stream_id = st.id"
    " LEFT JOIN yjs_snapshot AS s ON s.id = d.snapshot_id"
    " WHERE st.path = %s AND st.deleted_at IS NULL"
)
# The stream's id and message count, and its updates from a message on, in one snapshot of
# the database: the rows are exactly the messages before that count.
# And whether the document's turn (``_turn``) is free: taken and released at once if it is.
_UPDATES_SQL = (
    "WITH turn AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(%s, hashtext(%s)) AS free)"
    " SELECT st.id, st.next_seq, m.data, turn.free FROM turn, ds_stream AS st"
    " LEFT JOIN ds_message AS m ON m.stream_id = st.id AND m.seq >= %s"
    " WHERE st.path = %s AND st.deleted_at IS NULL ORDER BY m.seq"
)
# Advisory locks are (class, key) pairs: this class is "a Yjs document's turn", the key the
# hash of its update stream's path (yjs.compaction's class is another).
LOCK_CLASS = 0x59_6A_74


@dataclass
class _Replica:
    stream_id: int
    # The stream's messages the Doc holds (its next_seq when last caught up).
    seq: int
    # None: the stored updates cannot be integrated, and POSTs are not checked.
    doc: Doc[Any] | None
    # The Doc also holds the updates of the POST being appended (checked, not yet stored).
    ahead: bool = False
    # Another process held the document's turn when it was last caught up.
    contended: bool = False


@dataclass
class _Document:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Coroutines holding or waiting for the lock: an entry in use is never dropped, or a
    # second entry (and lock) for the same document could check a POST beside it.
    users: int = 0
    replica: _Replica | None = None


_documents: OrderedDict[str, _Document] = OrderedDict()


async def append_checked(
    path: str,
    updates: list[bytes],
    size: int,
    append: Callable[[int], Awaitable[AppendResult]],
) -> AppendResult:
    """``append(version)`` once ``updates`` (``size`` bytes in all) integrate with the
    document of update stream ``path`` as stored: BadRequest when they do not, NotFound
    without the document, ValidationStale after ATTEMPTS checks overtaken by other
    processes' appends."""
    entry = _entry(path)
    entry.users += 1
    try:
        async with entry.lock:
            # Taken from the entry until the append is known to match it: a Doc being changed
            # (in a worker thread that outlives a cancelled POST, too) is never handed to
            # another POST.
            replica, entry.replica = entry.replica, None
            replica = await _caught_up(path, replica)
            if not replica.contended:
                try:
                    return await _append(entry, replica, updates, size, append)
                except ValidationStale:
                    pass
            async with _turn(path):
                for _ in range(ATTEMPTS):
                    replica = await _caught_up(path, replica)
                    try:
                        return await _append(entry, replica, updates, size, append)
                    except ValidationStale:
                        continue
            raise ValidationStale()
    finally:
        entry.users -= 1
        _trim()


async def _append(
    entry: _Document,
    replica: _Replica,
    updates: list[bytes],
    size: int,
    append: Callable[[int], Awaitable[AppendResult]],
) -> AppendResult:
    """Check ``updates`` against the caught-up ``replica`` (once: a Doc ahead of the stream
    holds them already), and append them at its version. ValidationStale when other
    processes appended since; catching up then applies their updates after these, which is
    the check of these after theirs: Yrs integrates an item once what it refers to is there,
    in either order, and refuses the same items in either."""
    if replica.doc is not None and not replica.ahead:
        await _off_loop(size, len(updates), _check, replica.doc, updates)
        replica.ahead = True
    result = await append(replica.seq)
    if not result.duplicate and result.stream_id == replica.stream_id:
        replica.seq = result.next_offset.seq
        replica.ahead = False
        entry.replica = replica
    return result


@asynccontextmanager
async def _turn(path: str) -> AsyncIterator[None]:
    """The document's turn among the processes writing it: a transaction holding its
    advisory lock (released when the transaction ends, however it ends). Processes that see
    it held wait for it too (``_Replica.contended``), so an overtaken POST is not overtaken
    again and again. At most TURNS_PER_PROCESS at once, each holding a pool connection."""
    global _turns
    if _turns is None:
        _turns = asyncio.Semaphore(max(1, settings.DS_DB_POOL_MAX_SIZE // 3))
    async with _turns, connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_CLASS, path))
        yield


_turns: asyncio.Semaphore | None = None


def _entry(path: str) -> _Document:
    entry = _documents.pop(path, None) or _Document()
    _documents[path] = entry  # the most recently used last
    return entry


def _trim() -> None:
    """Drop the least recently used documents nobody is using, down to the limit."""
    excess = len(_documents) - settings.YJS_CHECKED_DOCUMENTS
    if excess <= 0:
        return
    idle = [path for path, entry in _documents.items() if entry.users == 0][:excess]
    for path in idle:
        del _documents[path]


async def _caught_up(path: str, replica: _Replica | None) -> _Replica:
    """``replica`` with the updates stored since it was last caught up, or a new one built
    from the snapshot and the updates after it when there is none, or the document was
    deleted and created again. NotFound without the document; BadRequest when the stored
    updates do not join a Doc ahead of the stream (they and the POST's cannot both be)."""
    if replica is not None:
        stream_id, seq, rows, contended = await _updates(path, replica.seq)
        if stream_id == replica.stream_id:
            replica.contended = contended
            if replica.doc is not None and rows:
                size = sum(map(len, rows))
                doc = await _off_loop(size, len(rows), _integrated, replica.doc, None, rows)
                if doc is None and replica.ahead:
                    raise BadRequest("the updates cannot join the document as it now stands")
                if doc is None:
                    logger.warning("document %s: its stored updates cannot be integrated", path)
                replica.doc = doc
            replica.seq = seq
            return replica
    async with connection() as conn:
        cur = await conn.execute(_SNAPSHOT_SQL, (path,), binary=True)
        row = await cur.fetchone()
        if row is not None and row[1] is not None:
            carried(conn, len(row[1]))
    if row is None:
        raise NotFound("document does not exist")
    covers, snapshot = row
    stream_id, seq, rows, contended = await _updates(path, covers or 0)
    if snapshot is not None:
        snapshot = bytes(snapshot)
    size = sum(map(len, rows)) + len(snapshot or b"")
    doc = await _off_loop(size, len(rows) + 1, _integrated, Doc(), snapshot, rows)
    if doc is None:
        logger.warning("document %s: its stored updates cannot be integrated", path)
    return _Replica(stream_id, seq, doc, contended=contended)


async def _updates(path: str, start: int) -> tuple[int, int, list[bytes], bool]:
    """The stream's id and message count, the data of its messages from ``start`` on, and
    whether another process holds the document's turn."""
    async with connection() as conn:
        cur = await conn.execute(_UPDATES_SQL, (LOCK_CLASS, path, start, path), binary=True)
        found = await cur.fetchall()
        carried(conn, sum(len(row[2]) for row in found if row[2] is not None))
    if not found:
        raise NotFound("document does not exist")
    stream_id, seq, _, free = found[0]
    return stream_id, seq, [bytes(row[2]) for row in found if row[2] is not None], not free


def _integrated(doc: Doc[Any], snapshot: bytes | None, messages: list[bytes]) -> Doc[Any] | None:
    """``doc`` with a snapshot and stored messages (lib0-framed updates) applied, or None
    when they cannot be integrated."""
    updates = [snapshot] if snapshot is not None else []
    for message in messages:
        updates.extend(read_frames(message))
    try:
        apply_updates(doc, updates)
    except UnmergeableUpdates:
        return None
    return doc


def _check(doc: Doc[Any], updates: list[bytes]) -> None:
    try:
        apply_updates(doc, updates)
    except UnmergeableUpdates as exc:
        raise BadRequest(f"the updates cannot join the document ({exc})") from None


async def _off_loop(size: int, count: int, work: Callable[..., Any], *args: Any) -> Any:
    if size <= INLINE_BYTES and count <= INLINE_UPDATES:
        return work(*args)
    return await asyncio.to_thread(work, *args)
