"""The hints Yjs compaction keeps per document (``yjs.compaction``) are bounded."""

from __future__ import annotations

import pytest

from streams.protocol.offsets import Offset
from yjs import compaction


def test_the_hints_of_documents_appended_to_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe 9a: a document's tail was kept, in every process, for every document ever
    appended to, deleted ones included (300 created, appended to and deleted: 300 kept)."""
    monkeypatch.setattr(compaction, "MAX_TRACKED", 50)
    monkeypatch.setattr(compaction, "_tails", {})
    monkeypatch.setattr(compaction, "_covered", {})
    for stream_id in range(1, 301):
        compaction.after_append(stream_id, Offset(1, 100))  # far below the threshold
        assert len(compaction._tails) <= 50
    assert compaction._tails[300] == 100
