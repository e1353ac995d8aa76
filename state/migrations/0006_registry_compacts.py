"""The ``__registry__`` stream compacts, as docs/gaps.md said it did: it kept every create and
delete ever made (3,000 create-delete cycles left 6,000 events for a catalog of no streams,
all read by anyone following it from -1; probe 9a). Deletes stay for the server's tombstone
period (``DS_STATE__TOMBSTONE_SECS``), as a registration that names none keeps them."""

from django.db import migrations

REGISTRY_COMPACTS = """
UPDATE ds_state_stream SET compaction = true
 WHERE stream_id = (SELECT id FROM ds_stream WHERE path = '__registry__');
"""

REGISTRY_KEEPS_ALL = """
UPDATE ds_state_stream SET compaction = false
 WHERE stream_id = (SELECT id FROM ds_stream WHERE path = '__registry__');
"""


class Migration(migrations.Migration):
    dependencies = [
        ("state", "0005_compaction_version"),
    ]

    operations = [migrations.RunSQL(REGISTRY_COMPACTS, REGISTRY_KEEPS_ALL)]
