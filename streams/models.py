"""The schema of the base protocol.

The models own the schema (migrations), the admin reads through them; protocol data is written
only by the SQL in ``streams/store/`` (DESIGN.md: one schema, two access paths).

Offsets are ``{seq:016d}_{pos:016d}``: the number of messages and of bytes before a position
(``streams.protocol.offsets``). A stream's tail is ``(next_seq, next_pos)``.
"""

from __future__ import annotations

from django.db import models
from django.db.models.expressions import RawSQL

from streams.protocol.offsets import Offset


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
    # Sliding TTL (PROTOCOL.md 5.1): expires `ttl_seconds` after `accessed_at`. Kept up to date
    # only for streams with a TTL (for others it stays the creation time): it is indexed, and
    # changing it at every append would rule out HOT updates of the row.
    accessed_at = models.DateTimeField()
    ttl_seconds = models.BigIntegerField(null=True, blank=True)
    # Until when some server process has a live reader of the stream: appends notify
    # (NOTIFY) only while it is in the future (streams.live: Watched streams).
    watched_until = models.DateTimeField(null=True, blank=True)
    # The version of the extra validation an append's data must have passed (NULL: none), set
    # by the app that validates (state/: a state stream's registration; yjs/: a document
    # stream's id and message count, kept by triggers, which its POSTs were checked against);
    # an append validated against another version is refused as `validation_stale` and
    # validated again.
    validation_version = models.BigIntegerField(null=True, blank=True)
    # Whether a subscription may follow the stream (subscriptions/sql): an append to a followed
    # stream looks up its subscriptions, and when it finds none sets this false, so the
    # appends after it skip the lookup; adding a subscription's link sets it again.
    followed = models.BooleanField(default=True, db_default=True)
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
    # Retention policy (docs/gaps.md, Retention): messages older than this many seconds, and
    # messages beyond the newest this many bytes, are trimmed by the retention sweep. NULL: the
    # server-wide default (DS_RETENTION__MAX_AGE_SECS / _MAX_BYTES), if any.
    retention_max_age = models.BigIntegerField(
        "retention: max age (seconds)", null=True, blank=True
    )
    retention_max_bytes = models.BigIntegerField("retention: max bytes", null=True, blank=True)
    # The earliest retained position (PROTOCOL.md 4, 5.6): rows below it are gone or about to
    # be purged; `offset=-1` starts here, and reads of earlier offsets answer 410 Gone.
    first_seq = models.BigIntegerField(default=0, db_default=0)
    first_pos = models.BigIntegerField(default=0, db_default=0)
    # State-stream compaction (state/compaction.py): below `compacted_seq` rows may have gaps
    # (events compacted away; reads continue at the next kept one); `compacted_bytes` were
    # removed there. An explicit offset below `resume_seq` (other than the start) answers 410:
    # a delete event after it was dropped, so a reader resuming there would miss it.
    compacted_seq = models.BigIntegerField(default=0, db_default=0)
    compacted_bytes = models.BigIntegerField(default=0, db_default=0)
    resume_seq = models.BigIntegerField(default=0, db_default=0)

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
            # Streams with a retention policy of their own, for the retention sweep.
            models.Index(
                fields=["id"],
                name="ds_stream_retention_idx",
                condition=models.Q(retention_max_age__isnull=False)
                | models.Q(retention_max_bytes__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return self.path

    @property
    def is_fork(self) -> bool:
        return self.fork_source_id is not None

    @property
    def own_message_count(self) -> int:
        """Messages stored under this stream's own id (a fork's start at ``fork_seq``), at
        most: trimming and compaction remove some (see ``retained_message_count``)."""
        return self.next_seq - max(self.fork_seq or 0, self.first_seq)

    @property
    def first_offset(self) -> Offset:
        return Offset(self.first_seq, self.first_pos)

    def segments(self) -> list[tuple[int, int, int]]:
        """(stream id, first seq, end seq) of the message rows that make up this stream,
        oldest first: a fork reads its source chain below its fork point."""
        segments: list[tuple[int, int, int]] = []
        current: Stream | None = self
        upper = self.next_seq
        while current is not None:
            # Nothing before the stream's start is retained (trimmed rows may linger until
            # they are purged).
            lower = max(current.fork_seq or 0, self.first_seq)
            if lower < upper:
                segments.append((current.pk, lower, upper))
            upper = min(upper, lower)
            current = current.fork_source if upper > self.first_seq else None
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


class StreamMark(models.Model):
    """A stream's tail at a moment: the retention sweep's time index (docs/decisions.md).
    Every message before ``(seq, pos)`` was appended before ``marked_at``, so age retention
    trims to the newest mark older than the maximum age, and compaction judges a delete's age
    the same way, without a timestamp on every message."""

    pk = models.CompositePrimaryKey("stream_id", "seq")
    stream = models.ForeignKey(
        Stream, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False
    )
    seq = models.BigIntegerField()
    pos = models.BigIntegerField()
    marked_at = models.DateTimeField()

    class Meta:
        db_table = "ds_stream_mark"

    def __str__(self) -> str:
        return f"{self.stream_id}@{self.seq} ({self.marked_at})"


class PurgePending(models.Model):
    """A stream with rows below its start (or below what its forks still read) that are not
    deleted yet: a timer row, claimed with ``FOR UPDATE SKIP LOCKED`` by whichever process
    gets there first, which deletes them in bounded batches and removes the row when done."""

    stream = models.OneToOneField(
        Stream, primary_key=True, on_delete=models.DO_NOTHING, db_constraint=False
    )
    # When a purger may take it: now when queued; a purger that takes it pushes this ahead by
    # its lease, so another process takes over only if it stops.
    due_at = models.DateTimeField()

    class Meta:
        db_table = "ds_purge_pending"

    def __str__(self) -> str:
        return f"purge {self.stream_id} from {self.due_at}"
