"""The schema of the base protocol.

The models own the schema (migrations), the admin reads through them; protocol data is written
only by the SQL in ``streams/store/`` (DESIGN.md: one schema, two access paths).

Offsets are ``{seq:016d}_{pos:016d}``: the number of messages and of bytes before a position
(``streams.protocol.offsets``). A stream's tail is ``(next_seq, next_pos)``.
"""

from __future__ import annotations

from django.db import models
from django.db.models.expressions import RawSQL


class StreamQuerySet(models.QuerySet["Stream"]):
    def with_expired(self) -> StreamQuerySet:
        """Annotate ``expired``: the rule the SQL write path applies (``ds_is_expired``)."""
        return self.annotate(expired=RawSQL("ds_is_expired(ds_stream.*)", []))


class Stream(models.Model):
    """One durable stream. ``path`` is unique among streams that still hold a row: a soft-deleted
    stream keeps its path blocked until its last fork is gone (PROTOCOL.md 4.2)."""

    id = models.BigAutoField(primary_key=True)
    path = models.TextField(unique=True)
    content_type = models.TextField()
    created_at = models.DateTimeField()
    # Sliding TTL (PROTOCOL.md 5.1): expires `ttl_seconds` after `accessed_at`.
    accessed_at = models.DateTimeField()
    ttl_seconds = models.BigIntegerField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    # Tail: messages and bytes written so far (fork: including the inherited prefix).
    next_seq = models.BigIntegerField(default=0)
    next_pos = models.BigIntegerField(default=0)
    closed = models.BooleanField(default=False)
    # The producer tuple whose append closed the stream, so its retry is a duplicate (5.2.1).
    closed_by_producer = models.TextField(null=True, blank=True)
    closed_by_epoch = models.BigIntegerField(null=True, blank=True)
    closed_by_seq = models.BigIntegerField(null=True, blank=True)
    # Last `Stream-Seq` accepted; scoped per stream (PROTOCOL.md 5.2).
    last_stream_seq = models.TextField(null=True, blank=True)
    # Fork: the source stream and the position this stream diverges at. Rows of the source chain
    # below `fork_seq` are read through; this stream's own rows start at `fork_seq`.
    fork_source = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="forks",
        db_index=True,
    )
    fork_seq = models.BigIntegerField(null=True, blank=True)
    fork_pos = models.BigIntegerField(null=True, blank=True)
    # Stream-Fork-Sub-Offset of the create: that much of the source past the anchor was copied
    # into this stream as its first append (bytes, or messages for JSON).
    fork_sub_offset = models.BigIntegerField(null=True, blank=True)
    # Number of forks whose source is this stream; a delete with forks is a soft delete.
    fork_refcount = models.IntegerField(default=0)
    deleted_at = models.DateTimeField(null=True, blank=True)
    # Who created it: "key:<key id>", "jwt:<subject>"... (access.grants.Principal.label).
    created_by = models.TextField(null=True, blank=True)

    objects = StreamQuerySet.as_manager()

    class Meta:
        db_table = "ds_stream"
        indexes = [
            models.Index(
                fields=["expires_at"],
                name="ds_stream_expires_idx",
                condition=models.Q(expires_at__isnull=False),
            ),
            models.Index(
                fields=["accessed_at"],
                name="ds_stream_ttl_idx",
                condition=models.Q(ttl_seconds__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return self.path

    @property
    def is_fork(self) -> bool:
        return self.fork_source_id is not None

    @property
    def own_message_count(self) -> int:
        """Messages stored under this stream's own id (a fork's start at ``fork_seq``)."""
        return self.next_seq - (self.fork_seq or 0)

    def segments(self) -> list[tuple[int, int, int]]:
        """(stream id, first seq, end seq) of the message rows that make up this stream,
        oldest first: a fork reads its source chain below its fork point."""
        segments: list[tuple[int, int, int]] = []
        current: Stream | None = self
        upper = self.next_seq
        while current is not None:
            lower = current.fork_seq or 0
            if lower < upper:
                segments.append((current.pk, lower, upper))
            upper = min(upper, lower)
            current = current.fork_source
        return list(reversed(segments))


class Message(models.Model):
    """One stored message: one append of a byte or text stream, or one flattened element of a
    JSON stream (stored compact, so a JSON read is the rows joined with commas inside brackets).
    """

    pk = models.CompositePrimaryKey("stream_id", "seq")
    # Rows are removed by the SQL write path (ds_remove), not by a database cascade; the
    # primary key already indexes stream_id.
    stream = models.ForeignKey(
        Stream, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False
    )
    seq = models.BigIntegerField()
    # Byte position of the message's first byte; `pos + length(data)` is the next position.
    pos = models.BigIntegerField()
    data = models.BinaryField()
    # True on the last message of an append: JSON fork sub-offsets may not cross it.
    batch_end = models.BooleanField(default=True)

    class Meta:
        db_table = "ds_message"

    def __str__(self) -> str:
        return f"{self.stream_id}#{self.seq}"


class Producer(models.Model):
    """The idempotent-producer ledger (PROTOCOL.md 5.2.1): per stream and producer id, the
    current epoch and the last accepted sequence number. Kept as long as the stream exists."""

    pk = models.CompositePrimaryKey("stream_id", "producer_id")
    # Rows are removed by the SQL write path (ds_remove), not by a database cascade; the
    # primary key already indexes stream_id.
    stream = models.ForeignKey(
        Stream, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False
    )
    producer_id = models.TextField()
    epoch = models.BigIntegerField()
    last_seq = models.BigIntegerField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "ds_producer"

    def __str__(self) -> str:
        return f"{self.producer_id}@{self.stream_id}"
