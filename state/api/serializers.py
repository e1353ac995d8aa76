from __future__ import annotations

from typing import Any

from rest_framework import serializers

from state.models import EntityState, StateStream
from streams.rest import StrictIntegerField


class RegistrationRequestSerializer(serializers.Serializer):
    stream = serializers.CharField(help_text="Path of a JSON stream, e.g. 'rooms/42'")
    schemas = serializers.DictField(
        child=serializers.JSONField(),
        required=False,
        default=dict,
        help_text="A JSON Schema per entity type, for the values of its changes",
    )
    compaction = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text="Compact the stream: keep per (type, key) only its latest change event",
    )
    tombstone_seconds = StrictIntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        max_value=100 * 365 * 24 * 3600,
        help_text="With compaction: how long deletes are kept (default DS_STATE__TOMBSTONE_SECS)",
    )


class StateStreamSerializer(serializers.ModelSerializer):
    stream = serializers.CharField(source="stream.path")
    materialized_offset = serializers.CharField(read_only=True)

    class Meta:
        model = StateStream
        fields = ["stream", "schemas", "materialized_offset", "invalid_events", "last_error",
                  "created_at", "compaction", "tombstone_seconds", "compacted_at",
                  "compacted_events"]  # fmt: skip


class EntitySerializer(serializers.ModelSerializer):
    type = serializers.CharField(source="entity_type")
    value = serializers.JSONField()

    class Meta:
        model = EntityState
        fields = ["type", "key", "value", "offset"]

    def to_representation(self, instance: EntityState) -> dict[str, Any]:
        return {
            "type": instance.entity_type,
            "key": instance.key,
            "value": instance.value,
            "offset": instance.offset,
        }
