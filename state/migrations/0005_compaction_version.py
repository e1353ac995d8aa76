"""A compaction's first step and its deletes take the registration's version, and do nothing
once it changed (state/sql/state.sql): their old signatures go (the SQL install adds the new
ones after every migrate)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("state", "0004_compaction"),
    ]

    operations = [
        migrations.RunSQL(
            "DROP FUNCTION IF EXISTS ds_state_compaction_begin(bigint, bigint, bigint, bigint);"
            " DROP FUNCTION IF EXISTS ds_state_compact_delete(bigint, bigint[], bigint[]);",
            migrations.RunSQL.noop,
        ),
    ]
