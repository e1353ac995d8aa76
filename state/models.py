"""State Protocol tables: registrations of state streams and their materialized entities.

Both are written by the server only: entities by the SQL materializer (``sql/state.sql``, in
the append's own transaction) and by the Python rebuild (``state.materializer``).
"""

from __future__ import annotations

from django.db import models

from streams.models import Stream
from streams.protocol.offsets import Offset


class StateStream(models.Model):
    """A JSON stream registered as a state stream, optionally with a JSON Schema per type."""

    stream = models.OneToOneField(
        Stream,
        primary_key=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="state",
    )
    # {"<entity type>": <JSON Schema of its values>}
    schemas = models.JSONField(default=dict, blank=True)
    # Changes whenever the registration does; appends validated under another version are
    # revalidated (streams.extensions).
    version = models.BigIntegerField()
    # Position up to which the entities reflect the stream.
    materialized_seq = models.BigIntegerField(default=0)
    materialized_pos = models.BigIntegerField(default=0)
    # Events skipped while rebuilding (stored before the registration, or by a bulk job).
    invalid_events = models.BigIntegerField(default=0)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    # Who registered it: "key:<key id>", "jwt:<subject>"... (access.grants.Principal.label).
    registered_by = models.TextField(null=True, blank=True)
    # Compaction (state/compaction.py): keep per (type, key) only its latest change event,
    # and drop deletes older than `tombstone_seconds` (NULL: DS_STATE__TOMBSTONE_SECS).
    compaction = models.BooleanField(default=False, db_default=False)
    tombstone_seconds = models.BigIntegerField("tombstone period (seconds)", null=True, blank=True)
    compacted_at = models.DateTimeField(null=True, blank=True)
    # Events removed by compaction so far.
    compacted_events = models.BigIntegerField(default=0, db_default=0)

    class Meta:
        db_table = "ds_state_stream"
        verbose_name = "state stream"

    def __str__(self) -> str:
        return self.stream.path

    @property
    def materialized_offset(self) -> str:
        return str(Offset(self.materialized_seq, self.materialized_pos))


class EntityState(models.Model):
    """The current value of one entity ``(type, key)`` of a state stream, and the offset of
    the event that set it."""

    id = models.BigAutoField(primary_key=True)
    stream = models.ForeignKey(
        Stream,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="entities",
    )
    entity_type = models.TextField(db_column="type")
    key = models.TextField()
    value = models.JSONField()
    # Offset of the event that set the value (`offset` is an SQL keyword, hence the column).
    offset = models.TextField(db_column="event_offset")

    class Meta:
        db_table = "ds_entity"
        verbose_name = "entity"
        verbose_name_plural = "entities"
        constraints = [
            models.UniqueConstraint(
                fields=["stream", "entity_type", "key"], name="ds_entity_identity"
            )
        ]

    def __str__(self) -> str:
        return f"{self.entity_type}/{self.key}"
