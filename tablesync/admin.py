"""Django admin for table sync: publish and unpublish tables, bind, pause, resume and drop
sinks, and browse the messages sinks could not apply.

The add forms call the services (``tablesync.publish``, ``tablesync.sinks``), like the
commands: a refusal is shown on the form and changes nothing. Deleting a publication
unpublishes the table (its triggers go, the stream stays); deleting a sink drops it (the table
keeps its rows).
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from streams.admin import CheckedSelectionAdmin, ReadOnlyAdmin
from streams.errors import ProtocolError
from streams.models import Stream
from tablesync import publish, sinks
from tablesync.models import SinkError, SinkMode, SinkState, StreamSink, TablePublication

RECENT_ERRORS = 20


def _label(request: HttpRequest) -> str:
    return f"admin:{request.user.get_username()}"


class CreatedByServiceAdmin(CheckedSelectionAdmin):
    """An admin whose rows are made by a service called from the add form (``create_form``,
    showing ``create_fields``) and never edited: an existing row shows ``readonly_fields``."""

    create_form: type[forms.ModelForm]
    create_fields: list[str]

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False,
                 **kwargs: Any) -> Any:  # fmt: skip
        if obj is None:
            # A class per request: the service records who asked.
            form = self.create_form
            return type(form.__name__, (form,), {"created_by": _label(request)})
        return super().get_form(request, obj, change, **kwargs)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return list(self.create_fields if obj is None else self.readonly_fields)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return list(self.readonly_fields) if obj is not None else []

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        # The service made the row: the admin's object becomes it.
        created = self.created(form)
        obj.pk = created.pk
        obj.__dict__.update({k: v for k, v in created.__dict__.items() if k != "_state"})

    def created(self, form: Any) -> Any:
        raise NotImplementedError


class PublishForm(forms.ModelForm):
    table = forms.CharField(help_text="table, schema.table, or a Django model app_label.Model")
    stream_path = forms.CharField(label="stream", help_text="created when missing")
    entity_type_name = forms.CharField(
        label="entity type", required=False, help_text="default: the table's name"
    )
    column_list = forms.CharField(
        label="columns", required=False, help_text="comma-separated; default: every column"
    )
    snapshot = forms.BooleanField(
        required=False, initial=True, help_text="first append the current rows as inserts"
    )

    class Meta:
        model = TablePublication
        fields: list[str] = []

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        columns = data.get("column_list") or ""
        try:
            self.published = publish.publish_table(
                table=data["table"],
                stream=data["stream_path"],
                entity_type=data.get("entity_type_name") or None,
                columns=[c.strip() for c in columns.split(",")] if columns.strip() else None,
                snapshot=bool(data.get("snapshot")),
                created_by=getattr(self, "created_by", ""),
            )
        except ProtocolError as exc:
            raise ValidationError(exc.message) from None
        return data


@admin.register(TablePublication)
class TablePublicationAdmin(CreatedByServiceAdmin):
    list_display = ["table_name", "table_present", "stream_link", "entity_type", "key",
                    "published_columns", "snapshot_rows", "created_at", "created_by"]  # fmt: skip
    search_fields = ["table_name", "stream__path"]
    list_select_related = ["stream"]
    ordering = ["table_name"]
    actions = ["unpublish_and_close"]
    readonly_fields = ["table_name", "table_present", "stream_link", "entity_type", "key",
                       "published_columns", "max_stream_bytes", "snapshot_rows", "created_at",
                       "created_by"]  # fmt: skip

    create_form = PublishForm
    create_fields = ["table", "stream_path", "entity_type_name", "column_list", "snapshot"]

    def created(self, form: Any) -> TablePublication:
        return form.published.publication

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        messages.info(request, _published_message(form.published))

    def delete_model(self, request: HttpRequest, obj: TablePublication) -> None:
        publish.unpublish(obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[TablePublication]) -> None:
        for publication in queryset:
            publish.unpublish(publication)

    @admin.action(description="Unpublish, and close their streams")
    def unpublish_and_close(
        self, request: HttpRequest, queryset: QuerySet[TablePublication]
    ) -> None:
        for publication in queryset:
            publish.unpublish(publication, close_stream=True)
        self.message_user(request, f"Unpublished {len(queryset)} table(s); streams closed.")

    @admin.display(description="table exists", boolean=True)
    def table_present(self, obj: TablePublication) -> bool:
        return publish.table_exists(obj.table_oid)

    @admin.display(description="stream")
    def stream_link(self, obj: TablePublication) -> str:
        return _stream_link(obj.stream_id)

    @admin.display(description="key")
    def key(self, obj: TablePublication) -> str:
        return ", ".join(obj.key_columns)

    @admin.display(description="columns")
    def published_columns(self, obj: TablePublication) -> str:
        return ", ".join(obj.columns) if obj.columns else "all"


def _published_message(result: publish.Published) -> str:
    snapshot = (
        f", {result.snapshot_rows} rows in the snapshot" if result.snapshot_rows is not None else ""
    )
    return f"Publishing {result.publication.table_name}{snapshot}."


def _stream_link(stream_id: int) -> str:
    stream = Stream.objects.filter(pk=stream_id).only("path").first()
    if stream is None:
        return "(deleted)"
    url = reverse("admin:streams_stream_change", args=[stream_id])
    return format_html('<a href="{}">{}</a>', url, stream.path)


class SinkForm(forms.ModelForm):
    stream_path_field = forms.CharField(label="stream", help_text="a JSON stream")
    table = forms.CharField(help_text="table, schema.table, or a Django model app_label.Model")
    mapping_lines = forms.CharField(
        label="mapping",
        required=False,
        widget=forms.Textarea(attrs={"rows": 5, "cols": 60}),
        help_text="one per line: COLUMN[=FIELD][::TYPE], e.g. amount=order.total::numeric",
    )
    sink_mode = forms.ChoiceField(label="mode", choices=SinkMode.choices, initial=SinkMode.APPEND)
    key = forms.CharField(required=False, help_text="upsert: the key's column, COLUMN[::TYPE]")
    entity_type_name = forms.CharField(
        label="entity type", required=False, help_text="upsert: only events of this type"
    )
    offset_column_name = forms.CharField(
        label="offset column",
        required=False,
        initial=sinks.DEFAULT_OFFSET_COLUMN,
        help_text="text column receiving each message's offset; empty: none",
    )
    start = forms.CharField(initial="-1", help_text="-1 (the first message), now, or an offset")
    create_table = forms.BooleanField(required=False, help_text="create the table from the mapping")

    class Meta:
        model = StreamSink
        fields: list[str] = []

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        spec = sinks.SinkSpec(
            stream=data["stream_path_field"],
            table=data["table"],
            mapping=[line for line in data.get("mapping_lines", "").splitlines() if line.strip()],
            mode=data["sink_mode"],
            key=data.get("key") or None,
            entity_type=data.get("entity_type_name") or None,
            offset_column=data.get("offset_column_name") or None,
            start=data["start"],
            create_table=bool(data.get("create_table")),
            created_by=getattr(self, "created_by", ""),
        )
        try:
            self.sink = sinks.create_sink(spec)
        except ProtocolError as exc:
            raise ValidationError(exc.message) from None
        return data


@admin.register(StreamSink)
class StreamSinkAdmin(CreatedByServiceAdmin):
    list_display = ["id", "stream_path", "table_name", "mode", "state", "applied_offset",
                    "behind", "error_count", "failing"]  # fmt: skip
    list_filter = ["state", "mode"]
    search_fields = ["stream_path", "table_name"]
    ordering = ["id"]
    actions = ["pause", "resume"]
    readonly_fields = ["stream_path", "table_name", "mode", "mapping_display", "key_column",
                       "entity_type", "offset_column", "state", "applied_offset", "applied_at",
                       "behind", "error_count", "last_error", "last_error_at", "recent_errors",
                       "created_at", "created_by"]  # fmt: skip

    create_form = SinkForm
    create_fields = ["stream_path_field", "table", "mapping_lines", "sink_mode", "key",
                     "entity_type_name", "offset_column_name", "start", "create_table"]  # fmt: skip

    def created(self, form: Any) -> StreamSink:
        return form.sink

    def delete_model(self, request: HttpRequest, obj: StreamSink) -> None:
        sinks.drop_sink(obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[StreamSink]) -> None:
        for sink in queryset:
            sinks.drop_sink(sink)

    @admin.action(description="Pause the selected sinks")
    def pause(self, request: HttpRequest, queryset: QuerySet[StreamSink]) -> None:
        self._set_state(request, queryset, SinkState.PAUSED)

    @admin.action(description="Resume the selected sinks")
    def resume(self, request: HttpRequest, queryset: QuerySet[StreamSink]) -> None:
        self._set_state(request, queryset, SinkState.ACTIVE)

    def _set_state(
        self, request: HttpRequest, queryset: QuerySet[StreamSink], state: SinkState
    ) -> None:
        for sink in queryset:
            try:
                sinks.set_state(sink, state)
            except ProtocolError as exc:
                self.message_user(request, f"{sink}: {exc.message}", messages.WARNING)

    @admin.display(description="behind")
    def behind(self, obj: StreamSink) -> str:
        tail = Stream.objects.filter(pk=obj.stream_id).values_list("next_seq", flat=True).first()
        return "-" if tail is None else str(tail - obj.applied_seq)

    @admin.display(description="failing", boolean=True)
    def failing(self, obj: StreamSink) -> bool:
        return bool(obj.last_error)

    @admin.display(description="mapping")
    def mapping_display(self, obj: StreamSink) -> str:
        return format_html_join(
            "", "<div><code>{}</code> &larr; <code>{}</code> ({})</div>",
            ((m["column"], ".".join(m["path"]), m["type"]) for m in obj.mapping),
        )  # fmt: skip

    @admin.display(description="recent errors")
    def recent_errors(self, obj: StreamSink) -> str:
        errors = obj.errors.order_by("-seq")[:RECENT_ERRORS]
        if not errors:
            return "none"
        url = reverse("admin:tablesync_sinkerror_changelist") + f"?sink__id__exact={obj.pk}"
        rows = format_html_join(
            "", "<tr><td><code>{}</code></td><td>{}</td><td><code>{}</code></td></tr>",
            ((e.message_offset, e.error, e.message[:200]) for e in errors),
        )  # fmt: skip
        return format_html(
            '<table><tr><th>offset</th><th>error</th><th>message</th></tr>{}</table>'
            '<a href="{}">all {} errors</a>',
            rows, url, obj.error_count,
        )  # fmt: skip


@admin.register(SinkError)
class SinkErrorAdmin(ReadOnlyAdmin):
    list_display = ["message_offset", "sink", "sqlstate", "error", "message_preview", "created_at"]
    list_filter = ["sink"]
    search_fields = ["error", "message"]
    list_select_related = ["sink"]
    ordering = ["sink_id", "seq"]
    show_full_result_count = False
    fields = ["sink", "message_offset", "sqlstate", "error", "message", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # a list of names, as fields

    @admin.display(description="message")
    def message_preview(self, obj: SinkError) -> str:
        return obj.message if len(obj.message) <= 120 else obj.message[:120] + " …"
