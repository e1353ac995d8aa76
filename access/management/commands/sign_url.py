"""``manage.py sign_url --key KEY_ID (--stream PATH | --prefix PREFIX) [--expires-in S]
[--base-url URL]``: a signed read URL (or its query string) for EventSource and CDNs."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from access.models import ApiKey
from access.services import signed_query
from access.signing import scope_of
from streams.errors import BadRequest


class Command(BaseCommand):
    help = "Mint a signed read URL for one stream or a prefix that an API key may read."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--key", required=True, metavar="KEY_ID")
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--stream", metavar="PATH")
        target.add_argument("--prefix", metavar="PREFIX", help="e.g. stream/rooms/")
        parser.add_argument("--expires-in", type=int, default=3600, metavar="SECONDS")
        parser.add_argument("--base-url", default="http://127.0.0.1:8000")

    def handle(self, *args: Any, **options: Any) -> None:
        if not 0 < options["expires_in"] <= settings.DS_AUTH_SIGNED_URL_MAX_SECS:
            raise CommandError(f"--expires-in is 1 to {settings.DS_AUTH_SIGNED_URL_MAX_SECS}")
        stream = options["stream"]
        try:
            scope = scope_of(stream, options["prefix"])
        except BadRequest as exc:
            raise CommandError(exc.message) from None
        try:
            query = signed_query(
                key_id=options["key"], scope=scope, exact=bool(stream),
                expires_in=options["expires_in"],
            )  # fmt: skip
        except (ApiKey.DoesNotExist, ValueError) as exc:
            raise CommandError(str(exc) or f"no key {options['key']}") from None
        if stream:
            self.stdout.write(
                f"{options['base_url'].rstrip('/')}/v1/stream/{quote(stream)}?{query}"
            )
        else:
            self.stdout.write(query)
