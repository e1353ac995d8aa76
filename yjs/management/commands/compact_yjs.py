"""``manage.py compact_yjs [--service S] [--doc PATH] [--all] [--force]``

Compacts Yjs documents now, with the same code (and the same cross-process lock) the server
uses after appends. Without ``--force`` only documents over YJS_COMPACTION_THRESHOLD_BYTES are
compacted; ``--all`` selects every document (of ``--service`` if given).

A document whose updates cannot be merged is reported (on stderr) and the others are still
compacted; the command then exits with status 1. Without ``--force`` a document whose
compaction failed before is reported with that failure and not tried again (its updates have
not changed); ``--force`` retries it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from yjs.compaction import CompactionFailure, bytes_since_snapshot, compact
from yjs.models import YjsDocument


class Command(BaseCommand):
    help = "Compact Yjs documents into snapshots (YJS-PROTOCOL.md 8)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--service", help="only documents of this service")
        parser.add_argument("--doc", metavar="PATH", help="one document's path (needs --service)")
        parser.add_argument("--all", action="store_true", help="every document (of --service)")
        parser.add_argument(
            "--force", action="store_true", help="compact even when under the threshold"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Only positions are read here; compact() loads the snapshot's bytes itself.
        documents = (
            YjsDocument.objects.select_related("snapshot", "stream")
            .defer("snapshot__data")
            .order_by("service", "path")
        )
        if options["doc"]:
            if not options["service"]:
                raise CommandError("--doc needs --service")
            documents = documents.filter(service=options["service"], path=options["doc"])
        elif options["all"]:
            if options["service"]:
                documents = documents.filter(service=options["service"])
        else:
            raise CommandError("name a document (--service S --doc PATH) or pass --all")

        total = documents.count()
        if options["doc"] and not total:
            raise CommandError(f"no document {options['service']}/{options['doc']}")
        threshold = settings.YJS_COMPACTION_THRESHOLD_BYTES
        force = options["force"]
        compacted = 0
        failed: list[str] = []
        for index, document in enumerate(documents.iterator(), start=1):
            label = f"[{index}/{total}] {document}"
            if document.compaction_failed_at is not None and not force:
                self._failed(label, document.compaction_error, document.compaction_failed_at)
                failed.append(str(document))
                continue
            pending = bytes_since_snapshot(document)
            if not force and pending <= threshold:
                self.stdout.write(f"{label}: {pending} bytes since the last snapshot, skipped")
                continue
            try:
                result = compact(document.pk, force=force)
            except Exception as exc:  # noqa: BLE001 - reported; the other documents go on
                self.stderr.write(f"{label}: compaction failed: {type(exc).__name__}: {exc}")
                failed.append(str(document))
                continue
            if isinstance(result, CompactionFailure):
                self._failed(label, result.error, None if result.now else result.failed_at)
                failed.append(str(document))
                continue
            if result is None:
                self.stdout.write(f"{label}: nothing to do (or compacting elsewhere)")
                continue
            compacted += 1
            self.stdout.write(
                f"{label}: {result.updates} updates ({result.update_bytes} bytes) -> snapshot of "
                f"{result.snapshot_bytes} bytes at {result.covers} in {result.seconds:.2f}s"
            )
        self.stdout.write(self.style.SUCCESS(f"Compacted {compacted} of {total} documents."))
        if failed:
            raise CommandError(
                f"{len(failed)} of {total} documents could not be compacted: {', '.join(failed)}"
            )

    def _failed(self, label: str, error: str, earlier: datetime | None) -> None:
        """Report a document whose updates cannot be merged: now, or ``earlier``."""
        if earlier is None:
            self.stderr.write(f"{label}: compaction failed, its updates cannot be merged: {error}")
        else:
            self.stderr.write(
                f"{label}: compaction failed at {earlier.isoformat()}, its updates cannot be"
                f" merged: {error}; not retried without --force"
            )
