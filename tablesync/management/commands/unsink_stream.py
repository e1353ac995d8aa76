"""``manage.py unsink_stream PATH --table NAME``: stop sinking PATH into the table (its rows
stay; the sink's recorded errors go)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from streams.errors import ProtocolError
from tablesync.sinks import drop_sink, find_sink


class Command(BaseCommand):
    help = "Stop sinking a stream into a table."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("stream", metavar="PATH")
        parser.add_argument("--table", required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            sink = find_sink(options["stream"], options["table"])
            drop_sink(sink)
        except ProtocolError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(self.style.SUCCESS(f"No longer sinking {sink}"))
