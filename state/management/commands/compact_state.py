"""``manage.py compact_state [--stream PATH ...]``

Compact registered state streams now (state/compaction.py), as the server's compaction sweep
does: per ``(type, key)`` only the latest change event stays, deletes older than the tombstone
period go, a ``reset`` drops everything before it. Without ``--stream``: every state stream
registered with compaction; a named one is compacted whether or not it is. Says what it does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError, CommandParser

from state.compaction import Compacted, compact
from state.models import StateStream
from streams.errors import ProtocolError
from streams.store.pool import close_pool


class Command(BaseCommand):
    help = "Compact registered state streams: keep only the latest change event of each key."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--stream", action="append", dest="streams", metavar="PATH",
            help="a registered stream's path (repeatable; default: every stream registered"
            " with compaction)",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        registrations = StateStream.objects.select_related("stream").order_by("stream__path")
        if options["streams"]:
            registrations = registrations.filter(stream__path__in=options["streams"])
            missing = set(options["streams"]) - {r.stream.path for r in registrations}
            if missing:
                raise CommandError(f"not state streams: {', '.join(sorted(missing))}")
        else:
            registrations = registrations.filter(compaction=True)
        targets = [(r.stream_id, r.stream.path) for r in registrations]
        if not targets:
            self.stdout.write("No state streams to compact.")
            return
        asyncio.run(self._compact_all(targets))

    async def _compact_all(self, targets: list[tuple[int, str]]) -> None:
        failed = []
        try:
            for stream_id, path in targets:
                self.stdout.write(f"Compacting {path} ...")

                def progress(action: str, details: str, path: str = path) -> None:
                    self.stdout.write(f"  {path}: {action} {details}")

                # One stream's failure is reported, and the others are still compacted.
                try:
                    result = await compact(stream_id, progress=progress)
                except (psycopg.Error, ProtocolError) as exc:
                    self.stderr.write(f"{path}: failed: {exc}")
                    failed.append(path)
                    continue
                self._report(path, result)
        finally:
            await close_pool()
        if failed:
            raise CommandError(f"{len(failed)} of {len(targets)} streams failed")

    def _report(self, path: str, result: Compacted | None) -> None:
        if result is None:
            self.stdout.write(f"{path}: skipped (being compacted elsewhere, or forked meanwhile)")
            return
        before = result.kept + result.deleted
        self.stdout.write(
            self.style.SUCCESS(
                f"{path}: {before} events in [{result.floor}, {result.horizon}) -> {result.kept}"
                f" kept, {result.deleted} deleted ({result.deleted_bytes} bytes) in"
                f" {result.seconds:.1f}s"
                + (", old deletes dropped" if result.dropped_deletes else "")
            )
        )
