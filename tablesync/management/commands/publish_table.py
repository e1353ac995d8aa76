"""``manage.py publish_table TABLE --stream PATH [--type NAME] [--columns A,B] [--snapshot]``

From the command's commit on, every committed insert, update and delete of TABLE (a table
name, ``schema.table``, or a Django model ``app_label.Model``) is appended to the JSON stream
PATH (created when missing) as a State Protocol change event, in the committing transaction.
``--snapshot`` first appends the current rows as inserts, so readers from -1 get the table.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from streams.errors import ProtocolError
from tablesync.publish import publish_table


class Command(BaseCommand):
    help = "Publish a table's committed changes to a JSON stream as State Protocol events."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("table", help="table, schema.table, or a Django model app.Model")
        parser.add_argument("--stream", required=True, metavar="PATH", help="the stream's path")
        parser.add_argument(
            "--type", dest="entity_type", metavar="NAME",
            help="the events' entity type (default: the table's name)",
        )  # fmt: skip
        parser.add_argument(
            "--columns", metavar="A,B,...",
            help="columns in the events' value (default: every column)",
        )  # fmt: skip
        parser.add_argument(
            "--snapshot", action="store_true", help="first append the current rows as inserts"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        columns = options["columns"]
        try:
            result = publish_table(
                table=options["table"],
                stream=options["stream"],
                entity_type=options["entity_type"],
                columns=[c.strip() for c in columns.split(",")] if columns is not None else None,
                snapshot=options["snapshot"],
                created_by="manage.py",
            )
        except ProtocolError as exc:
            raise CommandError(exc.message) from None
        publication = result.publication
        self.stdout.write(
            self.style.SUCCESS(
                f"Published {publication.table_name} to {options['stream']}"
                f"{' (new stream)' if result.created_stream else ''}: type"
                f" {publication.entity_type!r}, key {', '.join(publication.key_columns)}"
                + (
                    f", {result.snapshot_rows} rows in the snapshot"
                    if result.snapshot_rows is not None
                    else ""
                )
            )
        )
