"""Django admin for state streams and their materialized entities (read-only: state is written
by the server only), except a registration's compaction settings, which staff change, and
"Compact now" (state/compaction.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from state.compaction import compact
from state.models import EntityState, StateStream
from state.services import CompactionPolicy, stored_policy
from streams.admin import ReadOnlyAdmin
from streams.protocol.headers import MAX_TTL_SECONDS


def _pretty(value: Any) -> str:
    return format_html(
        '<pre class="ds-preview">{}</pre>',
        json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True),
    )


class CompactionForm(forms.ModelForm):
    """What staff change on a registration: whether the server compacts it, and how long
    compaction keeps deletes."""

    tombstone_seconds = forms.IntegerField(
        label="tombstone period (seconds)",
        required=False,
        min_value=0,
        max_value=MAX_TTL_SECONDS,
        help_text="How long compaction keeps deletes. Empty: DS_STATE__TOMBSTONE_SECS.",
    )

    class Meta:
        model = StateStream
        fields = ["compaction", "tombstone_seconds"]


REGISTRATION_FIELDS = [
    "stream",
    "schemas_pretty",
    "materialized_offset",
    "invalid_events",
    "last_error",
    "created_at",
    "entities_link",
    "compaction",
    "tombstone_seconds",
    "compacted_at",
    "compacted_events",
]


@admin.register(StateStream)
class StateStreamAdmin(ReadOnlyAdmin):
    list_display = [
        "stream",
        "schema_types",
        "materialized_offset",
        "invalid_events",
        "compaction",
        "compacted_at",
        "created_at",
    ]
    list_filter = ["compaction"]
    search_fields = ["stream__path"]
    ordering = ["stream__path"]
    list_select_related = ["stream"]
    form = CompactionForm
    fields = REGISTRATION_FIELDS  # type: ignore[assignment]  # a list of names, as fields
    readonly_fields = [
        f for f in REGISTRATION_FIELDS if f not in ("compaction", "tombstone_seconds")
    ]
    actions = ["compact_now"]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The compaction settings only (CompactionForm).
        return admin.ModelAdmin.has_change_permission(self, request, obj)

    def save_model(self, request: HttpRequest, obj: StateStream, form: Any, change: bool) -> None:
        # Those two columns alone: the materializer moves the others meanwhile.
        policy = stored_policy(CompactionPolicy(obj.compaction, obj.tombstone_seconds))
        StateStream.objects.filter(pk=obj.pk).update(
            compaction=policy.enabled, tombstone_seconds=policy.tombstone_seconds
        )

    @admin.action(description="Compact now (keep the latest event of each key)")
    def compact_now(self, request: HttpRequest, queryset: QuerySet[StateStream]) -> None:
        results = []
        for registration in queryset.select_related("stream"):
            result = asyncio.run(compact(registration.pk))
            if result is None:
                results.append(f"{registration.stream.path}: skipped")
            else:
                results.append(
                    f"{registration.stream.path}: {result.kept} events kept,"
                    f" {result.deleted} deleted"
                )
        self.message_user(request, "Compacted: " + "; ".join(results), messages.SUCCESS)

    def view_on_site(self, obj: StateStream) -> str:
        """The admin's "View on site" opens the entities live in the console."""
        return reverse("console:state", args=[obj.stream.path])

    @admin.display(description="schemas for")
    def schema_types(self, obj: StateStream) -> str:
        return ", ".join(sorted(obj.schemas)) or "-"

    @admin.display(description="schemas")
    def schemas_pretty(self, obj: StateStream) -> str:
        return _pretty(obj.schemas)

    @admin.display(description="entities")
    def entities_link(self, obj: StateStream) -> str:
        count = EntityState.objects.filter(stream_id=obj.pk).count()
        return format_html(
            '<a href="../../../entitystate/?stream={}">{} entities</a>', obj.pk, count
        )


class StateStreamFilter(admin.SimpleListFilter):
    """Only registered streams, not every stream in the database."""

    title = "stream"
    parameter_name = "stream"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        registrations = StateStream.objects.select_related("stream").order_by("stream__path")
        return [(str(r.pk), r.stream.path) for r in registrations[:200]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[EntityState]) -> QuerySet:
        if self.value():
            stream_id = _stream_id(self.value())
            if stream_id is None:  # the change list shows its "invalid filter" page
                raise IncorrectLookupParameters(f"not a stream id: {self.value()!r}")
            return queryset.filter(stream_id=stream_id)
        return queryset


def _stream_id(value: str | None) -> int | None:
    """A stream id from a query parameter; None when it is not one (a link edited by hand)."""
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 18:
        return None
    return int(value)


class EntityTypeFilter(admin.SimpleListFilter):
    title = "type"
    parameter_name = "type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        entities = EntityState.objects.all()
        stream_id = _stream_id(request.GET.get("stream"))
        if stream_id is not None:
            entities = entities.filter(stream_id=stream_id)
        types = entities.order_by("entity_type").values_list("entity_type", flat=True)
        return [(t, t) for t in types.distinct()[:200]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[EntityState]) -> QuerySet:
        if self.value():
            return queryset.filter(entity_type=self.value())
        return queryset


@admin.register(EntityState)
class EntityStateAdmin(ReadOnlyAdmin):
    list_display = ["key", "entity_type", "stream", "offset", "value_preview"]
    list_filter = [StateStreamFilter, EntityTypeFilter]
    search_fields = ["key"]
    list_select_related = ["stream"]
    ordering = ["stream_id", "entity_type", "key"]
    show_full_result_count = False
    fields = ["stream", "entity_type", "key", "offset", "value_pretty"]
    readonly_fields = fields  # type: ignore[assignment]  # a list of names, as fields

    @admin.display(description="value")
    def value_preview(self, obj: EntityState) -> str:
        text = json.dumps(obj.value, ensure_ascii=False)
        return text if len(text) <= 120 else text[:120] + " …"

    @admin.display(description="value")
    def value_pretty(self, obj: EntityState) -> str:
        return _pretty(obj.value)
