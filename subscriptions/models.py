"""Subscriptions (PROTOCOL.md 6, 7): durable cursors over streams that wake workers.

Everything a subscription is and does lives in these rows, so any server process can act for
it and none holds state of its own: the configuration, the wake in flight (generation, wake id,
lease, holder), the webhook retry schedule, and per linked stream the acknowledged offset and
the tail the current wake reported. The SQL in ``sql/subscriptions.sql`` writes them; the admin
reads them through the ORM.
"""

from __future__ import annotations

from django.db import models

from streams.protocol.offsets import Offset


class WakeState(models.TextChoices):
    # A webhook request for the wake is being sent by process `sender`.
    SENDING = "sending"
    # The webhook answered without done: the receiver works and calls back within the lease.
    WAITING = "waiting"
    # A pull-wake event was written to the wake stream; no worker claimed it yet.
    ISSUED = "issued"
    # A pull-wake worker (`holder`) claimed the wake and holds the lease.
    CLAIMED = "claimed"


class Subscription(models.Model):
    id = models.BigAutoField(primary_key=True)
    # The client's id (PROTOCOL.md 6.1), in the URL /v1/stream/__ds/subscriptions/<id>.
    subscription_id = models.TextField(unique=True)
    type = models.TextField(choices=[("webhook", "webhook"), ("pull-wake", "pull-wake")])
    pattern = models.TextField(null=True, blank=True)
    # The pattern as a regular expression over "/" || path (subscriptions.protocol.glob_regex),
    # and the literal beginning every match shares (a cheap test before the expression).
    pattern_regex = models.TextField(null=True, blank=True)
    pattern_prefix = models.TextField(null=True, blank=True)
    webhook_url = models.TextField(null=True, blank=True)
    wake_stream = models.TextField(null=True, blank=True)
    lease_ttl_ms = models.IntegerField()
    description = models.TextField(null=True, blank=True)
    # SHA-256 of the normalized configuration: a PUT with another is a 409 (PROTOCOL.md 6.2).
    config_hash = models.TextField()
    # Where callbacks go: the server's URL as the creating request named it, or
    # DS_SUBSCRIPTIONS__PUBLIC_URL.
    base_url = models.TextField()
    created_at = models.DateTimeField()
    # Who created it ("key:<key id>"...; access.grants.Principal.label).
    created_by = models.TextField(null=True, blank=True)
    # Paused by an operator (the admin): no new wake until resumed.
    paused = models.BooleanField(default=False)

    # The wake in flight (PROTOCOL.md 7): none when wake_id is NULL.
    generation = models.BigIntegerField(default=0)
    wake_id = models.TextField(null=True, blank=True)
    wake_state = models.TextField(choices=WakeState.choices, null=True, blank=True)
    woken_at = models.DateTimeField(null=True, blank=True)
    # The streams as the wake reported them (path, link_type, acked_offset, tail_offset,
    # has_pending): what a {"done": true} acknowledges.
    wake_streams = models.JSONField(null=True, blank=True)
    holder = models.TextField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # The process sending the webhook request, and when it is presumed dead.
    sender = models.TextField(null=True, blank=True)
    send_deadline = models.DateTimeField(null=True, blank=True)

    # Webhook retries (PROTOCOL.md 7.1): failed attempts in a row and the next one's time.
    failed_attempts = models.IntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    last_error_at = models.DateTimeField(null=True, blank=True)
    last_delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "ds_subscription"
        indexes = [
            models.Index(
                fields=["lease_expires_at"],
                name="ds_subscription_lease",
                condition=models.Q(lease_expires_at__isnull=False),
            ),
            models.Index(
                fields=["send_deadline"],
                name="ds_subscription_sending",
                condition=models.Q(send_deadline__isnull=False),
            ),
            models.Index(
                fields=["next_attempt_at"],
                name="ds_subscription_retry",
                condition=models.Q(next_attempt_at__isnull=False),
            ),
            # Pattern subscriptions by literal beginning: every stream created looks up those
            # that may match it (ds_sub_stream_created).
            models.Index(
                fields=["pattern_prefix"],
                name="ds_subscription_patterns",
                condition=models.Q(pattern_regex__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return self.subscription_id

    @property
    def status(self) -> str:
        """PROTOCOL.md 6.3: failed while a webhook retry is scheduled."""
        return "failed" if self.next_attempt_at is not None else "active"


class SubscriptionLink(models.Model):
    """A stream a subscription follows (PROTOCOL.md 6.1), by path: a stream that does not
    exist yet (an explicit link) has tail zero, and keeps its link when it is created."""

    id = models.BigAutoField(primary_key=True)
    subscription = models.ForeignKey(
        Subscription,
        on_delete=models.CASCADE,
        related_name="links",
        db_index=False,
        db_column="sid",
    )
    path = models.TextField()
    explicit = models.BooleanField(default=False)
    glob = models.BooleanField(default=False)
    # Last processed position, inclusive (PROTOCOL.md 7): the next read starts here.
    acked_seq = models.BigIntegerField(default=0)
    acked_pos = models.BigIntegerField(default=0)

    class Meta:
        db_table = "ds_subscription_link"
        constraints = [
            models.UniqueConstraint(
                fields=["subscription", "path"], name="ds_subscription_link_key"
            )
        ]
        indexes = [models.Index(fields=["path"], name="ds_subscription_link_path")]

    def __str__(self) -> str:
        return self.path

    @property
    def link_type(self) -> str:
        return "explicit" if self.explicit else "glob"

    @property
    def acked_offset(self) -> str:
        return str(Offset(self.acked_seq, self.acked_pos))


class WebhookKey(models.Model):
    """An Ed25519 webhook signing key (subscriptions.signing): the public half as the JWK's
    ``x``, the private half encrypted."""

    kid = models.TextField(primary_key=True)
    public_x = models.TextField()
    private_key = models.BinaryField()
    created_at = models.DateTimeField()
    # The key signs from this moment on (until a newer key activates).
    activates_at = models.DateTimeField()

    class Meta:
        db_table = "ds_webhook_key"
        verbose_name = "webhook signing key"

    def __str__(self) -> str:
        return self.kid
