"""``manage.py trim_streams [--stream PATH ...]``

Enforce retention policies now, as each server process's sweep does every
``DS_RETENTION__SWEEP_INTERVAL_SECS``: streams under a policy (their own, or the server-wide
default) are trimmed to what it keeps, and trimmed rows are deleted in bounded batches. Says
what it trims and purges. With ``--stream``, only those streams are trimmed (every stream
waiting for a purge is purged).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from streams.services.retention import SweepReport, enforce_retention
from streams.store.pool import close_pool


class Command(BaseCommand):
    help = "Enforce retention policies now: trim streams and purge trimmed messages."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--stream", action="append", dest="streams", metavar="PATH",
            help="only this stream (repeatable; default: every stream under a policy)",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        only = set(options["streams"]) if options["streams"] else None
        started = time.monotonic()
        report = asyncio.run(self._run(only))
        elapsed = time.monotonic() - started
        self.stdout.write(
            self.style.SUCCESS(
                f"{report.streams} streams under a retention policy, {len(report.trimmed)}"
                f" trimmed, {report.purged_rows} messages purged in {elapsed:.1f}s"
            )
        )

    async def _run(self, only: set[str] | None) -> SweepReport:
        def progress(action: str, path: str, details: str) -> None:
            self.stdout.write(f"{action} {path}: {details}")

        try:
            return await enforce_retention(progress, only)
        finally:
            await close_pool()
