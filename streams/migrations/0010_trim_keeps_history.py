"""A client's trim of a stream whose history must stay (a registered state stream) is refused:
a new outcome of ds_trim. Enum values cannot be removed again: the reverse leaves it."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0009_fork_depth"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TYPE ds_trim_outcome ADD VALUE IF NOT EXISTS 'keeps_history'",
            migrations.RunSQL.noop,
        ),
    ]
