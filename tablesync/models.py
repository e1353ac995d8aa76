"""Table sync: tables published to streams, and streams sunk into tables.

* ``TablePublication``: a PostgreSQL table whose committed changes are appended to a JSON stream
  as State Protocol change events, by triggers on the table (``sql/tablesync.sql``), in the
  transaction that makes them.
* ``StreamSink``: a JSON stream whose messages become rows of a table, applied in stream order
  by the server processes (``tablesync.runner``) with the position reached (``applied_seq``)
  committed together with the rows, so every message lands exactly once.
* ``SinkError``: a message a sink could not apply (it does not fit the mapping or the table's
  constraints), recorded with its offset; the sink goes on with the next one.

The rows are written through the services (``tablesync.publish``, ``tablesync.sinks``) and by
the SQL functions; the admin and the commands are entry points to the services.
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models.functions import Now

from streams.models import Stream
from streams.protocol.offsets import Offset


class TablePublication(models.Model):
    """A table whose every committed insert, update and delete (and truncate) is appended to
    ``stream`` as a change event of ``entity_type``, keyed by the primary key."""

    id = models.BigAutoField(primary_key=True)
    # The table's oid (regclass): survives renames; the triggers carry this row's id.
    table_oid = models.BigIntegerField(unique=True)
    # The table's name as PostgreSQL quotes it (``regclass::text``) when it was published.
    table_name = models.TextField()
    # One table per stream: the stream is the table's history (docs/gaps.md).
    stream = models.OneToOneField(
        Stream, on_delete=models.DO_NOTHING, db_constraint=False, related_name="publication"
    )
    entity_type = models.TextField()
    # The primary key's columns, in key order: the change events' `key`.
    key_columns = ArrayField(models.TextField())
    # Columns in the events' `value`; None: every column (also those added later).
    columns = ArrayField(models.TextField(), null=True, blank=True)
    # DS_LIMITS__MAX_STREAM_BYTES when published: triggers run in any session, without the
    # server's settings, and append through the same limit check as clients.
    max_stream_bytes = models.BigIntegerField()
    snapshot_rows = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.TextField(blank=True, default="")

    class Meta:
        db_table = "ds_table_publication"
        verbose_name = "table publication"

    def __str__(self) -> str:
        return f"{self.table_name} -> {self.stream_id}"


class SinkMode(models.TextChoices):
    # Every message is a new row.
    APPEND = "append", "append: one row per message"
    # State Protocol change events upsert and delete rows by key; a reset empties the table.
    UPSERT = "upsert", "upsert: State Protocol events by key"


class SinkState(models.TextChoices):
    ACTIVE = "active", "active"
    PAUSED = "paused", "paused"
    # The stream was deleted (or expired): nothing more will come.
    STREAM_GONE = "stream_gone", "stream gone"


class StreamSink(models.Model):
    """A JSON stream applied to a table through a column mapping, in stream order, exactly
    once: ``applied_seq`` advances in the transaction that writes the rows."""

    id = models.BigAutoField(primary_key=True)
    stream = models.ForeignKey(
        Stream, on_delete=models.DO_NOTHING, db_constraint=False, related_name="sinks"
    )
    # Kept for display once the stream is gone.
    stream_path = models.TextField()
    table_oid = models.BigIntegerField()
    table_name = models.TextField()
    mode = models.TextField(choices=SinkMode.choices, default=SinkMode.APPEND)
    # [{"column": name, "path": [JSON keys], "type": "bigint"}], in column order.
    mapping = models.JSONField()
    # upsert: the column holding the event's key (unique), and the entity type to apply
    # (None: every type).
    key_column = models.TextField(null=True, blank=True)
    entity_type = models.TextField(null=True, blank=True)
    # The column receiving each message's offset (None: not stored in the table).
    offset_column = models.TextField(null=True, blank=True)
    state = models.TextField(choices=SinkState.choices, default=SinkState.ACTIVE)
    # Messages before this position are applied (or recorded as errors).
    applied_seq = models.BigIntegerField(default=0)
    applied_pos = models.BigIntegerField(default=0)
    applied_at = models.DateTimeField(null=True, blank=True)
    error_count = models.BigIntegerField(default=0)
    # The last failure of the sink itself (its table gone, a permission missing): the run is
    # retried; messages that do not fit are SinkErrors instead.
    last_error = models.TextField(blank=True, default="")
    last_error_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.TextField(blank=True, default="")

    class Meta:
        db_table = "ds_stream_sink"
        verbose_name = "stream sink"
        constraints = [
            models.UniqueConstraint(fields=["stream", "table_oid"], name="ds_stream_sink_unique")
        ]

    def __str__(self) -> str:
        return f"{self.stream_path} -> {self.table_name}"

    @property
    def applied_offset(self) -> str:
        return str(Offset(self.applied_seq, self.applied_pos))


class SinkError(models.Model):
    """A message a sink skipped: it does not fit the mapping or the table."""

    id = models.BigAutoField(primary_key=True)
    sink = models.ForeignKey(StreamSink, on_delete=models.CASCADE, related_name="errors")
    seq = models.BigIntegerField()
    message_offset = models.TextField()
    sqlstate = models.TextField()
    error = models.TextField()
    # The message, cut to a few kilobytes.
    message = models.TextField()
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "ds_sink_error"
        verbose_name = "sink error"
        indexes = [models.Index(fields=["sink", "seq"], name="ds_sink_error_seq")]

    def __str__(self) -> str:
        return f"{self.sink_id}@{self.message_offset}"
