-- State Protocol in the database (installed after streams/store/sql/, replacing its hooks).
--
-- * A registered state stream's entities are materialized from its messages by
--   ds_state_catch_up, in stream order and exactly once: each run applies the messages after
--   `materialized_seq` and advances it in the same transaction, under the registration's row
--   lock. Server processes run it right after appends commit (state/live.py), off the
--   append's critical section, and the state API runs it before answering, so an acknowledged
--   append is always reflected there (read-your-writes). Events reaching this code were
--   validated before their append (state/validation.py); the Python rebuild
--   (state/materializer.py) handles history that predates a registration.
-- * Every stream create and delete is recorded in the __registry__ stream, as a State Protocol
--   event, in the same transaction (and materialized at once: one small event). The registry
--   row is always the LAST row a transaction locks, so these records cannot deadlock with the
--   stream locks taken before them.

-- STABLE, as to_char is: a function declared IMMUTABLE over a stable body is never inlined,
-- and called on its own it cost 21 us (twice per create and delete, docs/benchmarks.md).
CREATE OR REPLACE FUNCTION ds_rfc3339(p_moment timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT to_char(p_moment AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$$;

-- Apply messages [p_from_seq, p_to_seq) of a registered stream's own rows to its entities:
-- only events after the last reset count (a reset clears the state), and per (type, key) the
-- last change wins: deleted, or set to its value with the offset of the event.
-- The last change per key is collected into arrays first, then upserted in one statement and
-- deleted key by key through the unique index: a join of the deletes against ds_entity is
-- planned from stale row estimates (a stream's entities grow quickly) and can turn into a
-- scan of every entity of the stream per append.
CREATE OR REPLACE FUNCTION ds_state_apply(p_stream_id bigint, p_from_seq bigint, p_to_seq bigint)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_reset bigint;
    v_from bigint := p_from_seq;
    v_to_pos bigint;
    v_types text[];
    v_keys text[];
    v_deleted boolean[];
    v_values jsonb[];
    v_offsets text[];
    i int;
BEGIN
    IF p_to_seq <= p_from_seq THEN
        RETURN;
    END IF;
    SELECT max(m.seq) INTO v_reset FROM ds_message AS m
     WHERE m.stream_id = p_stream_id AND m.seq >= p_from_seq AND m.seq < p_to_seq
       AND position('"reset"'::bytea IN m.data) > 0
       AND convert_from(m.data, 'UTF8')::jsonb -> 'headers' ->> 'control' = 'reset';
    IF v_reset IS NOT NULL THEN
        DELETE FROM ds_entity WHERE stream_id = p_stream_id;
        v_from := v_reset + 1;
    END IF;

    SELECT array_agg(l.t), array_agg(l.k), array_agg(l.op = 'delete'),
           array_agg(coalesce(l.v, 'null'::jsonb)),
           array_agg(ds_offset(l.seq, l.pos))
      INTO v_types, v_keys, v_deleted, v_values, v_offsets
      FROM (
        SELECT DISTINCT ON (e ->> 'type', e ->> 'key')
               e ->> 'type' AS t, e ->> 'key' AS k, e -> 'headers' ->> 'operation' AS op,
               e -> 'value' AS v, seq, pos
          FROM (SELECT m.seq, m.pos, convert_from(m.data, 'UTF8')::jsonb AS e
                  FROM ds_message AS m
                 WHERE m.stream_id = p_stream_id AND m.seq >= v_from AND m.seq < p_to_seq
                OFFSET 0  -- parse each event once, not once per use of `e`
               ) AS events
         WHERE e -> 'headers' ? 'operation'
         ORDER BY e ->> 'type', e ->> 'key', seq DESC
      ) AS l;

    IF v_types IS NOT NULL THEN
        INSERT INTO ds_entity (stream_id, type, key, value, event_offset)
        SELECT p_stream_id, u.t, u.k, u.v, u.o
          FROM unnest(v_types, v_keys, v_deleted, v_values, v_offsets) AS u(t, k, d, v, o)
         WHERE NOT u.d
        ON CONFLICT ON CONSTRAINT ds_entity_identity
        DO UPDATE SET value = excluded.value, event_offset = excluded.event_offset;
        FOR i IN 1..array_length(v_types, 1) LOOP
            IF v_deleted[i] THEN
                DELETE FROM ds_entity
                 WHERE stream_id = p_stream_id AND type = v_types[i] AND key = v_keys[i];
            END IF;
        END LOOP;
    END IF;

    SELECT m.pos + octet_length(m.data) INTO v_to_pos FROM ds_message AS m
     WHERE m.stream_id = p_stream_id AND m.seq = p_to_seq - 1;
    UPDATE ds_state_stream
       SET materialized_seq = p_to_seq, materialized_pos = coalesce(v_to_pos, materialized_pos)
     WHERE stream_id = p_stream_id;
END;
$$;

-- The registry's event for a stream that appeared (insert) or disappeared (delete).
CREATE OR REPLACE FUNCTION ds_registry_event(s ds_stream, p_operation text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_strip_nulls(jsonb_build_object(
        'type', 'stream',
        'key', s.path,
        'value', CASE WHEN p_operation = 'insert' THEN jsonb_build_object(
            'path', s.path,
            'contentType', s.content_type,
            'createdAt', ds_rfc3339(s.created_at)) END,
        'headers', jsonb_build_object('operation', p_operation, 'timestamp', ds_rfc3339(now()))
    ))
$$;

-- Append one event to __registry__ (and materialize it: the registry is a state stream). The
-- event is one this file built (ds_registry_event: never a reset), so it is applied directly,
-- as ds_state_apply would apply it: every create and delete pays this, and the general path
-- costs several times more.
CREATE OR REPLACE FUNCTION ds_registry_append(p_event jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r ds_stream;
    v_data bytea := convert_to(p_event::text, 'UTF8');
BEGIN
    SELECT * INTO r FROM ds_stream WHERE path = '__registry__' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
    VALUES (r.id, r.next_seq, r.next_pos, v_data, true);
    IF p_event -> 'headers' ->> 'operation' = 'delete' THEN
        DELETE FROM ds_entity
         WHERE stream_id = r.id AND type = p_event ->> 'type' AND key = p_event ->> 'key';
    ELSE
        INSERT INTO ds_entity (stream_id, type, key, value, event_offset)
        VALUES (r.id, p_event ->> 'type', p_event ->> 'key',
                coalesce(p_event -> 'value', 'null'::jsonb), ds_offset(r.next_seq, r.next_pos))
        ON CONFLICT ON CONSTRAINT ds_entity_identity
        DO UPDATE SET value = excluded.value, event_offset = excluded.event_offset;
    END IF;
    UPDATE ds_state_stream
       SET materialized_seq = r.next_seq + 1, materialized_pos = r.next_pos + octet_length(v_data)
     WHERE stream_id = r.id;
    UPDATE ds_stream
       SET next_seq = r.next_seq + 1, next_pos = r.next_pos + octet_length(v_data)
     WHERE id = r.id;
    -- As ds_append: only while some process follows the registry (streams.live).
    IF r.watched_until > now() THEN
        PERFORM pg_notify('ds_streams', ds_notify_payload(
            r, r.next_seq + 1, false, ARRAY[octet_length(v_data)], v_data, true));
    END IF;
END;
$$;

-- Several insert events in one append to __registry__ (ds_hook_created_batch: a batch of
-- creates), as ds_registry_append would append them one after another, with one lock, one
-- statement per table and one update of the registry's row instead of one each.
CREATE OR REPLACE FUNCTION ds_registry_append_inserts(p_events jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    r ds_stream;
    v_count int;
    v_bytes bigint;
    v_lengths int[];
    v_data bytea;
BEGIN
    IF cardinality(p_events) = 0 THEN
        RETURN;  -- no lock on the registry: nothing it lists was created
    END IF;
    SELECT * INTO r FROM ds_stream WHERE path = '__registry__' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    WITH e AS (
        SELECT r.next_seq + u.o - 1 AS seq,
               r.next_pos + sum(octet_length(u.d)) OVER (ORDER BY u.o) - octet_length(u.d) AS pos,
               u.event, u.d
          FROM (SELECT x.event, x.o, convert_to(x.event::text, 'UTF8') AS d
                  FROM unnest(p_events) WITH ORDINALITY AS x(event, o)) AS u
    ), messages AS (
        INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
        SELECT r.id, e.seq, e.pos, e.d, true FROM e
    ), entities AS (
        INSERT INTO ds_entity (stream_id, type, key, value, event_offset)
        SELECT r.id, e.event ->> 'type', e.event ->> 'key', coalesce(e.event -> 'value', 'null'),
               ds_offset(e.seq, e.pos)
          FROM e
        ON CONFLICT ON CONSTRAINT ds_entity_identity
        DO UPDATE SET value = excluded.value, event_offset = excluded.event_offset
    )
    SELECT count(*), sum(octet_length(e.d)), array_agg(octet_length(e.d) ORDER BY e.seq),
           string_agg(e.d, ''::bytea ORDER BY e.seq)
      INTO v_count, v_bytes, v_lengths, v_data
      FROM e;
    UPDATE ds_state_stream
       SET materialized_seq = r.next_seq + v_count, materialized_pos = r.next_pos + v_bytes
     WHERE stream_id = r.id;
    UPDATE ds_stream
       SET next_seq = r.next_seq + v_count, next_pos = r.next_pos + v_bytes
     WHERE id = r.id;
    IF r.watched_until > now() THEN
        PERFORM pg_notify('ds_streams', ds_notify_payload(
            r, r.next_seq + v_count, false, v_lengths, v_data, true));
    END IF;
END;
$$;

-- Streams the registry does not list: itself, and internal streams under the reserved __ds/
-- prefix (Yjs documents' streams), which clients cannot address as streams.
CREATE OR REPLACE FUNCTION ds_registry_lists(p_path text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_path <> '__registry__' AND NOT starts_with(p_path, '__ds/')
$$;

CREATE OR REPLACE FUNCTION ds_hook_created(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF ds_registry_lists(s.path) THEN
        PERFORM ds_registry_append(ds_registry_event(s, 'insert'));
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION ds_hook_created_batch(p_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ds_registry_append_inserts(ARRAY(
        SELECT ds_registry_event(t, 'insert')
          FROM unnest(p_ids) WITH ORDINALITY AS u(id, o) JOIN ds_stream AS t ON t.id = u.id
         WHERE ds_registry_lists(t.path)
         ORDER BY u.o));
END;
$$;

-- A stream's state goes with it (soft delete included: clients no longer see the stream).
CREATE OR REPLACE FUNCTION ds_hook_deleted(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM ds_entity WHERE stream_id = s.id;
    DELETE FROM ds_state_stream WHERE stream_id = s.id;
    IF ds_registry_lists(s.path) THEN
        PERFORM ds_registry_append(ds_registry_event(s, 'delete'));
    END IF;
END;
$$;

-- Bring a state stream's entities up to its tail, at most p_limit messages per call (NULL:
-- all). p_wait: wait for a concurrent run to finish (readers who need their writes), or skip
-- the stream when one is running (background runs). Returns the messages applied.
CREATE OR REPLACE FUNCTION ds_state_catch_up(p_stream_id bigint, p_limit bigint, p_wait boolean)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r ds_state_stream;
    v_tail bigint;
    v_to bigint;
BEGIN
    -- Nothing behind (the usual case for a read): answer without taking the row lock, which
    -- would queue concurrent readers on one row.
    IF EXISTS (SELECT 1 FROM ds_state_stream AS t JOIN ds_stream AS s ON s.id = t.stream_id
                WHERE t.stream_id = p_stream_id AND t.materialized_seq >= s.next_seq) THEN
        RETURN 0;
    END IF;
    IF p_wait THEN
        SELECT * INTO r FROM ds_state_stream WHERE stream_id = p_stream_id FOR UPDATE;
    ELSE
        SELECT * INTO r FROM ds_state_stream WHERE stream_id = p_stream_id
           FOR UPDATE SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT next_seq INTO v_tail FROM ds_stream WHERE id = p_stream_id;
    v_to := CASE WHEN p_limit IS NULL THEN v_tail
                 ELSE least(v_tail, r.materialized_seq + p_limit) END;
    IF v_to <= r.materialized_seq THEN
        RETURN 0;
    END IF;
    BEGIN
        PERFORM ds_state_apply(p_stream_id, r.materialized_seq, v_to);
    EXCEPTION WHEN others THEN
        IF ds_state_failure_passes(SQLSTATE) THEN
            RAISE;
        END IF;
        -- An event PostgreSQL cannot store got past validation: never let it block the
        -- stream. Apply the range one event at a time, skipping and recording failures.
        PERFORM ds_state_apply_each(p_stream_id, r.materialized_seq, v_to);
    END;
    RETURN v_to - r.materialized_seq;
END;
$$;

-- Whether a failure of applying events is the database's state, not the events' (a lock or
-- statement timeout, a conflict, resources or the connection): the run fails and is tried
-- again, where taking the event for invalid skipped it for good, its entity never set (probe
-- 10l: one entity row held for 35 s lost an acknowledged update).
CREATE OR REPLACE FUNCTION ds_state_failure_passes(p_sqlstate text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_sqlstate IN ('55P03', '57014', '40001', '40P01', '25P03')
        OR left(p_sqlstate, 2) IN ('08', '53', '57')
$$;

CREATE OR REPLACE FUNCTION ds_state_apply_each(
    p_stream_id bigint, p_from_seq bigint, p_to_seq bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    m record;
BEGIN
    FOR m IN SELECT seq, pos, octet_length(data) AS size FROM ds_message
              WHERE stream_id = p_stream_id AND seq >= p_from_seq AND seq < p_to_seq
              ORDER BY seq
    LOOP
        BEGIN
            PERFORM ds_state_apply(p_stream_id, m.seq, m.seq + 1);
        EXCEPTION WHEN others THEN
            IF ds_state_failure_passes(SQLSTATE) THEN
                RAISE;
            END IF;
            UPDATE ds_state_stream
               SET materialized_seq = m.seq + 1, materialized_pos = m.pos + m.size,
                   invalid_events = invalid_events + 1,
                   last_error = 'event at offset ' || ds_offset(m.seq, m.pos) || ': '
                                || SQLERRM
             WHERE stream_id = p_stream_id;
        END;
    END LOOP;
END;
$$;

-- State streams whose entities are behind their tail (for the periodic sweep).
CREATE OR REPLACE FUNCTION ds_state_lagging(p_limit int) RETURNS SETOF bigint
LANGUAGE sql STABLE AS $$
    SELECT r.stream_id FROM ds_state_stream AS r JOIN ds_stream AS s ON s.id = r.stream_id
     WHERE r.materialized_seq < s.next_seq
     ORDER BY s.next_seq - r.materialized_seq DESC
     LIMIT p_limit
$$;

-- A registered stream's appends must have passed validation under its registration's version
-- (state/validation.py): ds_stream.validation_version, which the write path reads with the row
-- it locks, follows the registration whoever writes it (the ORM, SQL). Registering and
-- unregistering lock the stream row first (state/services.py), so this takes no new lock.
CREATE OR REPLACE FUNCTION ds_state_version_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND OLD.stream_id <> NEW.stream_id) THEN
        UPDATE ds_stream SET validation_version = NULL
         WHERE id = OLD.stream_id AND validation_version IS NOT NULL;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        UPDATE ds_stream SET validation_version = NEW.version
         WHERE id = NEW.stream_id AND validation_version IS DISTINCT FROM NEW.version;
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS ds_state_version_changed ON ds_state_stream;
CREATE TRIGGER ds_state_version_changed
    AFTER INSERT OR DELETE OR UPDATE OF version, stream_id ON ds_state_stream
    FOR EACH ROW EXECUTE FUNCTION ds_state_version_changed();

-- Registrations made before the column existed (this file runs after every migrate).
UPDATE ds_stream AS s SET validation_version = r.version
  FROM ds_state_stream AS r
 WHERE r.stream_id = s.id AND s.validation_version IS DISTINCT FROM r.version;

-- Retention (streams/store/sql/retention.sql). A registered state stream keeps its whole
-- history unless it asks otherwise: the server-wide default retention would silently drop
-- state that clients reading from -1 need (it compacts instead: state/compaction.py).
-- tablesync.sql, installed after this, replaces it with one that keeps published streams too.
CREATE OR REPLACE FUNCTION ds_hook_keeps_history(p_stream_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM ds_state_stream WHERE stream_id = p_stream_id);
END;
$$;

-- Before a state stream's start moves forward, its entities take in every event they have
-- not yet, so the materialized state never misses one (the trim holds the stream's lock: no
-- append can slip in between).
CREATE OR REPLACE FUNCTION ds_hook_trimming(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ds_state_catch_up(s.id, NULL, true);
END;
$$;

-- A compacted state stream's marks (its time index, retention.sql) are needed for its
-- tombstone period: deletes are dropped once older than that.
CREATE OR REPLACE FUNCTION ds_hook_mark_horizon(s ds_stream) RETURNS double precision
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT r.tombstone_seconds FROM ds_state_stream AS r
             WHERE r.stream_id = s.id AND r.compaction);
END;
$$;

-- Compaction of registered state streams (state/compaction.py; docs/gaps.md, Retention).
--
-- Within the compacted range [floor, horizon) of a stream's own rows, only what a reader needs
-- to reach the state at the horizon stays: the last reset, and after it the latest change
-- event of each (type, key), unless that is a delete older than the tombstone period. Each
-- change replaces or removes its entity whole (STATE-PROTOCOL.md 6), so a reader from -1, and
-- a reader resuming from any offset, materializes exactly the state it would have from the
-- full history; kept events keep their offsets. The horizon is the materialized offset (the
-- server's own state already reflects everything before it); the floor keeps what forks read
-- exact. The range is judged on its own, not against later events: a fork made at or after
-- the horizon inherits an exact prefix.

-- A stored message as a State Event, or NULL when PostgreSQL cannot read it as jsonb: a \u0000
-- escape or an unpaired surrogate, stored before the stream was registered (appends to state
-- streams refuse them; one such message failed every compaction sweep, found by a probe).
-- Only messages with a \u escape take the slow way (an exception block).
CREATE OR REPLACE FUNCTION ds_state_event_or_null(p_data bytea) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN convert_from(p_data, 'UTF8')::jsonb;
EXCEPTION WHEN untranslatable_character OR invalid_text_representation
               OR character_not_in_repertoire THEN
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION ds_state_event(p_data bytea) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN position('\x5c75'::bytea IN p_data) = 0
                THEN convert_from(p_data, 'UTF8')::jsonb
                ELSE ds_state_event_or_null(p_data) END
$$;

-- The plan: the events to keep in [floor, horizon), sorted; the highest delete dropped for
-- its age (readers resuming before it would miss it: offsets up to it become 410). Deletes
-- count as old when appended before the newest mark at least p_tombstone_seconds old (0: every
-- delete). Reads only: no lock. Run in one snapshot (REPEATABLE READ: state/compaction.py), so
-- the entities are exactly the state at the horizon.
--
-- Which change of a key is its latest is the materialized state's to say, not the messages':
-- history stored before a registration holds events the materializer skipped (an unknown
-- operation, a key that is not a string, a value its schema refuses), and the latest of a
-- key's messages may be one of those (found by a probe: the valid events were deleted and the
-- skipped ones kept, so a rebuild lost the entities). So a live entity keeps the event its
-- offset names; a key with no entity keeps its latest valid delete (ds_state_delete_is_valid),
-- unless old, for readers resuming before it; every other change goes. Messages PostgreSQL
-- cannot read are kept as they are.
-- Whether a State Event's headers.timestamp is one parse_event accepts (state/core/events.py:
-- RFC 3339's form, then a date and time that exist, :60 seconds allowed, an offset under a
-- day). A delete with a timestamp it refuses (2026-02-30) is skipped; kept in place of the
-- valid delete before it, a reader resuming between the two kept the entity (found by review).
CREATE OR REPLACE FUNCTION ds_state_timestamp_is_valid(p_value text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
DECLARE
    m text[];
BEGIN
    m := regexp_match(p_value, '^([0-9]{4}-[0-9]{2}-[0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})'
                               '(\.[0-9]+)?([Zz]|[+-]([0-9]{2}):([0-9]{2}))$');
    IF m IS NULL OR m[2]::int > 23 OR m[3]::int > 59 OR m[4]::int > 60
       OR (m[7] IS NOT NULL AND m[7]::int * 60 + m[8]::int >= 1440) THEN
        RETURN false;
    END IF;
    PERFORM m[1]::date;  -- the day exists (and its year is 1 or later)
    RETURN true;
EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format THEN
    RETURN false;
END;
$$;

-- Whether a delete is one the materializer applies (state.core.events.parse_event, for a
-- delete: no value to check against a schema): type and key non-empty strings, no control
-- header, txid absent or a non-empty string, timestamp absent or one parse_event accepts.
CREATE OR REPLACE FUNCTION ds_state_delete_is_valid(e jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_typeof(e -> 'type') = 'string' AND e ->> 'type' <> ''
       AND jsonb_typeof(e -> 'key') = 'string' AND e ->> 'key' <> ''
       AND NOT e -> 'headers' ? 'control'
       AND coalesce(jsonb_typeof(e -> 'headers' -> 'txid') = 'string'
                    AND e -> 'headers' ->> 'txid' <> '', NOT e -> 'headers' ? 'txid')
       AND coalesce(jsonb_typeof(e -> 'headers' -> 'timestamp') = 'string'
                    AND ds_state_timestamp_is_valid(e -> 'headers' ->> 'timestamp'),
                    NOT e -> 'headers' ? 'timestamp')
$$;

-- Whether an event is a reset the materializer applies (parse_event): the control alone, an
-- offset absent or a string an offset can be. One with an operation beside it is skipped, and
-- taken for a reset it would have dropped every event before it.
CREATE OR REPLACE FUNCTION ds_state_reset_is_valid(e jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT e -> 'headers' ->> 'control' = 'reset'
       AND jsonb_typeof(e -> 'headers' -> 'control') = 'string'
       AND NOT e -> 'headers' ? 'operation'
       AND coalesce(jsonb_typeof(e -> 'headers' -> 'offset') = 'string'
                    AND e -> 'headers' ->> 'offset' <> ''
                    AND e -> 'headers' ->> 'offset' !~ '[,&=?/]',
                    NOT e -> 'headers' ? 'offset')
$$;

CREATE OR REPLACE FUNCTION ds_state_compaction_plan(p_stream_id bigint, p_tombstone_seconds bigint)
RETURNS TABLE (horizon bigint, floor bigint, keep bigint[], dropped_delete bigint)
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    s ds_stream;
    v_reset bigint;
    v_from bigint;
    v_tombstones bigint;
BEGIN
    SELECT * INTO s FROM ds_stream AS t WHERE t.id = p_stream_id AND t.deleted_at IS NULL;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT least(r.materialized_seq, s.next_seq) INTO horizon
      FROM ds_state_stream AS r WHERE r.stream_id = p_stream_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    floor := greatest(coalesce(s.fork_seq, 0), s.first_seq,
                      coalesce((ds_fork_reads(s.id)).highest, 0));
    keep := '{}';
    IF horizon <= floor THEN
        RETURN NEXT;
        RETURN;
    END IF;
    v_tombstones := CASE WHEN p_tombstone_seconds = 0 THEN horizon
                         ELSE coalesce((ds_mark_before(s, p_tombstone_seconds)).seq, -1) END;
    SELECT max(m.seq) INTO v_reset FROM ds_message AS m
     WHERE m.stream_id = s.id AND m.seq >= floor AND m.seq < horizon
       AND position('"reset"'::bytea IN m.data) > 0
       AND ds_state_reset_is_valid(ds_state_event(m.data));
    v_from := coalesce(v_reset + 1, floor);
    WITH ev AS MATERIALIZED (  -- parse each event once, not once per use of `e`
        SELECT m.seq, ds_state_event(m.data) AS e FROM ds_message AS m
         WHERE m.stream_id = s.id AND m.seq >= v_from AND m.seq < horizon
    ), changes AS (
        SELECT ev.seq, ev.e, ev.e -> 'headers' ->> 'operation' AS op, x.seq AS live_seq
          FROM ev LEFT JOIN LATERAL (
            SELECT split_part(n.event_offset, '_', 1)::bigint AS seq FROM ds_entity AS n
             WHERE n.stream_id = s.id AND n.type = ev.e ->> 'type' AND n.key = ev.e ->> 'key'
          ) AS x ON true
         WHERE ev.e -> 'headers' ? 'operation'
    ), deletes AS (
        SELECT DISTINCT ON (c.e ->> 'type', c.e ->> 'key') c.seq FROM changes AS c
         WHERE c.live_seq IS NULL AND c.op = 'delete' AND ds_state_delete_is_valid(c.e)
         ORDER BY c.e ->> 'type', c.e ->> 'key', c.seq DESC
    )
    SELECT coalesce(array_agg(k.seq ORDER BY k.seq) FILTER (WHERE k.kept), '{}'),
           max(k.seq) FILTER (WHERE NOT k.kept)
      INTO keep, dropped_delete
      FROM (
        SELECT ev.seq, true AS kept FROM ev WHERE ev.e IS NULL
        UNION ALL
        SELECT c.seq, true FROM changes AS c WHERE c.live_seq = c.seq
        UNION ALL
        SELECT d.seq, d.seq >= v_tombstones FROM deletes AS d
      ) AS k;
    IF v_reset IS NOT NULL THEN
        keep := v_reset || keep;
    END IF;
    RETURN NEXT;
END;
$$;

-- Before any row goes: under the stream's row lock (briefly), publish that rows below the
-- horizon may have gaps (reads continue at the next kept event; forks there are refused) and
-- from where readers may resume. False, and nothing changes, when a fork made since the plan
-- reads rows above its floor: the stream is compacted another time.
CREATE OR REPLACE FUNCTION ds_state_compaction_begin(
    p_stream_id bigint, p_horizon bigint, p_floor bigint, p_dropped_delete bigint,
    p_version bigint
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
BEGIN
    SELECT * INTO s FROM ds_stream WHERE id = p_stream_id AND deleted_at IS NULL FOR UPDATE;
    IF NOT FOUND OR coalesce((ds_fork_reads(s.id)).highest, 0) > p_floor
       OR NOT ds_state_registered(p_stream_id, p_version) THEN
        RETURN false;
    END IF;
    UPDATE ds_stream
       SET compacted_seq = greatest(compacted_seq, p_horizon),
           resume_seq = greatest(resume_seq, coalesce(p_dropped_delete + 1, 0))
     WHERE id = s.id;
    RETURN true;
END;
$$;

-- Delete compacted events: the rows of the stream in each range [p_lo[i], p_hi[i]) (the gaps
-- between kept events of one batch), in the caller's short transaction, without the stream's
-- lock. Returns the rows and bytes deleted.
-- Deletes nothing, and returns -1, once the registration the plan was made under is gone: a
-- registration made since (other schemas) may take an event the plan deletes for its state
-- (found by review). The registration's row is share-locked until the deletes commit, so a new
-- registration waits for them, and judges what is left.
CREATE OR REPLACE FUNCTION ds_state_compact_delete(
    p_stream_id bigint, p_lo bigint[], p_hi bigint[], p_version bigint,
    OUT deleted bigint, OUT bytes bigint
)
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ds_state_registered(p_stream_id, p_version) THEN
        deleted := -1;
        bytes := 0;
        RETURN;
    END IF;
    WITH gone AS (
        DELETE FROM ds_message AS m
         USING unnest(p_lo, p_hi) AS r(lo, hi)
         WHERE m.stream_id = p_stream_id AND m.seq >= r.lo AND m.seq < r.hi
        RETURNING octet_length(m.data) AS size
    )
    SELECT count(*), coalesce(sum(size), 0)::bigint INTO deleted, bytes FROM gone;
END;
$$;

-- Whether the stream is registered still under p_version, its registration's row share-locked.
CREATE OR REPLACE FUNCTION ds_state_registered(p_stream_id bigint, p_version bigint)
RETURNS boolean
LANGUAGE sql AS $$
    SELECT EXISTS (SELECT 1 FROM ds_state_stream
                    WHERE stream_id = p_stream_id AND version = p_version FOR SHARE)
$$;

-- After the deletes: account for them.
CREATE OR REPLACE FUNCTION ds_state_compaction_end(
    p_stream_id bigint, p_events bigint, p_bytes bigint
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE ds_stream SET compacted_bytes = compacted_bytes + p_bytes WHERE id = p_stream_id;
    UPDATE ds_state_stream
       SET compacted_at = now(), compacted_events = compacted_events + p_events
     WHERE stream_id = p_stream_id;
END;
$$;

-- The compaction sweep: mark every compacted state stream in its time index (for its
-- tombstone period), and list those with at least p_min_events materialized since their last
-- compaction.
CREATE OR REPLACE FUNCTION ds_state_compaction_due(
    p_min_events bigint, p_mark_interval double precision
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
    r ds_state_stream;
BEGIN
    FOR r IN SELECT * FROM ds_state_stream AS t WHERE t.compaction ORDER BY t.stream_id LOOP
        SELECT * INTO s FROM ds_stream WHERE id = r.stream_id AND deleted_at IS NULL;
        CONTINUE WHEN NOT FOUND;
        PERFORM ds_mark_stream(
            s, greatest(p_mark_interval, coalesce(r.tombstone_seconds, 0) / 100.0),
            greatest(coalesce(r.tombstone_seconds, 0), coalesce(s.retention_max_age, 0)));
        IF r.materialized_seq - greatest(s.compacted_seq, s.first_seq) >= p_min_events THEN
            RETURN NEXT s.id;
        END IF;
    END LOOP;
END;
$$;
