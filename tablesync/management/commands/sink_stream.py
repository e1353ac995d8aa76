"""``manage.py sink_stream PATH --table NAME --map COLUMN[=FIELD][::TYPE] ... [options]``

Binds the JSON stream PATH to a table: every message becomes a row (``--mode append``), or,
for State Protocol streams, inserts and updates upsert rows by key and deletes delete them
(``--mode upsert --key COLUMN``). Server processes apply it in stream order, exactly once, and
record messages that do not fit (admin: Sink errors). ``--wait`` applies what the stream holds
now from this command before returning.

Examples:
  sink_stream orders/events --table order_events --create \\
      --map order_id=order.id::bigint --map total=order.total::numeric --map payload::jsonb
  sink_stream rooms/42 --table users --mode upsert --key id::text --type user \\
      --map name::text --map age::int
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from streams.errors import ProtocolError
from tablesync.models import SinkMode
from tablesync.sinks import DEFAULT_OFFSET_COLUMN, SinkSpec, create_sink, describe, run_sink_now


class Command(BaseCommand):
    help = "Sink a JSON stream into a table (one row per message, or upserts by key)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("stream", metavar="PATH", help="the stream's path")
        parser.add_argument("--table", required=True, help="table, schema.table or app.Model")
        parser.add_argument(
            "--map", action="append", default=[], dest="mapping",
            metavar="COLUMN[=FIELD][::TYPE]",
            help="a column and the message field it takes (a.b or /a/b); repeatable",
        )  # fmt: skip
        parser.add_argument("--mode", choices=SinkMode.values, default=SinkMode.APPEND)
        parser.add_argument(
            "--key", metavar="COLUMN[::TYPE]", help="upsert: the column of the event's key"
        )
        parser.add_argument(
            "--type", dest="entity_type", help="upsert: apply only events of this entity type"
        )
        offset = parser.add_mutually_exclusive_group()
        offset.add_argument(
            "--offset-column", default=DEFAULT_OFFSET_COLUMN,
            help=f"the text column for each message's offset (default: {DEFAULT_OFFSET_COLUMN})",
        )  # fmt: skip
        offset.add_argument("--no-offset-column", action="store_true")
        parser.add_argument(
            "--from", dest="start", default="-1", metavar="OFFSET",
            help="where to start: -1 (the first message, default), now, or an offset",
        )  # fmt: skip
        parser.add_argument(
            "--create", action="store_true", help="create the table from the mapping"
        )
        parser.add_argument(
            "--wait", action="store_true", help="apply what the stream holds now, then return"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        spec = SinkSpec(
            stream=options["stream"],
            table=options["table"],
            mapping=options["mapping"],
            mode=options["mode"],
            key=options["key"],
            entity_type=options["entity_type"],
            offset_column=None if options["no_offset_column"] else options["offset_column"],
            start=options["start"],
            create_table=options["create"],
            created_by="manage.py",
        )
        try:
            sink = create_sink(spec)
            applied = run_sink_now(sink) if options["wait"] else None
        except ProtocolError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(self.style.SUCCESS(f"Sinking {sink.stream_path} into {sink.table_name}"))
        if applied is not None:
            sink.refresh_from_db()
            status = describe(sink)
            self.stdout.write(
                f"  applied {applied} messages, now at {status['applied_offset']},"
                f" {status['errors']} errors"
            )
