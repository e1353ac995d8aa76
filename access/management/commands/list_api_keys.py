"""``manage.py list_api_keys``: every key with its state and grants (never the key itself)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from access.models import ApiKey


class Command(BaseCommand):
    help = "List API keys (id, name, owner, expiry, revoked, rate limit, grants)."

    def handle(self, *args: Any, **options: Any) -> None:
        keys = ApiKey.objects.select_related("owner").prefetch_related("grants").order_by("created")
        for key in keys:
            state = "revoked" if key.revoked else "expired" if key.has_expired else "active"
            grants = ", ".join(str(grant) for grant in key.grants.all()) or "(no grants)"
            self.stdout.write(
                f"{key.prefix}  {key.name}  owner={key.owner or '-'}  {state}"
                f"  expires={key.expiry_date or 'never'}  rate={key.rate_limit or '-'}  {grants}"
            )
