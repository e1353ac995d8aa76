"""Django admin for state streams and their materialized entities (read-only: state is written
by the server only)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from state.models import EntityState, StateStream
from streams.admin import ReadOnlyAdmin


def _pretty(value: Any) -> str:
    return format_html(
        '<pre class="ds-preview">{}</pre>',
        json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True),
    )


@admin.register(StateStream)
class StateStreamAdmin(ReadOnlyAdmin):
    list_display = ["stream", "schema_types", "materialized_offset", "invalid_events", "created_at"]
    search_fields = ["stream__path"]
    ordering = ["stream__path"]
    list_select_related = ["stream"]
    fields = [
        "stream",
        "schemas_pretty",
        "materialized_offset",
        "invalid_events",
        "last_error",
        "created_at",
        "entities_link",
    ]
    readonly_fields = fields  # type: ignore[assignment]  # a list of names, as fields

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
            return queryset.filter(stream_id=int(self.value() or 0))
        return queryset


class EntityTypeFilter(admin.SimpleListFilter):
    title = "type"
    parameter_name = "type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        entities = EntityState.objects.all()
        if request.GET.get("stream"):
            entities = entities.filter(stream_id=request.GET["stream"])
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
