"""Django admin for streams: browse streams, their messages and their producer ledger.

Protocol data is written only by the SQL write path, so the admin is read-only, except for
deleting streams, which goes through the same SQL function a client's DELETE does (so forks,
soft deletes and live readers behave exactly as over HTTP), and for a stream's retention
policy, which staff change on its page (written alone, by ``ds_set_retention``: a save of the
whole row would overwrite the tail that appends move meanwhile).
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import Q, QuerySet
from django.db.models.functions import Length
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join

from streams.models import Message, Producer, Stream, StreamQuerySet
from streams.preview import preview, stored_head
from streams.protocol.headers import MAX_SAFE_INTEGER, MAX_TTL_SECONDS, media_type
from streams.protocol.offsets import Offset

MESSAGES_PER_PAGE = 50


class _KnownCountPaginator(Paginator):
    """The stream row knows how many messages it holds: no COUNT(*) over a long stream."""

    def __init__(self, object_list: Any, per_page: int, known_count: int) -> None:
        super().__init__(object_list, per_page)
        self._known_count = known_count

    @property
    def count(self) -> int:
        return self._known_count


def bounded_filter(field: str, limit: int = 200) -> type[admin.SimpleListFilter]:
    """A list filter of the values of ``field``, a column whose values clients choose (a
    content type, a Yjs service): the first ``limit`` of them by value, where Django's own
    lists every distinct value (5,000 content types made each page of streams 2.7 MB)."""

    class BoundedFilter(admin.SimpleListFilter):
        title = field.replace("_", " ")
        parameter_name = field

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            values = model_admin.model.objects.order_by(field).values_list(field, flat=True)
            return [(value, value) for value in values.distinct()[:limit]]

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
            return queryset.filter(**{field: self.value()}) if self.value() else queryset

    return BoundedFilter


class ExpiredFilter(admin.SimpleListFilter):
    title = "expired"
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Expired"), ("no", "Live")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() not in ("yes", "no"):
            return queryset
        assert isinstance(queryset, StreamQuerySet)
        return queryset.with_expired().filter(expired=self.value() == "yes")  # type: ignore[misc]


class ForkedFilter(admin.SimpleListFilter):
    title = "forked"
    parameter_name = "forked"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("fork", "Is a fork"), ("source", "Has forks"), ("plain", "Neither")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Stream]) -> QuerySet[Stream]:
        match self.value():
            case "fork":
                return queryset.filter(fork_source__isnull=False)
            case "source":
                return queryset.filter(fork_refcount__gt=0)
            case "plain":
                return queryset.filter(Q(fork_source__isnull=True) & Q(fork_refcount=0))
        return queryset


class CheckedSelectionAdmin(admin.ModelAdmin):
    """An admin whose actions refuse, with a message, a selection naming no object it could
    hold (an id of the wrong type, a NUL; a form edited by hand): Django passes the
    ids to the query as they come, and such a POST was a 500 (probe 7d)."""

    def response_action(  # type: ignore[override]  # the stubs name a later Django's argument
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponse | None:
        key = self.model._meta.pk
        assert key is not None
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            try:
                key.to_python(value)
                if "\x00" in value:  # PostgreSQL's text cannot hold it
                    raise ValidationError(value)
            except ValidationError:
                label = value[:40]
                self.message_user(request, f"no {self.opts.verbose_name} {label!r}", messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset)


class ReadOnlyAdmin(CheckedSelectionAdmin):
    """Browsing only: what the protocol writes is changed through the protocol."""

    class Media:
        css = {"all": ["durable_streams/admin.css"]}

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class RetentionForm(forms.ModelForm):
    """The only thing staff change on a stream: its retention policy (docs/gaps.md)."""

    retention_max_age = forms.IntegerField(
        label="retention: max age (seconds)",
        required=False,
        min_value=1,
        max_value=MAX_TTL_SECONDS,
        help_text="Messages older than this are trimmed by the retention sweep. Empty: the"
        " server-wide default, if any.",
    )
    retention_max_bytes = forms.IntegerField(
        label="retention: max bytes",
        required=False,
        min_value=1,
        max_value=MAX_SAFE_INTEGER,
        help_text="The oldest messages are trimmed until at most this many bytes remain."
        " Empty: the server-wide default, if any.",
    )

    class Meta:
        model = Stream
        fields = ["retention_max_age", "retention_max_bytes"]


@admin.register(Stream)
class StreamAdmin(ReadOnlyAdmin):
    list_display = [
        "path",
        "content_type",
        "message_count",
        "size",
        "closed",
        "is_fork",
        "deleted",
        "created_at",
    ]
    list_filter = [bounded_filter("content_type"), "closed", ExpiredFilter, ForkedFilter]
    search_fields = ["path"]
    ordering = ["path"]
    list_per_page = 100
    show_full_result_count = False
    actions = ["delete_streams"]
    form = RetentionForm
    fieldsets = [
        (None, {"fields": ["path", "content_type", "tail_offset", "closed", "created_at"]}),
        ("Expiry", {"fields": ["ttl_seconds", "expires_at", "last_access", "deleted_at"]}),
        (
            "Retention",
            {
                "fields": [
                    "retention_max_age",
                    "retention_max_bytes",
                    "start_offset",
                    "compacted_below",
                ]
            },
        ),
        ("Fork", {"fields": ["fork_source", "fork_offset", "fork_sub_offset", "fork_refcount"]}),
        ("Writers", {"fields": ["closed_by", "last_stream_seq", "producer_ledger"]}),
        ("Data", {"fields": ["messages_link"]}),
    ]
    readonly_fields = [
        "path",
        "content_type",
        "tail_offset",
        "closed",
        "created_at",
        "ttl_seconds",
        "expires_at",
        "last_access",
        "deleted_at",
        "fork_source",
        "fork_offset",
        "fork_sub_offset",
        "fork_refcount",
        "closed_by",
        "last_stream_seq",
        "producer_ledger",
        "messages_link",
        "start_offset",
        "compacted_below",
    ]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The retention policy only (RetentionForm); everything else stays read-only.
        return admin.ModelAdmin.has_change_permission(self, request, obj)

    def save_model(self, request: HttpRequest, obj: Stream, form: Any, change: bool) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT ds_set_retention(%s, %s, %s)",
                [obj.pk, obj.retention_max_age, obj.retention_max_bytes],
            )

    @admin.display(description="last access (sliding TTL)")
    def last_access(self, obj: Stream) -> Any:
        # accessed_at is kept up to date only where a TTL counts from it (models.Stream).
        if obj.ttl_seconds is None:
            return "not tracked (no TTL)"
        return obj.accessed_at

    @admin.display(description="starts at (earliest retained offset)")
    def start_offset(self, obj: Stream) -> str:
        return str(obj.first_offset)

    @admin.display(description="compacted below seq")
    def compacted_below(self, obj: Stream) -> int:
        return obj.compacted_seq

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # the ORM delete would bypass the write path
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: Stream | None = None) -> bool:
        # Only the protocol delete action, never the ORM delete of one object.
        return obj is None and admin.ModelAdmin.has_delete_permission(self, request)

    @admin.action(description="Delete selected streams (as a client DELETE would)")
    def delete_streams(self, request: HttpRequest, queryset: QuerySet[Stream]) -> None:
        outcomes: dict[str, int] = {}
        with connection.cursor() as cursor:
            for stream_path in queryset.values_list("path", flat=True):
                cursor.execute("SELECT ds_delete(%s)", [stream_path])
                outcome = cursor.fetchone()[0]
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
        summary = ", ".join(
            f"{count} {outcome.replace('_', ' ')}" for outcome, count in outcomes.items()
        )
        self.message_user(request, f"Streams: {summary}.", messages.SUCCESS)

    def view_on_site(self, obj: Stream) -> str:
        """The admin's "View on site" opens the stream live in the console."""
        return reverse("console:stream", args=[obj.path])

    @admin.display(description="messages", ordering="next_seq")
    def message_count(self, obj: Stream) -> int:
        return obj.next_seq

    @admin.display(description="bytes", ordering="next_pos")
    def size(self, obj: Stream) -> int:
        return obj.next_pos

    @admin.display(boolean=True, description="fork")
    def is_fork(self, obj: Stream) -> bool:
        return obj.fork_source_id is not None

    @admin.display(boolean=True, description="deleted")
    def deleted(self, obj: Stream) -> bool:
        return obj.deleted_at is not None

    @admin.display(description="tail offset")
    def tail_offset(self, obj: Stream) -> str:
        return str(Offset(obj.next_seq, obj.next_pos))

    @admin.display(description="fork offset")
    def fork_offset(self, obj: Stream) -> str:
        if obj.fork_seq is None or obj.fork_pos is None:
            return "-"
        return str(Offset(obj.fork_seq, obj.fork_pos))

    @admin.display(description="closed by producer")
    def closed_by(self, obj: Stream) -> str:
        if obj.closed_by_producer is None:
            return "-"
        return f"{obj.closed_by_producer} (epoch {obj.closed_by_epoch}, seq {obj.closed_by_seq})"

    @admin.display(description="producer ledger")
    def producer_ledger(self, obj: Stream) -> str:
        producers = Producer.objects.filter(stream_id=obj.pk).order_by("producer_id")[:200]
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            ((p.producer_id, p.epoch, p.last_seq, p.updated_at) for p in producers),
        )
        if not rows:
            return "no idempotent producers"
        return format_html(
            "<table><thead><tr><th>producer id</th><th>epoch</th><th>last seq</th>"
            "<th>last seen</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )

    @admin.display(description="messages")
    def messages_link(self, obj: Stream) -> str:
        url = reverse("admin:streams_stream_messages", args=[obj.pk])
        own = obj.own_message_count
        return format_html('<a href="{}">Browse {} stored messages</a>', url, own)

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "<int:stream_id>/messages/",
                self.admin_site.admin_view(self.messages_view),
                name="streams_stream_messages",
            ),
            *super().get_urls(),
        ]

    def messages_view(self, request: HttpRequest, stream_id: int) -> HttpResponse:
        """The stream's own messages, oldest first, paginated, each with a decoded preview."""
        stream = get_object_or_404(Stream, pk=stream_id)
        if not self.has_view_permission(request, stream):
            return HttpResponse(status=403)
        # Retained messages only: trimmed rows may linger until they are purged.
        rows = (
            Message.objects.filter(
                stream_id=stream.pk, seq__gte=stream.first_seq, seq__lt=stream.next_seq
            )
            .annotate(size=Length("data"), head=stored_head("data"))
            .defer("data")
            .order_by("seq")
        )
        # Compacted history has gaps: then the count is counted.
        count = rows.count() if stream.compacted_seq > stream.first_seq else None
        page = _KnownCountPaginator(
            rows, MESSAGES_PER_PAGE, stream.own_message_count if count is None else count
        ).get_page(request.GET.get("page"))
        stream_media_type = media_type(stream.content_type)
        entries = [
            {
                "seq": message.seq,
                "offset": str(Offset(message.seq, message.pos)),
                "size": message.size,
                "preview": preview(bytes(message.head), stream_media_type, message.size),
            }
            for message in page.object_list
        ]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "stream": stream,
            "page": page,
            "entries": entries,
            "title": f"Messages of {stream.path}",
        }
        return TemplateResponse(request, "admin/streams/stream/messages.html", context)
