"""Yjs updates with pycrdt (Yrs): checking what clients write, and merging for snapshots."""

from __future__ import annotations

from bisect import bisect_right

from pycrdt import Doc, Snapshot, get_update, merge_updates

from streams.errors import BadRequest
from yjs.framing import read_var_uint


def check_updates(updates: list[bytes]) -> None:
    """BadRequest unless every update decodes as a Yjs update (v1 encoding). An update may
    depend on others not seen here; only its encoding is checked."""
    for index, update in enumerate(updates):
        try:
            merge_updates(update)
        except ValueError:
            raise BadRequest(f"update {index} is not a valid Yjs update") from None


# Yrs merges a few dozen updates quickly, but merging thousands at once grows superlinearly in
# time and memory (31,000 small updates: 16 s and 3.8 GB); applying them one by one costs a
# transaction each (1.7 s). Merging chunks of this size, then applying the chunks: 0.07 s.
MERGE_CHUNK = 50


def snapshot_of(updates: list[bytes]) -> bytes:
    """One update holding all of ``updates`` (a previous snapshot first, then the updates
    since): the document's ``encodeStateAsUpdate``.

    A Doc keeps waiting ("pending") what refers to something it has not seen yet: structs whose
    dependencies are missing, and deletions of items it does not have. ``encodeStateAsUpdate``
    leaves both out, so chunks with anything pending are merged back in (docs/decisions.md).
    Pending structs: what the Doc's state does not cover of a chunk has structs. Pending
    deletions: the chunk deletes something outside the Doc's own delete set."""
    chunks = [
        merge_updates(*updates[i : i + MERGE_CHUNK]) if len(updates) - i > 1 else updates[i]
        for i in range(0, len(updates), MERGE_CHUNK)
    ]
    doc = Doc()
    for chunk in chunks:
        doc.apply_update(chunk)
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
