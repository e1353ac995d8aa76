"""Django admin for Yjs documents: size since the last snapshot, the snapshot, a preview of the
content, compaction failures, and compaction on demand."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from streams.admin import ReadOnlyAdmin, bounded_filter
from yjs.compaction import (
    Compaction,
    CompactionFailure,
    bytes_since_snapshot,
    compact,
    updates_since_snapshot,
)
from yjs.engine import EngineTimeout, EngineUnavailable, Refused, blocking_engine
from yjs.models import YjsDocument
from yjs.paths import snapshot_key


class CompactionFailedFilter(admin.SimpleListFilter):
    title = "compaction"
    parameter_name = "compaction"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("failed", "Failed"), ("ok", "Not failed")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[YjsDocument]
    ) -> QuerySet[YjsDocument]:
        match self.value():
            case "failed":
                return queryset.filter(compaction_failed_at__isnull=False)
            case "ok":
                return queryset.filter(compaction_failed_at__isnull=True)
        return queryset


@admin.register(YjsDocument)
class YjsDocumentAdmin(ReadOnlyAdmin):
    list_display = ["path", "service", "since_snapshot", "snapshot_offset", "snapshot_time",
                    "compactions", "compaction_failed_at", "created_at"]  # fmt: skip
    list_filter = [bounded_filter("service"), CompactionFailedFilter]
    search_fields = ["path"]
    list_select_related = ["stream", "snapshot"]
    ordering = ["service", "path"]
    actions = ["compact_now"]
    fields = ["service", "path", "since_snapshot", "snapshot_offset", "snapshot_time",
              "compactions", "compaction_failed_at", "compaction_error", "created_at",
              "content"]  # fmt: skip
    readonly_fields = fields  # type: ignore[assignment]  # a list of names, as fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[YjsDocument]:
        # The list shows the snapshot's position and time, not its bytes (which can be
        # megabytes per row); the detail page's preview loads them when it reads them.
        return super().get_queryset(request).defer("snapshot__data")

    def view_on_site(self, obj: YjsDocument) -> str:
        """The admin's "View on site" opens the document live in the console."""
        return reverse("console:yjs", args=[obj.service, obj.path])

    @admin.display(description="bytes since snapshot")
    def since_snapshot(self, obj: YjsDocument) -> int:
        return bytes_since_snapshot(obj)

    @admin.display(description="snapshot offset")
    def snapshot_offset(self, obj: YjsDocument) -> str:
        return snapshot_key(obj.snapshot.covers) if obj.snapshot else "-"

    @admin.display(description="snapshot taken")
    def snapshot_time(self, obj: YjsDocument) -> Any:
        return obj.snapshot.created_at if obj.snapshot else "-"

    @admin.display(description="content (snapshot + updates since)")
    def content(self, obj: YjsDocument) -> str:
        updates = updates_since_snapshot(obj)
        if not updates:
            return "(empty document)"
        try:  # in the engine's process: pycrdt holds Python's lock for seconds on large ones
            roots = blocking_engine().describe(updates)
        except Refused as exc:
            return format_html("<em>{}</em>", f"the updates cannot be merged: {exc}")
        except (EngineTimeout, EngineUnavailable) as exc:
            return format_html("<em>{}</em>", f"the content could not be read in time ({exc})")
        return format_html_join(
            "",
            '<h4 class="ds-preview-heading">{}</h4><pre class="ds-preview">{}</pre>',
            roots.items(),
        ) or format_html("<em>{}</em>", "no content")

    @admin.action(description="Compact now")
    def compact_now(self, request: HttpRequest, queryset: QuerySet[YjsDocument]) -> None:
        results = [compact(d.pk, force=True) for d in queryset]
        done = [r for r in results if isinstance(r, Compaction)]
        self.message_user(
            request,
            f"Compacted {len(done)} of {len(results)} documents.",
            messages.SUCCESS,
        )
        for failure in results:
            if isinstance(failure, CompactionFailure):
                self.message_user(
                    request,
                    f"Could not compact {failure.document}: its updates cannot be merged:"
                    f" {failure.error}",
                    messages.ERROR,
                )
