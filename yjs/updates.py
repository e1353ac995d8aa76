"""Yjs updates with pycrdt (Yrs): checking what clients write, and merging for snapshots."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from pycrdt import Doc, Snapshot, get_update, merge_updates

from streams.errors import BadRequest
from yjs.framing import read_frames, read_var_uint
from yjs.structure import InvalidStructure, check_structure

T = TypeVar("T")


class UnmergeableUpdates(Exception):
    """pycrdt cannot merge these updates into a snapshot; the message is its error."""


def _guarded(operation: Callable[[], T]) -> T:
    """Run pycrdt work on client bytes; whatever it raises on them is UnmergeableUpdates.

    Yrs reports some malformed input as errors (ValueError, RuntimeError), and some as Rust
    panics, which reach Python as ``PanicException``, a BaseException (not an Exception).
    MemoryError, KeyboardInterrupt and the like are not about the bytes and pass through."""
    try:
        return operation()
    except MemoryError:
        raise
    except Exception as exc:
        raise UnmergeableUpdates(f"{type(exc).__name__}: {exc}") from exc
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise UnmergeableUpdates(f"pycrdt panicked: {exc}") from exc


def check_updates(updates: list[bytes]) -> None:
    """BadRequest unless compaction can merge these updates (v1 encoding), judged with the
    operations compaction performs: each update is decoded by ``merge_updates`` and goes
    alone through ``snapshot_of``; several also go through it together (merged in chunks, as
    compaction merges them). An update may depend on others not seen here: that is fine,
    compaction keeps it pending.

    The cost is a small pycrdt document per update (tens of microseconds) plus what merging
    the bytes costs; callers bound the number of updates (MAX_UPDATES). Combinations with the
    rest of the document are not checked (that would cost a compaction per POST): compaction
    records a document they break (yjs.compaction).

    Before pycrdt sees them, their structure is checked (``yjs.structure``): Yrs decodes values
    nested deep enough to overflow the process's stack, and reads ids past 2^53 otherwise than
    JavaScript clients do."""
    for index, update in enumerate(updates):
        try:
            check_structure(update)
        except InvalidStructure as exc:
            raise BadRequest(f"update {index} is not a valid Yjs update ({exc})") from None
    for index, update in enumerate(updates):
        try:
            _guarded(partial(merge_updates, update))
            snapshot_of([update])
        except UnmergeableUpdates as exc:
            raise BadRequest(f"update {index} is not a valid Yjs update ({exc})") from None
    if len(updates) > 1:
        try:
            snapshot_of(updates)
        except UnmergeableUpdates as exc:
            raise BadRequest(f"the updates of this body do not merge together ({exc})") from None


# Checking or applying updates is CPU work (about 25 microseconds per update, plus merging the
# bytes): more bytes or updates than this at once are handled off the event loop (yjs.http
# checks such a body only once the document is known to exist; yjs.replicas).
INLINE_CHECK_BYTES = 64 * 1024
INLINE_CHECK_UPDATES = 4


# At most this many updates in one POST: checking them together costs time growing with their
# square for some shapes (updates of as many clients: 1,000 in 0.12 s, 4,000 in 1.6 s, a
# review's 100,000 past any deadline), so this bounds a body's check to a fraction of a second
# of the engine's process. Clients send far fewer (the provider's producer sends a few per
# batch, and its initial state as one).
MAX_UPDATES = 1_000


# Yrs merges a few dozen updates quickly, but merging thousands at once grows superlinearly in
# time and memory (31,000 small updates: 16 s and 3.8 GB); applying them one by one costs a
# transaction each (1.7 s). Merging chunks of this size, then applying the chunks: 0.07 s.
MERGE_CHUNK = 50


def snapshot_of(updates: list[bytes]) -> bytes:
    """One update holding all of ``updates`` (a previous snapshot first, then the updates
    since): the document's ``encodeStateAsUpdate``. UnmergeableUpdates when pycrdt cannot
    merge them (whatever it raised or panicked with).

    A Doc keeps waiting ("pending") what refers to something it has not seen yet: structs whose
    dependencies are missing, and deletions of items it does not have. ``encodeStateAsUpdate``
    leaves both out, so chunks with anything pending are merged back in (docs/decisions.md).
    Pending structs: what the Doc's state does not cover of a chunk has structs. Pending
    deletions: the chunk deletes something outside the Doc's own delete set.

    The snapshot is read back before it is returned: Yrs can write content it cannot decode
    (an update with an unknown content type decodes, and is re-encoded as unreadable JSON),
    and a snapshot that cannot be read would break every client's initial sync and every
    later compaction."""
    return _guarded(lambda: _read_back(_snapshot_of(updates)))


def _read_back(snapshot: bytes) -> bytes:
    """``snapshot`` after checking that the next compaction can take it as its first update:
    ``merge_updates`` decodes it, and a Doc applies it and encodes its state (what
    ``_snapshot_of`` does with it)."""
    merge_updates(snapshot)
    _snapshot_of([snapshot])
    return snapshot


def _snapshot_of(updates: list[bytes]) -> bytes:
    doc: Doc[Any] = Doc()
    chunks = _apply_in_chunks(doc, updates)
    state = doc.get_state()
    encoded = doc.get_update()
    # The Doc's own delete set, from its snapshot encoding (delete set, then state vector).
    # Not from ``get_update(encoded, state)``: the Doc's update can hold structs its state
    # vector does not cover (a client's structs after a gap in its clocks), and those would be
    # read as a delete set.
    deleted = _intervals(_delete_set(Snapshot.from_doc(doc).encode()))
    pending = []
    for chunk in chunks:
        rest = get_update(chunk, state)
        if rest[:1] != b"\x00" or not _covers(deleted, _delete_set(rest, 1)):
            pending.append(chunk)
    return merge_updates(encoded, *pending) if pending else encoded


def integrated(doc: Doc[Any], snapshot: bytes | None, messages: list[bytes]) -> bool:
    """Whether a snapshot and stored messages (lib0-framed updates) could be applied to
    ``doc`` (which may be partly changed when not)."""
    updates = [snapshot] if snapshot is not None else []
    for message in messages:
        updates.extend(read_frames(message))
    try:
        apply_updates(doc, updates)
    except UnmergeableUpdates:
        return False
    return True


def apply_updates(doc: Doc[Any], updates: list[bytes]) -> None:
    """Apply ``updates`` to ``doc`` as compaction does (merged in chunks; yields the document
    that applying them one by one, as clients do, yields). UnmergeableUpdates when Yrs cannot
    integrate them; ``doc`` may then be partly changed."""
    _guarded(partial(_apply_in_chunks, doc, updates))


def _apply_in_chunks(doc: Doc[Any], updates: list[bytes]) -> list[bytes]:
    """Apply ``updates`` to ``doc`` merged in chunks of MERGE_CHUNK; the chunks as applied.
    Yrs writes some merges it cannot decode (updates each readable, and applied one after
    another by every client, whose merge ends short of its own data): such a chunk is applied
    as its updates, one by one. Yrs decodes an update before it changes the document, so a
    chunk it cannot decode (ValueError) left ``doc`` as it was."""
    chunks: list[bytes] = []
    for i in range(0, len(updates), MERGE_CHUNK):
        part = updates[i : i + MERGE_CHUNK]
        if len(part) == 1:
            doc.apply_update(part[0])
            chunks.append(part[0])
            continue
        merged = merge_updates(*part)
        try:
            doc.apply_update(merged)
        except ValueError:
            for update in part:
                doc.apply_update(update)
            chunks.extend(part)
        else:
            chunks.append(merged)
    return chunks


DeleteSet = dict[int, list[tuple[int, int]]]  # client -> [(clock, length)]
Intervals = dict[int, tuple[list[int], list[int]]]  # client -> (starts, ends), disjoint, sorted


def _delete_set(data: bytes, index: int = 0) -> DeleteSet:
    """The v1 delete set starting at ``data[index]`` (in an update: after its structs; in a
    snapshot: first): per client: id, range count, (clock, length) pairs."""
    clients, index = read_var_uint(data, index)
    result: DeleteSet = {}
    for _ in range(clients):
        client, index = read_var_uint(data, index)
        count, index = read_var_uint(data, index)
        ranges = result.setdefault(client, [])
        for _ in range(count):
            clock, index = read_var_uint(data, index)
            length, index = read_var_uint(data, index)
            ranges.append((clock, length))
    return result


def _intervals(delete_set: DeleteSet) -> Intervals:
    """Each client's deleted ranges as sorted, disjoint [start, end) intervals (adjacent and
    overlapping ranges joined)."""
    result: Intervals = {}
    for client, ranges in delete_set.items():
        starts: list[int] = []
        ends: list[int] = []
        for clock, length in sorted(ranges):
            if length == 0:
                continue
            if starts and clock <= ends[-1]:
                ends[-1] = max(ends[-1], clock + length)
            else:
                starts.append(clock)
                ends.append(clock + length)
        result[client] = (starts, ends)
    return result


def _covers(outer: Intervals, inner: DeleteSet) -> bool:
    """Is every deleted range of ``inner`` inside the intervals of ``outer``? (A binary search
    per range: a document's delete set can have many thousands of ranges.)"""
    for client, ranges in inner.items():
        starts, ends = outer.get(client, ([], []))
        for clock, length in ranges:
            if length == 0:
                continue
            at = bisect_right(starts, clock) - 1
            if at < 0 or ends[at] < clock + length:
                return False
    return True
