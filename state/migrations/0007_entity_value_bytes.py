"""Each entity's value size, kept by PostgreSQL as the value is written (the length of its JSON
text): a page of the state API, and the console's state page, judge what they would read
without reading it (probe 10b, and its review: measuring ``octet_length(value::text)`` at read
time unpacked every value of the page, a second per refused page of 100 values of 2 MB)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("state", "0006_registry_compacts"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE ds_entity ADD COLUMN value_bytes bigint"
            " GENERATED ALWAYS AS (octet_length(value::text)) STORED",
            "ALTER TABLE ds_entity DROP COLUMN value_bytes",
        ),
    ]
