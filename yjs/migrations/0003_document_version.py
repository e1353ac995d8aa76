"""A Yjs document stream's validation version is its id and message count (yjs.replicas).

Each process checks a document POST against its own copy of the document, caught up to the
stream's tail, and appends with the version that copy reflects. These triggers keep a
document stream's ``validation_version`` at ``(id & 2^31-1) << 32 | (next_seq & 2^32-1)``
(``yjs.replicas.version_of``), so the store refuses (``validation_stale``) an append that
another append overtook after its check, or that was checked against a document since
deleted and created again. They fire on every stream's insert and on every append's update of
the tail; their WHEN clauses keep other streams to a prefix comparison.
"""

from django.db import migrations

IS_DOCUMENT = "starts_with({row}.path, '__ds/yjs/') AND split_part({row}.path, '/', 4) = 'docs'"
VERSION = "(({row}.id & 2147483647) << 32) | ({row}.next_seq & 4294967295)"

FORWARD = f"""
CREATE OR REPLACE FUNCTION yjs_document_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.validation_version := {VERSION.format(row="NEW")};
    RETURN NEW;
END
$$;
CREATE TRIGGER yjs_document_created BEFORE INSERT ON ds_stream FOR EACH ROW
    WHEN ({IS_DOCUMENT.format(row="NEW")})
    EXECUTE FUNCTION yjs_document_version();
CREATE TRIGGER yjs_document_appended BEFORE UPDATE OF next_seq ON ds_stream FOR EACH ROW
    WHEN (NEW.next_seq <> OLD.next_seq AND {IS_DOCUMENT.format(row="OLD")})
    EXECUTE FUNCTION yjs_document_version();
UPDATE ds_stream SET validation_version = {VERSION.format(row="ds_stream")}
 WHERE {IS_DOCUMENT.format(row="ds_stream")};
"""

BACKWARD = f"""
DROP TRIGGER IF EXISTS yjs_document_appended ON ds_stream;
DROP TRIGGER IF EXISTS yjs_document_created ON ds_stream;
DROP FUNCTION IF EXISTS yjs_document_version();
UPDATE ds_stream SET validation_version = NULL WHERE {IS_DOCUMENT.format(row="ds_stream")};
"""


class Migration(migrations.Migration):
    dependencies = [
        ("yjs", "0002_compaction_failure"),
        ("streams", "0008_followed"),
    ]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
