"""``manage.py rotate_webhook_key``: add a new webhook signing key (PROTOCOL.md 6.5).

The new key is published in the JWKS at once and signs from ``--activate-in`` seconds on
(default 600: receivers caching the JWKS for its max-age of 300 s have it before it is used).
The previous key stays published for an hour after the new one activates, longer than any
receiver's replay window; ``--prune`` deletes keys no longer published. Run it with the
servers' DJANGO_SECRET_KEY: private keys are encrypted under it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connection
from django.utils import timezone

from subscriptions.models import WebhookKey
from subscriptions.signing import generate_key

# Keys a newer key replaced more than an hour ago: no longer published (subscriptions.store).
UNPUBLISHED = (
    "DELETE FROM ds_webhook_key AS k WHERE EXISTS ("
    " SELECT 1 FROM ds_webhook_key AS n WHERE n.created_at > k.created_at"
    " AND n.activates_at < now() - interval '1 hour') RETURNING kid"
)


class Command(BaseCommand):
    help = "Add a webhook signing key that signs after a delay; optionally prune old keys."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--activate-in",
            type=int,
            default=600,
            help="seconds until the new key signs (default 600; 0: at once)",
        )
        parser.add_argument(
            "--prune", action="store_true", help="delete keys no longer published, and stop"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["prune"]:
            with connection.cursor() as cursor:
                cursor.execute(UNPUBLISHED)
                pruned = [kid for (kid,) in cursor.fetchall()]
            self.stdout.write(f"pruned {len(pruned)} key(s): {', '.join(pruned) or '-'}")
            return
        if options["activate_in"] < 0:
            self.stderr.write("--activate-in must not be negative")
            raise SystemExit(2)
        key = generate_key()
        now = timezone.now()
        activates = now + timedelta(seconds=options["activate_in"])
        WebhookKey.objects.create(
            kid=key.kid,
            public_x=key.public_x,
            private_key=key.encrypted_private,
            created_at=now,
            activates_at=activates,
        )
        self.stdout.write(f"{key.kid} published now, signs from {activates.isoformat()}")
