"""Yjs updates with pycrdt (Yrs): checking what clients write, and merging for snapshots."""

from __future__ import annotations

from pycrdt import Doc, get_update, merge_updates

from streams.errors import BadRequest


def check_updates(updates: list[bytes]) -> None:
    """BadRequest unless every update decodes as a Yjs update (v1 encoding). An update may
    depend on others not seen here; only its encoding is checked."""
    for index, update in enumerate(updates):
        try:
            merge_updates(update)
        except ValueError:
            raise BadRequest(f"update {index} is not a valid Yjs update") from None


def snapshot_of(updates: list[bytes]) -> bytes:
    """One update holding all of ``updates`` (a previous snapshot first, then the updates
    since): the document's ``encodeStateAsUpdate``.

    Updates whose dependencies are missing stay pending in a Doc, and ``encodeStateAsUpdate``
    would drop them; in that case the merged updates are kept instead, which carry them along
    (docs/decisions.md). Whether anything is pending: the part of the merged updates the Doc's
    state does not cover has structs (its first varint, the number of clients, is not 0)."""
    merged = merge_updates(*updates) if len(updates) > 1 else updates[0]
    doc = Doc()
    doc.apply_update(merged)
    if get_update(merged, doc.get_state())[:1] == b"\x00":
        return doc.get_update()
    return merged
