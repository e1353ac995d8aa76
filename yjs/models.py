"""Yjs documents: their update stream (a regular stream under ``__ds/yjs/``) and snapshots."""

from __future__ import annotations

from django.db import models

from streams.models import Stream
from streams.protocol.offsets import Offset


class YjsDocument(models.Model):
    """A Yjs document: one update stream, and a pointer to its current snapshot."""

    stream = models.OneToOneField(
        Stream,
        primary_key=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="yjs_document",
    )
    service = models.TextField()
    path = models.TextField()
    # The snapshot that `offset=snapshot` redirects to; NULL until the first compaction.
    snapshot = models.ForeignKey(
        "YjsSnapshot",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    compactions = models.IntegerField(default=0)
    # The last compaction that could not merge the document's updates (pycrdt's error) and
    # when; empty/NULL when none. Automatic compaction leaves such a document alone (the
    # updates that break the merge stay in every later one); `compact_yjs --force` or the
    # admin's "Compact now" retry, and a success clears these.
    compaction_error = models.TextField(blank=True, db_default="")
    compaction_failed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "yjs_document"
        verbose_name = "Yjs document"
        constraints = [
            models.UniqueConstraint(fields=["service", "path"], name="yjs_document_identity")
        ]

    def __str__(self) -> str:
        return f"{self.service}/{self.path}"


class YjsSnapshot(models.Model):
    """``encodeStateAsUpdate`` of a document holding every update before (seq, pos)."""

    id = models.BigAutoField(primary_key=True)
    document = models.ForeignKey(
        YjsDocument,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="snapshots",
    )
    seq = models.BigIntegerField()
    pos = models.BigIntegerField()
    data = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "yjs_snapshot"
        constraints = [
            models.UniqueConstraint(fields=["document", "seq", "pos"], name="yjs_snapshot_position")
        ]

    def __str__(self) -> str:
        return str(self.covers)

    @property
    def covers(self) -> Offset:
        return Offset(self.seq, self.pos)
