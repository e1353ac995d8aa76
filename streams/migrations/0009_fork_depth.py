"""Forks are refused past a depth (DS_LIMITS__MAX_FORK_DEPTH): a new outcome of ds_create.
Enum values cannot be removed again: the reverse leaves it."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0008_followed"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TYPE ds_create_outcome ADD VALUE IF NOT EXISTS 'fork_too_deep'",
            migrations.RunSQL.noop,
        ),
    ]
