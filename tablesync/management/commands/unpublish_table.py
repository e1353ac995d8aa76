"""``manage.py unpublish_table TABLE [--close-stream]``

Stops publishing TABLE: waits for transactions writing it to end, so every change committed
before is in the stream and none after. ``--close-stream`` also closes the stream (readers
see its end). The stream and its history stay.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from streams.errors import ProtocolError
from tablesync.publish import unpublish_table


class Command(BaseCommand):
    help = "Stop publishing a table's changes to its stream."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("table", help="the published table (as published, or its name now)")
        parser.add_argument("--close-stream", action="store_true", help="close the stream too")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            publication = unpublish_table(
                table=options["table"], close_stream=options["close_stream"]
            )
        except ProtocolError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(self.style.SUCCESS(f"Unpublished {publication.table_name}"))
