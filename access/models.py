"""API keys and their grants (PROTOCOL.md 12.1).

A key is ``<prefix>.<secret>``; only the prefix (its public id) and a SHA-512 of the whole key
are stored (``djangorestframework-api-key``: keys are long random strings, so a fast hash is
safe, and checking one costs microseconds). The plaintext is shown once, at creation.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from rest_framework_api_key.models import AbstractAPIKey

from access.grants import Grant as GrantRule
from access.grants import Operation, normalize_prefix


class ApiKey(AbstractAPIKey):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="api_keys",
    )
    rate_limit = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Requests per second allowed with this key, per server process (429 past it).",
    )

    class Meta(AbstractAPIKey.Meta):
        db_table = "ds_api_key"
        verbose_name = "API key"


class Grant(models.Model):
    """Operations on every resource whose name starts with ``prefix`` (``stream/rooms/``,
    ``yjs/notes/docs/``; empty: everything). See access.grants."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="grants")
    prefix = models.CharField(max_length=1024, blank=True)
    read = models.BooleanField(default=True)
    append = models.BooleanField(default=False)
    manage = models.BooleanField(default=False)

    class Meta:
        db_table = "ds_api_grant"

    def __str__(self) -> str:
        return str(self.rule())

    def save(self, *args: object, **kwargs: object) -> None:
        self.prefix = normalize_prefix(self.prefix)
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    def rule(self) -> GrantRule:
        operations = {
            op for op, on in ((Operation.READ, self.read), (Operation.APPEND, self.append),
                              (Operation.MANAGE, self.manage)) if on
        }  # fmt: skip
        return GrantRule(self.prefix, frozenset(operations))
