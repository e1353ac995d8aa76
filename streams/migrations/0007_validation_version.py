"""The version of an append's extra validation is a column of the stream (kept by the app that
validates: state/sql), read with the row an append locks anyway, instead of a hook function
and a query of its own per append (docs/benchmarks.md). ds_append_streams takes each stream's
byte count and each message's stream: its old signature goes (functions.sql installs the new
one after every migrate), and so does the hook."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0006_watched_until"),
    ]

    operations = [
        migrations.AddField(
            model_name="stream",
            name="validation_version",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.RunSQL(
            "DROP FUNCTION IF EXISTS ds_append_streams(text[], jsonb, int[], int[], int[], bytea,"
            " bigint); DROP FUNCTION IF EXISTS ds_hook_validation_version(bigint);",
            migrations.RunSQL.noop,
        ),
    ]
