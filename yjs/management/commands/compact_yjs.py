"""``manage.py compact_yjs [--service S] [--doc PATH] [--all] [--force]``

Compacts Yjs documents now, with the same code (and the same cross-process lock) the server
uses after appends. Without ``--force`` only documents over YJS_COMPACTION_THRESHOLD_BYTES are
compacted; ``--all`` selects every document (of ``--service`` if given).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from yjs.compaction import bytes_since_snapshot, compact
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
        compacted = 0
        for index, document in enumerate(documents.iterator(), start=1):
            pending = bytes_since_snapshot(document)
            label = f"[{index}/{total}] {document}"
            if not options["force"] and pending <= threshold:
                self.stdout.write(f"{label}: {pending} bytes since the last snapshot, skipped")
                continue
            result = compact(document.pk, force=options["force"])
            if result is None:
                self.stdout.write(f"{label}: nothing to do (or compacting elsewhere)")
                continue
            compacted += 1
            self.stdout.write(
                f"{label}: {result.updates} updates ({result.update_bytes} bytes) -> snapshot of "
                f"{result.snapshot_bytes} bytes at {result.covers} in {result.seconds:.2f}s"
            )
        self.stdout.write(self.style.SUCCESS(f"Compacted {compacted} of {total} documents."))
