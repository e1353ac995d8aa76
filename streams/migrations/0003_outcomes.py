"""Write outcomes become ENUM types (streams/store/outcomes.py), so the database refuses any
value outside the vocabulary Python maps; the functions returning them are dropped here and
installed again from functions.sql after the migration. A table records which SQL install the
database holds, checked by every server process at start-up (streams.store.schema)."""

from django.db import migrations

CREATE_OUTCOMES = """
CREATE TYPE ds_create_outcome AS ENUM (
    'created', 'exists', 'conflict', 'source_not_found', 'source_gone',
    'content_type_mismatch', 'fork_offset_invalid', 'sub_offset_invalid', 'too_large'
);
CREATE TYPE ds_append_outcome AS ENUM (
    'appended', 'duplicate', 'already_closed', 'not_found', 'gone', 'stale_epoch',
    'epoch_seq_not_zero', 'sequence_gap', 'stream_closed', 'content_type_mismatch',
    'stream_seq_regression', 'too_large', 'validation_stale'
);
CREATE TYPE ds_delete_outcome AS ENUM ('deleted', 'soft_deleted', 'not_found', 'gone');
DROP FUNCTION IF EXISTS ds_delete(text);
DROP FUNCTION IF EXISTS ds_create(text, text, bigint, timestamptz, boolean, bytea[], bigint,
                                  text, bigint, bigint, bigint, text);
DROP FUNCTION IF EXISTS ds_append(text, jsonb, int[], int[], bytea, bigint);
CREATE TABLE ds_sql_install (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    digest text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now()
);
"""

DROP_OUTCOMES = """
DROP TABLE ds_sql_install;
DROP FUNCTION IF EXISTS ds_delete(text);
DROP FUNCTION IF EXISTS ds_create(text, text, bigint, timestamptz, boolean, bytea[], bigint,
                                  text, bigint, bigint, bigint, text);
DROP FUNCTION IF EXISTS ds_append(text, jsonb, int[], int[], bytea, bigint);
DROP TYPE ds_create_outcome;
DROP TYPE ds_append_outcome;
DROP TYPE ds_delete_outcome;
"""


class Migration(migrations.Migration):
    dependencies = [("streams", "0002_created_by")]

    operations = [migrations.RunSQL(CREATE_OUTCOMES, DROP_OUTCOMES)]
