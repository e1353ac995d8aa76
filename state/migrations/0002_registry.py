"""The __registry__ stream (a registered JSON state stream) and the version sequence of
registrations. Streams that existed before are recorded in it as inserts."""

from django.db import migrations

CREATE_REGISTRY = """
CREATE SEQUENCE IF NOT EXISTS ds_state_version;

INSERT INTO ds_stream (path, content_type, created_at, accessed_at, next_seq, next_pos, closed,
                       fork_refcount)
VALUES ('__registry__', 'application/json', now(), now(), 0, 0, false, 0)
ON CONFLICT (path) DO NOTHING;

WITH registry AS (SELECT id FROM ds_stream WHERE path = '__registry__'),
existing AS (
    SELECT row_number() OVER (ORDER BY s.id) - 1 AS seq,
           convert_to(jsonb_build_object(
               'type', 'stream', 'key', s.path,
               'value', jsonb_build_object(
                   'path', s.path, 'contentType', s.content_type,
                   'createdAt', to_char(s.created_at AT TIME ZONE 'UTC',
                                        'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')),
               'headers', jsonb_build_object('operation', 'insert'))::text, 'UTF8') AS data
      FROM ds_stream AS s
     WHERE s.path <> '__registry__' AND s.deleted_at IS NULL
)
INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
SELECT registry.id, existing.seq,
       coalesce(sum(octet_length(existing.data)) OVER (
           ORDER BY existing.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0),
       existing.data, true
  FROM existing, registry;

UPDATE ds_stream AS s
   SET next_seq = tail.n, next_pos = tail.bytes
  FROM (SELECT count(*) AS n, coalesce(sum(octet_length(m.data)), 0) AS bytes
          FROM ds_message AS m JOIN ds_stream AS r ON r.id = m.stream_id
         WHERE r.path = '__registry__') AS tail
 WHERE s.path = '__registry__';

INSERT INTO ds_state_stream (stream_id, schemas, version, materialized_seq, materialized_pos,
                             invalid_events, last_error, created_at)
SELECT id, '{}', nextval('ds_state_version'), next_seq, next_pos, 0, '', now()
  FROM ds_stream WHERE path = '__registry__'
ON CONFLICT (stream_id) DO NOTHING;

-- (Offsets written out here: this migration predates ds_offset, installed after migrations.)
INSERT INTO ds_entity (stream_id, type, key, value, event_offset)
SELECT m.stream_id, 'stream', e ->> 'key', e -> 'value',
       lpad(m.seq::text, 16, '0') || '_' || lpad(m.pos::text, 16, '0')
  FROM ds_message AS m
  JOIN ds_stream AS r ON r.id = m.stream_id AND r.path = '__registry__'
  CROSS JOIN LATERAL (SELECT convert_from(m.data, 'UTF8')::jsonb AS e) AS parsed
ON CONFLICT ON CONSTRAINT ds_entity_identity DO NOTHING;
"""

DROP_REGISTRY = """
DELETE FROM ds_entity WHERE stream_id = (SELECT id FROM ds_stream WHERE path = '__registry__');
DELETE FROM ds_state_stream
 WHERE stream_id = (SELECT id FROM ds_stream WHERE path = '__registry__');
DELETE FROM ds_message WHERE stream_id = (SELECT id FROM ds_stream WHERE path = '__registry__');
DELETE FROM ds_stream WHERE path = '__registry__';
DROP SEQUENCE IF EXISTS ds_state_version;
"""


class Migration(migrations.Migration):
    dependencies = [("state", "0001_initial"), ("streams", "0001_initial")]

    operations = [migrations.RunSQL(CREATE_REGISTRY, DROP_REGISTRY)]
