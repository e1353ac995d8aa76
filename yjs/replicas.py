"""Each process's copy of the documents written to it, to check a POST against the whole
document before it is appended.

An update can merge on its own and still break the document it joins: Yrs refuses to
integrate an item whose parent turns out not to be a type, whichever of the two arrives
second. Clients apply what they read update by update (YJS-PROTOCOL.md 12.3 leaves the
validation to them), so such an update, once stored, would fail every client's initial sync:
one writer could spoil a document for every reader. So a document POST is applied to a pycrdt
Doc holding the document as stored, and refused (400) if Yrs cannot integrate it; only then
is it appended.

* The Doc: built from the document's snapshot and the updates after it (at most
  ``YJS_CHECKED_DOCUMENTS`` documents, the least recently written dropped), and caught up from
  the stream before each check (one statement). pycrdt holds Python's lock for each call, for
  a time that grows with the bytes (seconds on large documents), so a document's Doc is kept
  by the process itself only while it and the POSTs checked against it are small
  (``YJS_INLINE_DOCUMENT_BYTES``, ``INLINE_CHECK_BYTES``: milliseconds at most); past that it
  is built again in the process's engine (``yjs.engine``: a child process, under a deadline).
  A check past the engine's deadline refuses the POST (400); building or catching up a copy
  past it, or an engine that died, answers 503.
* Within a process, one task per document checks and appends its POSTs: those queued while it
  works are checked in order and appended together, as one group-commit batch (the store
  judges a batch against one validation version, below).
* Order across processes: the appends carry, as the stream's validation version, the message
  count the checked Doc reflects. A trigger keeps a document stream's validation version equal
  to its message count (yjs migration 0003), and the store compares the two under the stream's
  row lock, so an append overtaken since its check is refused (``ValidationStale``), and the
  Doc, which holds the POST's updates by then, is caught up with what overtook it: Yrs refuses
  the same items in either order, so that is the check of the POST after them.
* Fairness across processes: POSTs overtaken once wait for the document's turn (a
  transaction-scoped advisory lock), and POSTs that see the turn taken wait for it as well,
  so writers on several processes take turns instead of overtaking one another for ever. A
  document written by one process at a time never takes it.
* A Doc that a refused update or a refused append may have changed is rebuilt.
* A document whose stored updates cannot be integrated (stored before this check existed) is
  written without the check, as before; a warning is logged when a process builds its copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from pycrdt import Doc

from streams import services
from streams.errors import BadRequest, NotFound, ProtocolError, ServiceUnavailable, ValidationStale
from streams.store.pool import carried, connection
from streams.store.types import AppendRequest, AppendResult
from yjs import engine
from yjs.engine import EngineTimeout, EngineUnavailable, Refused, Unknown
from yjs.updates import INLINE_CHECK_BYTES, UnmergeableUpdates, apply_updates, integrated

logger = logging.getLogger(__name__)

# A call of pycrdt on a Doc of this process's taking longer than this moves it to the engine.
INLINE_SLOW_SECS = 0.05
# Rounds of appends overtaken by other processes' before the POSTs left are answered 503
# (ValidationStale); from the second round on, the document's turn is held.
ATTEMPTS = 5
# At most this many POSTs of one document are checked and appended together.
MAX_TOGETHER = 64

_SNAPSHOT_SQL = (
    "SELECT st.id, s.seq, s.data FROM ds_stream AS st"
    " LEFT JOIN yjs_document AS d ON d.stream_id = st.id"
    " LEFT JOIN yjs_snapshot AS s ON s.id = d.snapshot_id"
    " WHERE st.path = %s AND st.deleted_at IS NULL"
)
# The stream's id and message count, and its updates from a message on, in one snapshot of
# the database: the rows are exactly the messages before that count. And whether the
# document's turn (``_turn``) is free: taken and released at once if it is.
_UPDATES_SQL = (
    "WITH turn AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(%s, hashtext(%s)) AS free)"
    " SELECT st.id, st.next_seq, m.data, turn.free FROM turn, ds_stream AS st"
    " LEFT JOIN ds_message AS m ON m.stream_id = st.id AND m.seq >= %s"
    " WHERE st.path = %s AND st.deleted_at IS NULL ORDER BY m.seq"
)
# Advisory locks are (class, key) pairs: this class is "a Yjs document's turn", the key the
# hash of its update stream's path (yjs.compaction's class is another).
LOCK_CLASS = 0x59_6A_74


def version_of(stream_id: int, seq: int) -> int:
    """A document stream's validation version: its id and message count, as the triggers of
    yjs migration 0003 write it (a document deleted and created again does not take appends
    checked against the old one)."""
    return ((stream_id & 0x7FFF_FFFF) << 32) | (seq & 0xFFFF_FFFF)


@dataclass
class _Replica:
    stream_id: int
    # The stream's messages the Doc holds (its next_seq when last caught up).
    seq: int
    # The Doc, here, or its key in the engine (yjs.engine); None: the stored updates cannot be
    # integrated, and POSTs are not checked.
    doc: Doc[Any] | int | None
    # The Doc also holds the updates of POSTs being appended (checked, not all stored yet).
    ahead: bool = False
    # Another process held the document's turn when it was last caught up.
    contended: bool = False
    # Bytes of updates the Doc holds (its snapshot's, the stored ones', the POSTs').
    size: int = 0
    # A call of pycrdt on this process's Doc took longer than INLINE_SLOW_SECS: Yrs' time grows
    # faster than the bytes for some shapes (20,000 concurrent inserts at one place: 400 KB,
    # 36 s to build; found by review), so such a Doc moves to the engine whatever its size.
    slow: bool = False

    def here(self) -> bool:
        """Is the Doc this process's own (not the engine's)?"""
        return isinstance(self.doc, Doc)


@dataclass
class _Post:
    request: AppendRequest
    updates: list[bytes]
    size: int
    future: asyncio.Future[AppendResult]


@dataclass
class _Document:
    queue: list[_Post] = field(default_factory=list)
    # The task checking and appending the queued POSTs, while there are any.
    server: asyncio.Task[None] | None = None
    # The Doc, while no task works on it (a Doc being changed is never handed to another).
    replica: _Replica | None = None

    def busy(self) -> bool:
        return bool(self.queue) or (self.server is not None and not self.server.done())


_documents: OrderedDict[str, _Document] = OrderedDict()


async def append_checked(
    path: str, request: AppendRequest, updates: list[bytes], size: int
) -> AppendResult:
    """Append ``request`` (a ``services.byte_append`` to the update stream ``path`` holding
    ``updates``, ``size`` bytes in all) once they integrate with the document as stored:
    BadRequest when they do not, NotFound without the document, ValidationStale after
    ATTEMPTS rounds overtaken by other processes' appends. The work is the document's task's:
    a caller that goes away leaves it done all the same."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[AppendResult] = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved if abandoned
    entry = _entry(path)
    entry.queue.append(_Post(request, updates, size, future))
    if entry.server is None or entry.server.done():
        entry.server = loop.create_task(_serve(path, entry))
    try:
        return await asyncio.shield(future)
    finally:
        _trim()


def _entry(path: str) -> _Document:
    entry = _documents.pop(path, None) or _Document()
    _documents[path] = entry  # the most recently used last
    return entry


def _trim() -> None:
    """Drop the least recently used documents no task works on, down to the limit (a busy
    one stays: a second entry for the same document would check POSTs beside it)."""
    excess = len(_documents) - settings.YJS_CHECKED_DOCUMENTS
    if excess <= 0:
        return
    for path in [path for path, entry in _documents.items() if not entry.busy()][:excess]:
        del _documents[path]


async def _serve(path: str, entry: _Document) -> None:
    """Check and append the document's queued POSTs, a round at a time, until none is left.
    Whatever fails a round is every one of its POSTs' answer; whatever stops the task (a
    defect, a shutdown) answers every POST still waiting: none waits for ever."""
    posts: list[_Post] = []
    error: ProtocolError = ServiceUnavailable("the server is shutting down; retry")
    try:
        while entry.queue:
            count = _fitting(entry.queue)
            posts, entry.queue = entry.queue[:count], entry.queue[count:]
            try:
                await _round(path, entry, posts)
            except Exception as exc:  # noqa: BLE001 - the POSTs of the round answer it
                answer = exc if isinstance(exc, ProtocolError) else _failed(path, exc)
                for post in posts:
                    _answer(post, answer)
    except Exception as exc:  # noqa: BLE001 - a defect here: answered below, and logged
        error = _failed(path, exc)
    finally:
        waiting, entry.queue = posts + entry.queue, []
        for post in waiting:
            if not post.future.done():
                _answer(post, error)


def _failed(path: str, exc: Exception) -> ProtocolError:
    """A defect's answer (500): logged here, since the POSTs' handlers see only this."""
    logger.error("checking the POSTs to %s failed", path, exc_info=exc)
    return ProtocolError("internal server error")


def _fitting(queue: list[_Post]) -> int:
    """How many of the queued POSTs (at least one) go in one round: at most MAX_TOGETHER, and
    no more than group commit writes in one batch (a batch split in two would find its
    second half stale, overtaken by its first)."""
    size = 0
    for count, post in enumerate(queue[:MAX_TOGETHER]):
        size += services.append_weight(post.request)
        if count and size > services.TOGETHER_MAX_WEIGHT:
            return count
    return min(len(queue), MAX_TOGETHER)


async def _round(path: str, entry: _Document, posts: list[_Post]) -> None:
    """Check ``posts`` in order against the document and append those that join it together,
    again for those another process overtook, until each has its answer."""
    replica, entry.replica = entry.replica, None
    pending = posts
    async with AsyncExitStack() as turn:
        taken = False
        for attempt in range(ATTEMPTS):
            if not taken and (attempt > 0 or (replica is not None and replica.contended)):
                taken = await _take_turn(turn, path)
            replica = await _caught_up(path, replica)
            if not taken and replica.contended and await _take_turn(turn, path):
                taken = True
                replica = await _caught_up(path, replica)
            if replica.doc is not None and not replica.ahead:
                replica, pending = await _checked(path, replica, pending)
                replica.ahead = bool(pending)  # a Doc rebuilt after refusals holds none
            if not pending:
                break
            for post in pending:
                post.request.validation_version = version_of(replica.stream_id, replica.seq)
            results = await services.append_together([post.request for post in pending])
            stale = []
            for post, result in zip(pending, results, strict=True):
                if isinstance(result, ValidationStale):
                    stale.append(post)
                else:
                    _answer(post, result)
            if any(_diverged(replica, result) for result in results):
                replica = None  # holds updates that were not stored: rebuilt, and checked again
            elif not stale:
                ends = [r.next_offset.seq for r in results if isinstance(r, AppendResult)]
                replica.seq, replica.ahead = max(ends), False
            pending = stale
            if not pending:
                break
        for post in pending:
            _answer(post, Overtaken())
    if not pending and replica is not None:
        if taken:  # caught up while this process held the turn, it saw the turn taken (by itself)
            replica.contended = False
        entry.replica = replica


class Overtaken(ServiceUnavailable):
    """Other processes kept writing the document between each check and its append."""

    def __init__(self) -> None:
        super().__init__("other writers kept changing the document meanwhile; retry")


def _answer(post: _Post, result: AppendResult | ProtocolError) -> None:
    if post.future.done():
        return
    if isinstance(result, ProtocolError):
        post.future.set_exception(result)
    else:
        post.future.set_result(result)


def _diverged(replica: _Replica, result: AppendResult | ProtocolError) -> bool:
    """Does the Doc now hold updates the stream does not (a refused append, a duplicate of an
    earlier one), or was the document deleted and created again meanwhile?"""
    if isinstance(result, ValidationStale):
        return False
    if isinstance(result, ProtocolError):
        return True
    return result.duplicate or result.stream_id != replica.stream_id


async def _checked(
    path: str, replica: _Replica, posts: list[_Post]
) -> tuple[_Replica, list[_Post]]:
    """The POSTs whose updates join the document, applied to its Doc in order; the others are
    answered 400 (as are those the engine could not check in time). A refused update may have
    changed the Doc in part: it is rebuilt and the POSTs checked again without it; so is a Doc
    the engine no longer has, and one of this process's that the POSTs would make too large
    (built in the engine)."""
    rebuilds = 0
    while replica.doc is not None:
        if replica.here() and not _small(replica, posts):
            replica = await _caught_up(path, None, in_engine=True)
            continue
        for post in posts:
            try:
                await _apply(path, replica, post)
            except (Refused, EngineTimeout) as exc:
                _answer(post, _refusal(exc))
                posts = [other for other in posts if other is not post]
            except Unknown:
                rebuilds += 1
                if rebuilds >= ATTEMPTS:  # dropped as soon as built: too many documents at once
                    raise ServiceUnavailable(
                        "too many documents are being written; retry"
                    ) from None
            except EngineUnavailable as exc:
                raise _unavailable(exc) from None
            else:
                continue
            replica = await _caught_up(path, None)
            break
        else:
            break
    return replica, posts


def _small(replica: _Replica, posts: list[_Post]) -> bool:
    """May these POSTs be checked against this process's own Doc?"""
    size = sum(post.size for post in posts)
    return (
        not replica.slow
        and all(post.size <= INLINE_CHECK_BYTES for post in posts)
        and replica.size + size <= settings.YJS_INLINE_DOCUMENT_BYTES
    )


@contextmanager
def _timed(replica: _Replica) -> Iterator[None]:
    """Marks ``replica`` slow when what runs within takes longer than INLINE_SLOW_SECS."""
    started = time.perf_counter()
    try:
        yield
    finally:
        if time.perf_counter() - started > INLINE_SLOW_SECS:
            replica.slow = True


async def _apply(path: str, replica: _Replica, post: _Post) -> None:
    """A POST's updates applied to the Doc; Refused when Yrs cannot integrate them."""
    if isinstance(replica.doc, int):
        await engine.run(engine.replicas_engine(), "apply", path, replica.doc, post.updates)
    elif replica.doc is not None:
        try:
            with _timed(replica):
                apply_updates(replica.doc, post.updates)
        except UnmergeableUpdates as exc:
            raise Refused(str(exc)) from None
    replica.size += post.size


def _refusal(exc: Refused | EngineTimeout) -> BadRequest:
    if isinstance(exc, EngineTimeout):
        return BadRequest(f"the updates could not be checked against the document within {exc} s")
    return BadRequest(f"the updates cannot join the document ({exc})")


def _unavailable(exc: Exception) -> ServiceUnavailable:
    logger.warning("Yjs engine: %s", exc)
    return ServiceUnavailable("Yjs checks are unavailable; retry")


async def _take_turn(stack: AsyncExitStack, path: str) -> bool:
    """Hold the document's turn until ``stack`` closes; False when this process takes no
    turns (a pool too small to lend a connection to a turn and others to its round)."""
    turns = _turns()
    if turns is None:
        return False
    await stack.enter_async_context(_turn(turns, path))
    return True


@asynccontextmanager
async def _turn(turns: asyncio.Semaphore, path: str) -> AsyncIterator[None]:
    """The document's turn among the processes writing it: a transaction holding its
    advisory lock (released when the transaction ends, however it ends)."""
    async with turns, connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_CLASS, path))
        yield


# The event loop's semaphore of turns: at most a third of the pool's connections are held by
# turns at once (a round needs others for its catch-up and its append).
_semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore | None] = {}


def _turns() -> asyncio.Semaphore | None:
    loop = asyncio.get_running_loop()
    if loop not in _semaphores:
        _semaphores.clear()  # one loop per process; another only in tests
        most = settings.DS_DB_POOL_MAX_SIZE // 3
        _semaphores[loop] = asyncio.Semaphore(most) if most else None
    return _semaphores[loop]


async def _caught_up(path: str, replica: _Replica | None, *, in_engine: bool = False) -> _Replica:
    """``replica`` with the updates stored since it was last caught up; or a new one, built
    from the snapshot and the updates after it, when there is none, when the document was
    deleted and created again, when the stored updates do not join a Doc ahead of the stream
    (they and a POST's cannot both be: the POSTs are checked again on the new one), or when a
    Doc of this process's grows too large for it (built in the engine, as when ``in_engine``).
    NotFound without the document."""
    if replica is not None:
        stream_id, seq, rows, contended = await _updates(path, replica.seq)
        if stream_id == replica.stream_id:
            replica.contended = contended
            if replica.doc is None or not rows:
                replica.seq = seq
                return replica
            extended = await _extended(path, replica, rows)
            if extended:
                replica.seq = seq
                return replica
            if extended is False and not replica.ahead:
                logger.warning("document %s: its stored updates cannot be integrated", path)
                replica.doc, replica.seq = None, seq
                return replica
    for _ in range(ATTEMPTS):
        async with connection() as conn:
            cur = await conn.execute(_SNAPSHOT_SQL, (path,), binary=True)
            row = await cur.fetchone()
            if row is not None and row[2] is not None:
                carried(conn, len(row[2]))
        if row is None:
            raise NotFound("document does not exist")
        snapshot_of, covers, snapshot = row
        stream_id, seq, rows, contended = await _updates(path, covers or 0)
        if stream_id == snapshot_of:
            break
    else:  # deleted and created again between the two statements, each time
        raise Overtaken()
    if snapshot is not None:
        snapshot = bytes(snapshot)
    size = len(snapshot or b"") + sum(map(len, rows))
    doc: Doc[Any] | int | None
    replica = _Replica(stream_id, seq, None, contended=contended, size=size)
    if not in_engine and size <= settings.YJS_INLINE_DOCUMENT_BYTES:
        doc = Doc()
        with _timed(replica):
            built = integrated(doc, snapshot, rows)
    else:
        doc = engine.new_key()
        built = bool(await _engine_work(path, "build", path, doc, snapshot, rows))
    if not built:
        logger.warning("document %s: its stored updates cannot be integrated", path)
        return replica
    replica.doc = doc
    return replica


async def _extended(path: str, replica: _Replica, rows: list[bytes]) -> bool | None:
    """Stored messages applied to the Doc: whether they could be integrated; None when it is
    to be built again (the engine no longer has it, or it grows too large for this process)."""
    size = sum(map(len, rows))
    if isinstance(replica.doc, int):
        extended = await _engine_work(path, "extend", path, replica.doc, rows)
    elif replica.doc is not None and replica.size + size <= settings.YJS_INLINE_DOCUMENT_BYTES:
        with _timed(replica):
            extended = integrated(replica.doc, None, rows)
    else:
        return None
    if extended:
        replica.size += size
    return extended


async def _engine_work(path: str, method: str, *args: Any) -> bool | None:
    """A copy built or caught up by the engine: whether the updates could be integrated; None
    when the engine no longer has it; 503 when it is unavailable. Past the engine's deadline
    the stored document itself is what takes so long: False, and its POSTs are written
    unchecked, as those of a document whose updates cannot be integrated (building it again
    for every POST answered each 503 and killed the engine each time, found by review)."""
    try:
        done: bool = await engine.run(engine.replicas_engine(), method, *args)
    except Unknown:
        return None
    except EngineTimeout as exc:
        logger.warning("document %s: no copy could be built within %s s", path, exc)
        return False
    except EngineUnavailable as exc:
        raise _unavailable(exc) from None
    return done


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
