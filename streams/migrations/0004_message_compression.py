"""Large messages are compressed with lz4 in their TOAST storage (docs/decisions.md): a MiB of
compressible data is written (and WAL-logged) as much less, and lz4 finds out fast when data does
not compress. Messages under ~2 kB are never compressed (stored inline as before). Only values
written from now on are affected. A server built without lz4 keeps the uncompressed storage."""

from django.db import migrations

COMPRESS = """
DO $$
BEGIN
    ALTER TABLE ds_message ALTER COLUMN data SET COMPRESSION lz4;
    ALTER TABLE ds_message ALTER COLUMN data SET STORAGE EXTENDED;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available: messages stay uncompressed';
END
$$;
"""

UNCOMPRESSED = """
ALTER TABLE ds_message ALTER COLUMN data SET STORAGE EXTERNAL;
ALTER TABLE ds_message ALTER COLUMN data SET COMPRESSION DEFAULT;
"""


class Migration(migrations.Migration):
    dependencies = [("streams", "0003_outcomes")]

    operations = [migrations.RunSQL(COMPRESS, UNCOMPRESSED)]
