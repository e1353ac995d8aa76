"""Django admin for subscriptions: their links and cursors, the wake in flight (generation,
lease, holder), the retry schedule and the last delivery error; actions to pause, resume,
retry now and reset cursors.

The rows are written by the SQL of ``sql/subscriptions.sql`` only, so the admin is read-only,
and its actions call those functions (a reset fences the wake in flight, a resume wakes the
subscription on every server process).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import connection
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from streams.admin import ReadOnlyAdmin
from streams.models import Stream
from streams.protocol.offsets import Offset
from subscriptions.models import Subscription, WebhookKey


@admin.register(Subscription)
class SubscriptionAdmin(ReadOnlyAdmin):
    list_display = [
        "subscription_id",
        "type",
        "target",
        "delivery_status",
        "generation",
        "wake_state",
        "holder",
        "lease_expires_at",
        "failed_attempts",
        "next_attempt_at",
        "last_delivered_at",
    ]
    list_filter = ["type", "paused", "wake_state"]
    search_fields = ["subscription_id", "pattern", "webhook_url", "wake_stream", "links__path"]
    ordering = ["subscription_id"]
    list_per_page = 100
    show_full_result_count = False
    actions = ["pause", "resume", "retry_now", "reset_to_tail", "reset_to_start", "delete_subs"]
    fieldsets = [
        (None, {"fields": ["subscription_id", "type", "pattern", "webhook_url", "wake_stream",
                           "lease_ttl_ms", "description", "created_at", "created_by",
                           "base_url"]}),
        ("Wake in flight", {"fields": ["delivery_status", "generation", "wake_id", "wake_state",
                                       "woken_at", "holder", "lease_expires_at", "sender",
                                       "send_deadline"]}),
        ("Retries", {"fields": ["failed_attempts", "next_attempt_at", "last_error",
                                "last_error_at", "last_delivered_at"]}),
        ("Streams followed", {"fields": ["cursors"]}),
    ]  # fmt: skip
    readonly_fields = [
        "subscription_id",
        "type",
        "pattern",
        "webhook_url",
        "wake_stream",
        "lease_ttl_ms",
        "description",
        "created_at",
        "created_by",
        "base_url",
        "delivery_status",
        "generation",
        "wake_id",
        "wake_state",
        "woken_at",
        "holder",
        "lease_expires_at",
        "sender",
        "send_deadline",
        "failed_attempts",
        "next_attempt_at",
        "last_error",
        "last_error_at",
        "last_delivered_at",
        "cursors",
    ]

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # the ORM delete would leave the links behind
        return actions

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Only the actions (through the SQL functions), for staff allowed to change
        # subscriptions; never the form of one object.
        return obj is None and admin.ModelAdmin.has_change_permission(self, request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and admin.ModelAdmin.has_delete_permission(self, request)

    @admin.display(description="delivers to")
    def target(self, obj: Subscription) -> str:
        return obj.webhook_url or f"wake stream {obj.wake_stream}"

    @admin.display(description="status")
    def delivery_status(self, obj: Subscription) -> str:
        return "paused" if obj.paused else obj.status

    @admin.display(description="cursors (acked offset, tail, pending)")
    def cursors(self, obj: Subscription) -> str:
        links = list(obj.links.order_by("path")[:500])
        streams = {s.path: s for s in Stream.objects.filter(path__in=[lk.path for lk in links])}
        rows = []
        for link in links:
            stream = streams.get(link.path)
            live = stream is not None and stream.deleted_at is None
            tail = Offset(stream.next_seq, stream.next_pos) if stream and live else Offset(0, 0)
            if stream is not None:
                url = reverse("admin:streams_stream_change", args=[stream.pk])
                name = format_html('<a href="{}">{}</a>', url, link.path)
            else:
                name = format_html("{} (no such stream)", link.path)
            pending = tail.seq > link.acked_seq
            rows.append((name, link.link_type, link.acked_offset, str(tail), pending))
        if not rows:
            return "no streams"
        body = format_html_join(
            "", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows
        )
        return format_html(
            "<table><thead><tr><th>stream</th><th>link</th><th>acked offset</th>"
            "<th>tail</th><th>pending</th></tr></thead><tbody>{}</tbody></table>",
            body,
        )

    def _each(self, request: HttpRequest, queryset: QuerySet[Subscription], sql: str,
              done: str, *args: Any) -> None:  # fmt: skip
        count = 0
        with connection.cursor() as cursor:
            for sid in queryset.values_list("id", flat=True):
                cursor.execute(sql, [sid, *args])
                count += 1
        self.message_user(request, f"{count} subscription(s) {done}.", messages.SUCCESS)

    @admin.action(
        description="Pause: no new wakes (the one in flight runs its course)",
        permissions=["change"],
    )
    def pause(self, request: HttpRequest, queryset: QuerySet[Subscription]) -> None:
        self._each(request, queryset, "SELECT ds_sub_pause(%s, %s)", "paused", True)

    @admin.action(description="Resume", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Subscription]) -> None:
        self._each(request, queryset, "SELECT ds_sub_pause(%s, %s)", "resumed", False)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM ds_subscription"
                " WHERE id = ANY(%s) AND ds_sub_creator_lost(created_by)",
                [list(queryset.values_list("id", flat=True))],
            )
            (orphans,) = cursor.fetchone()
        if orphans:
            # Paused again at their next wake (ds_sub_orphaned): saying "resumed" alone misled
            # (review).
            self.message_user(
                request,
                f"{orphans} of them were made with an API key that is revoked, expired or"
                " deleted: they pause again at their next wake. The application takes one over"
                " by PUTting its configuration again with a key that stands.",
                messages.WARNING,
            )

    @admin.action(
        description="Retry now (the webhook retry is due at once)", permissions=["change"]
    )
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Subscription]) -> None:
        self._each(request, queryset, "SELECT ds_sub_retry_now(%s)", "due now")

    @admin.action(
        description="Reset cursors to the streams' tails (skip what is pending)",
        permissions=["change"],
    )
    def reset_to_tail(self, request: HttpRequest, queryset: QuerySet[Subscription]) -> None:
        self._each(request, queryset, "SELECT ds_sub_reset(%s, %s)", "reset to the tails", True)

    @admin.action(
        description="Reset cursors to the start (deliver everything again)", permissions=["change"]
    )
    def reset_to_start(self, request: HttpRequest, queryset: QuerySet[Subscription]) -> None:
        self._each(request, queryset, "SELECT ds_sub_reset(%s, %s)", "reset to the start", False)

    @admin.action(
        description="Delete selected subscriptions (as a client DELETE would)",
        permissions=["delete"],
    )
    def delete_subs(self, request: HttpRequest, queryset: QuerySet[Subscription]) -> None:
        count = 0
        with connection.cursor() as cursor:
            for sub_id in queryset.values_list("subscription_id", flat=True):
                cursor.execute("SELECT ds_sub_delete(%s)", [sub_id])
                count += 1
        self.message_user(request, f"{count} subscription(s) deleted.", messages.SUCCESS)


@admin.register(WebhookKey)
class WebhookKeyAdmin(ReadOnlyAdmin):
    """The webhook signing keys (public halves): ``manage.py rotate_webhook_key`` adds one."""

    list_display = ["kid", "created_at", "activates_at"]
    ordering = ["-created_at"]
    fields = ["kid", "public_x", "created_at", "activates_at"]
    readonly_fields = ["kid", "public_x", "created_at", "activates_at"]
