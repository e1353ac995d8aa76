"""Unit tests of snapshot building (``yjs.updates``), no database or server."""

from __future__ import annotations

from typing import Any

import pytest
from pycrdt import Doc, get_state, merge_updates

from yjs.updates import snapshot_of

# Four updates (fuzzed): each decodes, and a Doc applies them one after another, but Yrs
# writes their merge short of its own data, and cannot decode it.
MERGE_BREAKS = [
    bytes.fromhex(update)
    for update in (
        "010103000401017402616200",
        "010103024403000661626162616200",
        "000103010202",
        "010103080203030300066162616261620103010202",
    )
]


def _replayed(updates: list[bytes]) -> Doc[Any]:
    doc: Doc[Any] = Doc()
    for update in updates:
        doc.apply_update(update)
    return doc


def test_a_chunk_whose_merge_yrs_cannot_decode_is_applied_update_by_update() -> None:
    """The compaction merges updates in chunks. A chunk whose merge cannot be decoded is
    applied update by update instead: the snapshot is the document every client rebuilds by
    applying the updates in order. (Before, the compaction of such a document failed.)"""
    with pytest.raises(ValueError):
        get_state(merge_updates(*MERGE_BREAKS))
    updates = MERGE_BREAKS * 3
    snapshot = _replayed([snapshot_of(updates)])
    replayed = _replayed(updates)
    assert snapshot.get_state() == replayed.get_state()
    assert snapshot.get_update() == replayed.get_update()
