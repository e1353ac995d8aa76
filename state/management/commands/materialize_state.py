"""``manage.py materialize_state [--stream PATH ...] [--rebuild]``

Without ``--rebuild``: bring every registered state stream (or the ones named) up to its tail,
applying what was appended after its materialized offset (normally little: server processes
materialize right after appends; a bulk job or a stopped server may leave a stream behind).
With ``--rebuild``: recompute each one's state from its first message, with progress.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from state.models import StateStream
from state.services import catch_up_state_stream, rebuild_state_stream
from streams.errors import ProtocolError


class Command(BaseCommand):
    help = "Materialize registered state streams: catch up, or --rebuild from the start."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--stream", action="append", dest="streams", metavar="PATH",
            help="a registered stream's path (repeatable; default: every state stream)",
        )  # fmt: skip
        parser.add_argument(
            "--rebuild", action="store_true", help="recompute from the first message"
        )
        parser.add_argument(
            "--allow-trimmed-history", action="store_true",
            help="rebuild a stream whose start was trimmed (what its trimmed events set is lost)",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        paths = options["streams"] or list(
            StateStream.objects.order_by("stream__path").values_list("stream__path", flat=True)
        )
        if not paths:
            self.stdout.write("No state streams are registered.")
            return
        for path in paths:
            try:
                if options["rebuild"]:
                    self._rebuild(path, options["allow_trimmed_history"])
                else:
                    self._catch_up(path)
            except ProtocolError as exc:
                raise CommandError(f"{path}: {exc.message}") from None

    def _rebuild(self, path: str, allow_trimmed: bool) -> None:
        started = time.monotonic()

        def progress(done: int, total: int) -> None:
            percent = 100 * done / total if total else 100
            self.stdout.write(f"  {path}: {done}/{total} events ({percent:.0f}%)")

        self.stdout.write(f"Rebuilding {path} ...")
        result = rebuild_state_stream(path=path, progress=progress, allow_trimmed=allow_trimmed)
        elapsed = time.monotonic() - started
        self.stdout.write(
            self.style.SUCCESS(
                f"{path}: {result.events} events -> {result.entities} entities in "
                f"{elapsed:.1f}s ({result.invalid_events} invalid events skipped)"
            )
        )
        if result.last_error:
            self.stdout.write(f"  last invalid event: {result.last_error}")

    def _catch_up(self, path: str) -> None:
        caught_up = catch_up_state_stream(path=path)
        if caught_up is None:
            raise CommandError(f"{path}: not a state stream")
        self.stdout.write(f"{path}: up to date ({caught_up.applied} messages applied)")
