"""``manage.py revoke_api_key KEY_ID``: the key stops working on every server process."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from access.models import ApiKey
from access.services import revoke_key


class Command(BaseCommand):
    help = "Revoke an API key (by its id, the part before the dot). This cannot be undone."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key_id")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            key = revoke_key(options["key_id"])
        except ApiKey.DoesNotExist:
            raise CommandError(f"no key {options['key_id']}") from None
        self.stdout.write(f"Revoked {key.prefix} ({key.name}).")
