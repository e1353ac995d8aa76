"""Appends to streams no subscription follows skip the subscriptions' lookup (a trigger call
and a query per append: 30 us of PostgreSQL's time, docs/benchmarks.md). Every stream starts
followed; its next append finds out. A column with a default: added without rewriting the
table."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0007_validation_version"),
    ]

    operations = [
        migrations.AddField(
            model_name="stream",
            name="followed",
            field=models.BooleanField(db_default=True, default=True),
        ),
    ]
