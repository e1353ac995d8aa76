"""``manage.py create_api_key NAME --grant PREFIX:OPS [...] [--owner U] [--expires-in S]
[--rate-limit N]``: prints the new key, once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from access.grants import Grant
from access.services import create_key


class Command(BaseCommand):
    help = "Create an API key with grants; the key is printed once and never stored."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument(
            "--grant",
            action="append",
            default=[],
            metavar="PREFIX:OPS",
            help="e.g. stream/rooms/:read,append (operations: read, append, manage); repeatable",
        )
        parser.add_argument("--owner", help="username of the key's owner")
        parser.add_argument("--expires-in", type=int, metavar="SECONDS")
        parser.add_argument("--rate-limit", type=int, metavar="PER_SECOND")

    def handle(self, *args: Any, **options: Any) -> None:
        expires = options["expires_in"]
        if expires is not None and expires < 1:
            raise CommandError("--expires-in is a number of seconds, 1 or more")
        try:
            key, plaintext = create_key(
                name=options["name"],
                grants=[Grant.parse(text) for text in options["grant"]],
                owner=options["owner"],
                expires_at=None
                if expires is None
                else datetime.now(UTC) + timedelta(seconds=expires),
                rate_limit=options["rate_limit"],
            )
        except (ValueError, OverflowError) as exc:  # OverflowError: an expiry past year 9999
            raise CommandError(str(exc)) from None
        self.stderr.write(f"Created key {key.prefix} ({key.name}); store it now, it is shown once:")
        self.stdout.write(plaintext)
