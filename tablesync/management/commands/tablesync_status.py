"""``manage.py tablesync_status [--json]``: published tables and sinks, with each sink's
position, how far behind its stream it is, and its errors."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from tablesync.models import StreamSink, TablePublication
from tablesync.publish import table_exists
from tablesync.sinks import describe


class Command(BaseCommand):
    help = "List published tables and stream sinks."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="one JSON document")

    def handle(self, *args: Any, **options: Any) -> None:
        publications = [
            {
                "table": p.table_name,
                "stream": p.stream.path if p.stream_id else None,
                "type": p.entity_type,
                "key": p.key_columns,
                "columns": p.columns,
                "table_exists": table_exists(p.table_oid),
            }
            for p in TablePublication.objects.select_related("stream").order_by("table_name")
        ]
        sinks = [describe(s) for s in StreamSink.objects.order_by("id")]
        if options["json"]:
            self.stdout.write(json.dumps({"publications": publications, "sinks": sinks}))
            return
        self.stdout.write("Published tables:" if publications else "No published tables.")
        for p in publications:
            dropped = "" if p["table_exists"] else ", the table was dropped: unpublish it"
            self.stdout.write(f"  {p['table']} -> {p['stream']} (type {p['type']}{dropped})")
        self.stdout.write("Sinks:" if sinks else "No sinks.")
        for s in sinks:
            self.stdout.write(
                f"  #{s['id']} {s['stream']} -> {s['table']} ({s['mode']}, {s['state']}):"
                f" at {s['applied_offset']}, {s['behind']} behind, {s['errors']} error(s)"
                + (f", failing: {s['last_error']}" if s["last_error"] else "")
            )
