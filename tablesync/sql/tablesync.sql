-- Tables as streams, streams as tables (tablesync/; installed after the streams and state SQL).
--
-- Publishing a table: triggers on the table capture each statement's changes, as State Protocol
-- change events, into ds_tablesync_pending (one row per statement, UNLOGGED: it never outlives
-- its transaction). A deferred constraint trigger on that table fires when the transaction
-- commits, and appends everything the transaction captured through ds_append, the write path
-- clients use (offsets, limits, notifications, state validation versions). So:
--   * a rolled-back change never reaches the stream, a committed one always does, once: the
--     append is part of the transaction;
--   * streams are locked only while the transaction commits, never while its statements run,
--     and appends land in commit order (the stream lock is held until the commit ends);
--   * a bulk statement is one capture (transition tables, not a trigger call per row), and its
--     events are built before the stream is locked; under the lock only the rows are written.
--
-- Sinking a stream: ds_sink_run applies the messages after the sink's position to its table,
-- through a mapping of JSON fields to columns, in one transaction that also advances the
-- position (exactly once, in order). A range that fails on data (SQLSTATE classes 22 and 23) is
-- split in halves until the failing messages are alone; those are recorded in ds_sink_error and
-- skipped. Any other failure (the table dropped, a permission missing) fails the run, which the
-- server retries (tablesync/runner.py).

-- ===== Publishing =====

-- Events are written as JSON text directly (to_json and concatenation): building jsonb values
-- and printing them cost about four times as much per row (measured). Rows are turned into JSON
-- once each (to_json of the row); the usual key (one column) and value (every column) are
-- plain expressions in ds_tablesync_capture, these functions the general case.

-- The change event's key: the primary key's value as text, or for a composite key the JSON
-- array of its values (docs/gaps.md).
CREATE OR REPLACE FUNCTION ds_tablesync_key(p_row json, p_keys text[]) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN cardinality(p_keys) = 1 THEN p_row ->> p_keys[1]
           ELSE (SELECT json_agg(p_row -> u.k ORDER BY u.o)
                   FROM unnest(p_keys) WITH ORDINALITY AS u(k, o))::text END
$$;

-- The change event's value as JSON text: the row, or only the published columns.
CREATE OR REPLACE FUNCTION ds_tablesync_value(p_row json, p_columns text[]) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_columns IS NULL THEN p_row::text
           ELSE (SELECT coalesce(json_object_agg(c, p_row -> c), '{}')
                   FROM unnest(p_columns) AS c)::text END
$$;

-- A row whose key is NULL: its key columns were dropped or renamed since it was published.
-- (STABLE only so that ds_tablesync_event stays inlinable; it never returns.)
CREATE OR REPLACE FUNCTION ds_tablesync_keyless(p_type text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RAISE EXCEPTION 'a change of entity type % has no key: the published table''s key columns'
        ' changed', p_type
        USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'publish the table again (unpublish_table, then publish_table)';
END;
$$;

-- One change event (STATE-PROTOCOL.md 5.1) as stored message bytes. p_type and p_headers are
-- JSON text made once per statement (ds_tablesync_headers), p_value JSON text (NULL: a delete,
-- which has no value).
CREATE OR REPLACE FUNCTION ds_tablesync_event(
    p_type text, p_key text, p_value text, p_headers text
) RETURNS bytea
LANGUAGE sql STABLE AS $$
    SELECT convert_to('{"type":' || p_type
        || ',"key":' || to_json(coalesce(p_key, ds_tablesync_keyless(p_type)))::text
        || coalesce(',"value":' || p_value, '')
        || ',"headers":' || p_headers || '}', 'UTF8')
$$;

-- The headers of one statement's events of an operation: the transaction (STATE-PROTOCOL.md
-- 4.1: "grouping related changes") and when the statement started.
-- (The timestamp: RFC 3339 in UTC, as ds_rfc3339 writes it, through the json output of a
-- timestamp, several times cheaper than to_char.)
CREATE OR REPLACE FUNCTION ds_tablesync_headers(p_operation text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT '{"operation":' || to_json(p_operation)::text
        || ',"txid":"' || pg_current_xact_id()::text
        || '","timestamp":"' || (to_json(statement_timestamp() AT TIME ZONE 'UTC') #>> '{}')
        || 'Z"}'
$$;

-- A control event (STATE-PROTOCOL.md 5.2) as stored message bytes.
CREATE OR REPLACE FUNCTION ds_tablesync_control(p_control text) RETURNS bytea
LANGUAGE sql STABLE AS $$
    SELECT convert_to('{"headers":{"control":' || to_json(p_control)::text || '}}', 'UTF8')
$$;

-- Messages per pending row (and per append): a huge statement is appended in pieces, each well
-- under PostgreSQL's 1 GB value limit.
CREATE OR REPLACE FUNCTION ds_tablesync_chunk() RETURNS int
LANGUAGE sql IMMUTABLE AS $$ SELECT 50000 $$;

-- Stage a statement's events (one pending row) for the flush at commit.
CREATE OR REPLACE FUNCTION ds_tablesync_stage(p_publication_id bigint, p_events bytea[])
RETURNS void
-- plpgsql, not sql: an SQL function called from plpgsql is planned on every call.
LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_events) = 1 THEN
        INSERT INTO ds_tablesync_pending (publication_id, lengths, data)
        VALUES (p_publication_id, ARRAY[octet_length(p_events[1])], p_events[1]);
    ELSIF cardinality(p_events) > 1 THEN
        -- unnest yields the array in order, and the aggregates take their input in that order.
        INSERT INTO ds_tablesync_pending (publication_id, lengths, data)
        SELECT p_publication_id, array_agg(octet_length(u.m)), string_agg(u.m, ''::bytea)
          FROM unnest(p_events) AS u(m);
    END IF;
END;
$$;

-- Whether to_json turns values of this type into JSON without calling code a client may have
-- written. It looks through domains, arrays and composite types (as to_json does) to the types
-- of their values, and uses a cast to json for such a value's type when it is not built in: a
-- cast whose owner (the type's owner) wrote it, which would run with the rights of whoever
-- calls to_json, the server's in the publication trigger (SECURITY DEFINER) and the snapshot.
-- So a value's type must be built in or owned by the server's role (or a superuser), who alone
-- could give it a cast; neither changes under a statement that writes the table (ALTER TYPE ... OWNER TO
-- needs the new owner's rights).
CREATE OR REPLACE FUNCTION ds_tablesync_type_is_plain(p_type oid) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    t record;
BEGIN
    LOOP
        SELECT typtype, typbasetype, typelem, typsubscript, typrelid, typowner
          INTO t FROM pg_catalog.pg_type WHERE oid = p_type;
        IF t.typtype = 'd' THEN
            p_type := t.typbasetype;
        ELSIF t.typelem <> 0
              AND t.typsubscript = 'pg_catalog.array_subscript_handler'::pg_catalog.regproc THEN
            p_type := t.typelem;
        ELSIF t.typtype = 'c' THEN
            RETURN ds_tablesync_unplain_column(t.typrelid) IS NULL;
        ELSE
            RETURN p_type < 16384  -- FirstNormalObjectId: built in
                OR EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS r WHERE r.oid = t.typowner
                              AND (r.rolname = current_user OR r.rolsuper));
        END IF;
    END LOOP;
END;
$$;

-- The first column of a table (or composite type's relation) whose type is not plain, or NULL.
CREATE OR REPLACE FUNCTION ds_tablesync_unplain_column(p_relid oid) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT a.attname::text FROM pg_catalog.pg_attribute AS a
     WHERE a.attrelid = p_relid AND a.attnum > 0 AND NOT a.attisdropped
       AND NOT ds_tablesync_type_is_plain(a.atttypid)
     ORDER BY a.attnum LIMIT 1
$$;

-- A role other than the server's (and superusers) that may create objects in the schema these
-- functions are installed in, or NULL. Such a role could put there a function or operator that
-- PostgreSQL prefers to the built-in one an unqualified call means (an exact match of argument
-- types beats pg_catalog's generic one, whatever the search path's order: a to_json(record)
-- of its own, found by review), and the SECURITY DEFINER functions would run it with the
-- server's rights. Only the schema's owner or a superuser can grant CREATE on it, so no such
-- role can make itself one meanwhile. Group roles count (a member may SET ROLE to one); not
-- pg_database_owner, whose one member, the database's owner, is looked at in its own right.
CREATE OR REPLACE FUNCTION ds_tablesync_schema_creator() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT r.rolname::text FROM pg_catalog.pg_roles AS r
     WHERE NOT r.rolsuper
       AND r.rolname OPERATOR(pg_catalog.<>) current_user
       AND r.rolname OPERATOR(pg_catalog.<>) 'pg_database_owner'
       AND pg_catalog.has_schema_privilege(r.oid, current_schema(), 'CREATE')
     ORDER BY r.rolname LIMIT 1
$$;

-- Refuse to run table sync's functions while another role could put functions of its own where
-- theirs are resolved: called first by each function that runs with the server's rights for a
-- table's writer, before any call such a function could stand in for.
CREATE OR REPLACE FUNCTION ds_tablesync_require_trusted_schema() RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_creator text := ds_tablesync_schema_creator();
BEGIN
    IF v_creator IS NOT NULL THEN
        RAISE EXCEPTION 'role % may create objects in schema %, where table sync''s functions'
            ' run with the server''s rights', v_creator, current_schema()
            USING HINT = 'revoke CREATE on that schema from every role but the server''s,'
                ' or install the server in a schema of its own';
    END IF;
END;
$$;

-- Refuse to turn a table's rows into JSON when a column's type could run a client's cast
-- (callers check the schema first: ds_tablesync_require_trusted_schema).
CREATE OR REPLACE FUNCTION ds_tablesync_require_plain(p_relid oid) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_column text;
BEGIN
    v_column := ds_tablesync_unplain_column(p_relid);
    IF v_column IS NOT NULL THEN
        RAISE EXCEPTION 'column % of table % has a type table sync cannot publish', v_column,
            p_relid::regclass
            USING HINT = 'its values (an enum, a range or another type not built in, or one in'
                ' an array or composite) would become JSON through a cast its type''s owner may'
                ' write, with the server''s rights; use a built-in type, or a domain over one';
    END IF;
END;
$$;

-- Why a table's statements can no longer be captured whole and right, or NULL (checked when it
-- is published, and by each statement since: DDL may change any of it). It is partitioned, a
-- partition, or takes part in inheritance: a statement's triggers are those of the table it
-- names, so writes through a parent, or to a child, are not seen. Its primary key is
-- deferrable: a transaction may then hold a key in two rows at once, and the events of its
-- statements, keyed by it, cancel out (a probe's key swap left the stream without the rows the
-- table held). A column the publication names (p_columns) is gone: renamed or dropped, its
-- values would be published as null.
CREATE OR REPLACE FUNCTION ds_tablesync_unfit(p_relid oid, p_columns text[]) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN c.relkind = 'p' OR c.relispartition THEN 'it is partitioned or a partition'
        WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_inherits AS i
                      WHERE i.inhrelid = p_relid OR i.inhparent = p_relid)
            THEN 'it inherits from another table, or another inherits from it'
        WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_constraint AS k
                      WHERE k.conrelid = p_relid AND k.contype = 'p' AND k.condeferrable)
            THEN 'its primary key is deferrable'
        ELSE (SELECT 'its column ' || quote_ident(u.c) || ' is gone (renamed or dropped)'
                FROM unnest(p_columns) AS u(c)
               WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute AS a
                                  WHERE a.attrelid = p_relid AND a.attname = u.c
                                    AND a.attnum > 0 AND NOT a.attisdropped)
               LIMIT 1)
    END
    FROM pg_catalog.pg_class AS c WHERE c.oid = p_relid
$$;

-- The statement-level trigger on a published table (TG_ARGV[0]: the publication's id). It runs
-- at the end of each statement, outside any stream lock, and only stages the events; the
-- deferred ds_tablesync_flush appends them when the transaction commits. An UPDATE pairs old
-- and new rows by key: a key only in the old rows was deleted, only in the new ones inserted
-- (an update of the primary key), in both updated, unless the published value is unchanged.
-- Each row is turned into JSON once (OFFSET 0 keeps the planner from repeating to_json for
-- each use), headers once per statement.
-- SECURITY DEFINER (search_path pinned below): whoever may write the table may publish its
-- changes, without rights on the stream tables.
CREATE OR REPLACE FUNCTION ds_tablesync_capture() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    p ds_table_publication;
    v_type text;
    v_key text;
    v_insert text;
    v_update text;
    v_delete text;
    v_events bytea[] := '{}';
    v_event bytea;
    v_unfit text;
    c refcursor;
BEGIN
    PERFORM ds_tablesync_require_trusted_schema();
    SELECT * INTO p FROM ds_table_publication WHERE id = TG_ARGV[0]::bigint;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'table % has a publication trigger without a publication (id %)',
            TG_TABLE_NAME, TG_ARGV[0]
            USING HINT = 'drop the ds_tablesync_* triggers of the table, or publish it again';
    END IF;
    v_type := to_json(p.entity_type)::text;
    v_key := CASE WHEN cardinality(p.key_columns) = 1 THEN p.key_columns[1] END;
    IF TG_OP <> 'TRUNCATE' THEN
        PERFORM ds_tablesync_require_plain(TG_RELID);
    END IF;
    v_unfit := ds_tablesync_unfit(TG_RELID, p.key_columns || p.columns);
    IF v_unfit IS NOT NULL THEN
        RAISE EXCEPTION 'table % is published to a stream, and its changes can no longer be'
            ' captured right: %', TG_RELID::regclass, v_unfit
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'undo that change, or unpublish the table (manage.py unpublish_table)';
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- Every row is gone: clients clear their state (STATE-PROTOCOL.md 4.2.2).
        OPEN c FOR SELECT ds_tablesync_control('reset');
    ELSIF TG_OP = 'INSERT' THEN
        v_insert := ds_tablesync_headers('insert');
        OPEN c FOR
            SELECT ds_tablesync_event(v_type,
                       CASE WHEN v_key IS NOT NULL THEN r.j ->> v_key
                            ELSE ds_tablesync_key(r.j, p.key_columns) END,
                       CASE WHEN p.columns IS NULL THEN r.j::text
                            ELSE ds_tablesync_value(r.j, p.columns) END,
                       v_insert)
              FROM (SELECT to_json(t.*) AS j FROM ds_new AS t OFFSET 0) AS r;
    ELSIF TG_OP = 'DELETE' THEN
        v_delete := ds_tablesync_headers('delete');
        OPEN c FOR
            SELECT ds_tablesync_event(v_type,
                       CASE WHEN v_key IS NOT NULL THEN r.j ->> v_key
                            ELSE ds_tablesync_key(r.j, p.key_columns) END,
                       NULL, v_delete)
              FROM (SELECT to_json(t.*) AS j FROM ds_old AS t OFFSET 0) AS r;
    ELSE
        v_insert := ds_tablesync_headers('insert');
        v_update := ds_tablesync_headers('update');
        v_delete := ds_tablesync_headers('delete');
        OPEN c FOR
            WITH o AS MATERIALIZED (
                SELECT CASE WHEN v_key IS NOT NULL THEN r.j ->> v_key
                            ELSE ds_tablesync_key(r.j, p.key_columns) END AS k,
                       CASE WHEN p.columns IS NULL THEN r.j::text
                            ELSE ds_tablesync_value(r.j, p.columns) END AS v
                  FROM (SELECT to_json(t.*) AS j FROM ds_old AS t OFFSET 0) AS r
            ), n AS MATERIALIZED (
                SELECT CASE WHEN v_key IS NOT NULL THEN r.j ->> v_key
                            ELSE ds_tablesync_key(r.j, p.key_columns) END AS k,
                       CASE WHEN p.columns IS NULL THEN r.j::text
                            ELSE ds_tablesync_value(r.j, p.columns) END AS v
                  FROM (SELECT to_json(t.*) AS j FROM ds_new AS t OFFSET 0) AS r
            )
            SELECT ds_tablesync_event(v_type, o.k, NULL, v_delete)
              FROM o WHERE NOT EXISTS (SELECT 1 FROM n WHERE n.k = o.k)
            UNION ALL
            SELECT ds_tablesync_event(v_type, n.k, n.v,
                       CASE WHEN o.k IS NULL THEN v_insert ELSE v_update END)
              FROM n LEFT JOIN o ON o.k = n.k
             WHERE o.v IS DISTINCT FROM n.v;
    END IF;
    LOOP
        FETCH c INTO v_event;
        EXIT WHEN NOT FOUND;
        v_events := v_events || v_event;
        IF cardinality(v_events) >= ds_tablesync_chunk() THEN
            PERFORM ds_tablesync_stage(p.id, v_events);
            v_events := '{}';
        END IF;
    END LOOP;
    CLOSE c;
    PERFORM ds_tablesync_stage(p.id, v_events);
    RETURN NULL;
END;
$$;

-- Append messages for a publication, through the clients' write path; anything but an
-- accepted append fails the transaction (a committed change must reach its stream). The stream
-- is locked first, so the validation version read with it is the one ds_append sees.
CREATE OR REPLACE FUNCTION ds_tablesync_append(
    p_table text, p_stream_id bigint, p_lengths int[], p_data bytea, p_max_stream_bytes bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_path text;
    v_version bigint;
    v_outcome ds_append_outcome;
    v_count int := cardinality(p_lengths);
BEGIN
    SELECT s.path, s.validation_version INTO v_path, v_version
      FROM ds_stream AS s WHERE s.id = p_stream_id FOR UPDATE;
    SELECT a.outcome INTO v_outcome
      FROM ds_append(v_path,
                     jsonb_build_array(jsonb_build_array(
                         'application/json', false, NULL, NULL, NULL, NULL, v_count,
                         octet_length(p_data), v_version)),
                     p_lengths, array_fill(1, ARRAY[v_count]), p_data, p_max_stream_bytes) AS a;
    IF v_outcome IS DISTINCT FROM 'appended' THEN
        RAISE EXCEPTION 'table % is published to stream %, which refused its changes (%)',
            p_table, coalesce(quote_literal(v_path), 'that was deleted'),
            coalesce(v_outcome::text, 'not_found')
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'unpublish the table (manage.py unpublish_table) to write it again';
    END IF;
END;
$$;

-- The deferred constraint trigger on ds_tablesync_pending: runs as the transaction commits.
-- The first of the transaction's pending rows to fire appends them all and deletes them; the
-- others find their row gone. Streams are appended to (and so locked) in path order, the order
-- group commit locks streams in, so transactions publishing to several streams cannot deadlock.
CREATE OR REPLACE FUNCTION ds_tablesync_flush() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    w record;
BEGIN
    PERFORM ds_tablesync_require_trusted_schema();
    PERFORM 1 FROM ds_tablesync_pending WHERE id = NEW.id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    FOR w IN
        SELECT q.lengths, q.data, p.table_name, p.stream_id, p.max_stream_bytes
          FROM ds_tablesync_pending AS q
          JOIN ds_table_publication AS p ON p.id = q.publication_id
          LEFT JOIN ds_stream AS s ON s.id = p.stream_id
         WHERE q.xid = pg_current_xact_id()
         ORDER BY s.path, q.id
    LOOP
        PERFORM ds_tablesync_append(w.table_name, w.stream_id, w.lengths, w.data,
                                    w.max_stream_bytes);
    END LOOP;
    DELETE FROM ds_tablesync_pending WHERE xid = pg_current_xact_id();
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS ds_tablesync_flush ON ds_tablesync_pending;
CREATE CONSTRAINT TRIGGER ds_tablesync_flush AFTER INSERT ON ds_tablesync_pending
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ds_tablesync_flush();

-- The triggers of a publication on its table. CREATE TRIGGER locks the table against writes
-- until the publishing transaction ends, so the snapshot and the triggers meet exactly.
CREATE OR REPLACE FUNCTION ds_tablesync_attach(p_publication_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_table regclass;
BEGIN
    SELECT p.table_oid::oid::regclass INTO STRICT v_table
      FROM ds_table_publication AS p WHERE p.id = p_publication_id;
    PERFORM ds_tablesync_require_trusted_schema();
    PERFORM ds_tablesync_require_plain(v_table::oid);
    EXECUTE format('CREATE TRIGGER ds_tablesync_insert AFTER INSERT ON %s'
                   ' REFERENCING NEW TABLE AS ds_new FOR EACH STATEMENT'
                   ' EXECUTE FUNCTION ds_tablesync_capture(%L)', v_table, p_publication_id);
    EXECUTE format('CREATE TRIGGER ds_tablesync_update AFTER UPDATE ON %s'
                   ' REFERENCING OLD TABLE AS ds_old NEW TABLE AS ds_new FOR EACH STATEMENT'
                   ' EXECUTE FUNCTION ds_tablesync_capture(%L)', v_table, p_publication_id);
    EXECUTE format('CREATE TRIGGER ds_tablesync_delete AFTER DELETE ON %s'
                   ' REFERENCING OLD TABLE AS ds_old FOR EACH STATEMENT'
                   ' EXECUTE FUNCTION ds_tablesync_capture(%L)', v_table, p_publication_id);
    EXECUTE format('CREATE TRIGGER ds_tablesync_truncate AFTER TRUNCATE ON %s'
                   ' FOR EACH STATEMENT EXECUTE FUNCTION ds_tablesync_capture(%L)',
                   v_table, p_publication_id);
END;
$$;

-- Remove a publication's triggers (if its table still exists). DROP TRIGGER waits for the
-- transactions writing the table to end, so every change before the unpublish is in the
-- stream and none after.
CREATE OR REPLACE FUNCTION ds_tablesync_detach(p_table_oid bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_table regclass;
    v_trigger text;
BEGIN
    SELECT c.oid::regclass INTO v_table FROM pg_class AS c WHERE c.oid = p_table_oid::oid;
    IF v_table IS NULL THEN
        RETURN;
    END IF;
    FOREACH v_trigger IN ARRAY ARRAY['ds_tablesync_insert', 'ds_tablesync_update',
                                     'ds_tablesync_delete', 'ds_tablesync_truncate'] LOOP
        EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', v_trigger, v_table);
    END LOOP;
END;
$$;

-- Append messages accumulated for a snapshot (p_messages) and return an empty buffer.
CREATE OR REPLACE FUNCTION ds_tablesync_append_all(
    p ds_table_publication, p_messages bytea[]
) RETURNS bytea[]
LANGUAGE plpgsql AS $$
DECLARE
    v_lengths int[];
    v_data bytea;
BEGIN
    IF cardinality(p_messages) > 0 THEN
        SELECT array_agg(octet_length(u.m) ORDER BY u.o), string_agg(u.m, ''::bytea ORDER BY u.o)
          INTO v_lengths, v_data
          FROM unnest(p_messages) WITH ORDINALITY AS u(m, o);
        PERFORM ds_tablesync_append(p.table_name, p.stream_id, v_lengths, v_data,
                                    p.max_stream_bytes);
    END IF;
    RETURN '{}';
END;
$$;

-- The table's current rows as inserts, between snapshot-start and snapshot-end (after a reset
-- when the stream already holds messages), so a client reading from -1 gets the whole table.
-- Called by the publishing transaction after ds_tablesync_attach, so no write slips between
-- the snapshot and the triggers. Returns the rows.
CREATE OR REPLACE FUNCTION ds_tablesync_snapshot(p_publication_id bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    p ds_table_publication;
    v_type text;
    v_headers text := ds_tablesync_headers('insert');
    v_messages bytea[] := '{}';
    v_rows bigint := 0;
    r record;
BEGIN
    SELECT * INTO STRICT p FROM ds_table_publication WHERE id = p_publication_id;
    PERFORM ds_tablesync_require_trusted_schema();
    PERFORM ds_tablesync_require_plain(p.table_oid::oid);
    v_type := to_json(p.entity_type)::text;
    IF (SELECT s.next_seq > 0 FROM ds_stream AS s WHERE s.id = p.stream_id) THEN
        v_messages := v_messages || ds_tablesync_control('reset');
    END IF;
    v_messages := v_messages || ds_tablesync_control('snapshot-start');
    FOR r IN EXECUTE format('SELECT to_json(t.*) AS j FROM %s AS t', p.table_oid::oid::regclass) LOOP
        v_messages := v_messages || ds_tablesync_event(v_type,
            ds_tablesync_key(r.j, p.key_columns), ds_tablesync_value(r.j, p.columns), v_headers);
        v_rows := v_rows + 1;
        IF cardinality(v_messages) >= ds_tablesync_chunk() THEN
            v_messages := ds_tablesync_append_all(p, v_messages);
        END IF;
    END LOOP;
    v_messages := v_messages || ds_tablesync_control('snapshot-end');
    PERFORM ds_tablesync_append_all(p, v_messages);
    RETURN v_rows;
END;
$$;

-- Pin the search path of the SECURITY DEFINER functions to the schema they are installed in
-- (and pg_temp last), as PostgreSQL's documentation requires of such functions. Rows become
-- JSON the same way whatever the writing session's settings: timestamps with time zone in UTC,
-- intervals and floats in PostgreSQL's default output.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION ds_tablesync_capture() SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION ds_tablesync_flush() SET search_path = %I, pg_temp',
                   current_schema());
END;
$$;
ALTER FUNCTION ds_tablesync_capture()
    SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1;
ALTER FUNCTION ds_tablesync_snapshot(bigint)
    SET TimeZone = 'UTC' SET IntervalStyle = 'postgres' SET extra_float_digits = 1;

-- ===== Sinking =====

-- Refuse a message that does not fit (SQLSTATE class 22: recorded, the sink goes on). Returns
-- text so that it can stand in any CASE branch; it never returns.
CREATE OR REPLACE FUNCTION ds_sink_misfit(p_what text, p_expected text, p_value jsonb)
RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: expected %, got %', p_what, p_expected,
        coalesce(left(p_value::text, 200), 'nothing')
        USING ERRCODE = 'invalid_parameter_value';
END;
$$;

-- The message as a JSON object, or refused.
CREATE OR REPLACE FUNCTION ds_sink_object(p_value jsonb, p_what text) RETURNS jsonb
LANGUAGE sql AS $$
    SELECT CASE WHEN jsonb_typeof(p_value) = 'object' THEN p_value
                ELSE ds_sink_misfit(p_what, 'a JSON object', p_value)::jsonb END
$$;

-- What a State Protocol message asks of an upsert sink: insert, update, delete, reset, or skip
-- (another entity type, a control event other than reset). Malformed events are refused.
CREATE OR REPLACE FUNCTION ds_sink_operation(p_event jsonb, p_type text) RETURNS text
LANGUAGE sql AS $$
    SELECT CASE
        WHEN jsonb_typeof(p_event) IS DISTINCT FROM 'object'
            THEN ds_sink_misfit('the message', 'a State Protocol event (a JSON object)', p_event)
        WHEN jsonb_typeof(p_event -> 'headers') IS DISTINCT FROM 'object'
            THEN ds_sink_misfit('headers', 'an object', p_event -> 'headers')
        WHEN p_event -> 'headers' ? 'control'
            THEN CASE WHEN p_event -> 'headers' ->> 'control' = 'reset' THEN 'reset' ELSE 'skip' END
        WHEN p_type IS NOT NULL AND (p_event ->> 'type') IS DISTINCT FROM p_type THEN 'skip'
        WHEN jsonb_typeof(p_event -> 'type') IS DISTINCT FROM 'string'
            THEN ds_sink_misfit('type', 'a string', p_event -> 'type')
        WHEN jsonb_typeof(p_event -> 'key') IS DISTINCT FROM 'string'
            THEN ds_sink_misfit('key', 'a string', p_event -> 'key')
        WHEN p_event -> 'headers' ->> 'operation' IN ('insert', 'update', 'delete')
            THEN p_event -> 'headers' ->> 'operation'
        ELSE ds_sink_misfit('headers.operation', 'insert, update or delete',
                            p_event -> 'headers' -> 'operation')
    END
$$;

-- The SQL expression turning a field (a jsonb expression, NULL when absent) into a value of
-- p_type: JSON null or absent is NULL; json/jsonb columns take any JSON value; string types a
-- JSON string; other types a JSON string, number or boolean, read by the type's input function
-- (so '2025-01-15' for a date, 42 or "42" for an integer). The type has no modifier: assigning
-- to the column checks it (a varchar too long is an error, not cut).
CREATE OR REPLACE FUNCTION ds_sink_convert(p_field text, p_column text, p_type regtype)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_category "char";
    v_base regtype;
    v_cast text;
BEGIN
    IF p_type IN ('jsonb'::regtype, 'json'::regtype) THEN
        RETURN format('nullif(%s, ''null''::jsonb)::%s', p_field, p_type);
    END IF;
    SELECT t.typcategory INTO v_category FROM pg_type AS t WHERE t.oid = p_type;
    -- An explicit cast to a type with a length cuts a value without a word: to a domain over
    -- char(3) or varchar(3) (its base type's length), and to `character` and `bit`, which mean
    -- length 1 written that way ("USD" was stored as "U", found by a probe). So the value is
    -- cast to the base type without a length (bpchar and "bit" by their internal names), and
    -- the assignment to the column checks the length and the domain's constraints: a misfit
    -- is a data error, recorded and skipped. bpchar keeps blank-padded comparison and the key
    -- column's index for an upsert sink's deletes (text lost both, found by review).
    v_base := p_type;
    WHILE (SELECT t.typtype FROM pg_type AS t WHERE t.oid = v_base) = 'd' LOOP
        SELECT t.typbasetype INTO v_base FROM pg_type AS t WHERE t.oid = v_base;
    END LOOP;
    v_cast := CASE v_base WHEN 'character'::regtype THEN 'pg_catalog.bpchar'
                          WHEN 'bit'::regtype THEN 'pg_catalog."bit"'
                          ELSE v_base::text END;
    RETURN format(
        '(CASE WHEN %1$s IS NULL OR %1$s = ''null''::jsonb THEN NULL'
        ' WHEN jsonb_typeof(%1$s) IN (%2$s) THEN %1$s #>> ''{}'''
        ' ELSE ds_sink_misfit(%3$L, %4$L, %1$s) END)::%5$s',
        p_field,
        CASE WHEN v_category = 'S' THEN '''string''' ELSE '''string'', ''number'', ''boolean''' END,
        'column ' || quote_ident(p_column),
        CASE WHEN v_category = 'S' THEN 'a string' ELSE 'a string, number or boolean' END,
        v_cast);
END;
$$;

-- The statement applying messages [$2, $3) of stream $1 to a sink's table ($4: the upsert
-- sink's entity type). Identifiers are quoted (%I, regclass), paths and names are literals.
CREATE OR REPLACE FUNCTION ds_sink_statement(k ds_stream_sink) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_table text := k.table_oid::oid::regclass::text;
    v_columns text[] := '{}';
    v_fields text[] := '{}';
    v_values text[] := '{}';
    v_updates text[] := '{}';
    v_key_type regtype;
    m jsonb;
    i int := 0;
BEGIN
    FOR m IN SELECT jsonb_array_elements(k.mapping) LOOP
        i := i + 1;
        v_columns := v_columns || format('%I', m ->> 'column');
        v_fields := v_fields || format(', x.v #> %L::text[] AS f%s',
            ARRAY(SELECT jsonb_array_elements_text(m -> 'path')), i);
        v_values := v_values || ds_sink_convert('f.f' || i, m ->> 'column', (m ->> 'type')::regtype);
        v_updates := v_updates || format('%1$I = excluded.%1$I', m ->> 'column');
    END LOOP;
    IF k.offset_column IS NOT NULL THEN
        v_columns := v_columns || format('%I', k.offset_column);
        v_values := v_values || 'ds_offset(f.seq, f.pos)'::text;
        v_updates := v_updates || format('%1$I = excluded.%1$I', k.offset_column);
    END IF;
    IF k.mode = 'append' THEN
        RETURN format(
            'INSERT INTO %s (%s) SELECT %s'
            ' FROM (SELECT x.seq, x.pos%s'
            '  FROM (SELECT m.seq, m.pos,'
            '          ds_sink_object(convert_from(m.data, ''UTF8'')::jsonb, ''the message'') AS v'
            '        FROM ds_message AS m'
            '        WHERE m.stream_id = $1 AND m.seq >= $2 AND m.seq < $3'
            '        OFFSET 0) AS x'
            '  OFFSET 0) AS f'
            ' ORDER BY f.seq',
            v_table, array_to_string(v_columns, ', '), array_to_string(v_values, ', '),
            array_to_string(v_fields, ''));
    END IF;
    SELECT a.atttypid::regtype INTO STRICT v_key_type FROM pg_attribute AS a
     WHERE a.attrelid = k.table_oid::oid AND a.attname = k.key_column AND NOT a.attisdropped;
    -- Per key, the last change of the range wins (deleted, or set to its value); a reset in
    -- the range was applied before (ds_sink_apply splits ranges at resets).
    RETURN format(
        'WITH ev AS MATERIALIZED ('
        '  SELECT f.seq, f.pos, f.op, %s AS k%s'
        '  FROM (SELECT x.seq, x.pos, x.op, x.key%s'
        '    FROM (SELECT r.seq, r.pos, r.op, r.e -> ''key'' AS key,'
        '            CASE WHEN r.op <> ''delete'' THEN ds_sink_object(r.e -> ''value'', ''value'') END AS v'
        '          FROM (SELECT m.seq, m.pos, e.e, ds_sink_operation(e.e, $4) AS op'
        '                FROM ds_message AS m,'
        '                     LATERAL (SELECT convert_from(m.data, ''UTF8'')::jsonb AS e) AS e'
        '                WHERE m.stream_id = $1 AND m.seq >= $2 AND m.seq < $3'
        '                OFFSET 0) AS r'
        '          WHERE r.op IN (''insert'', ''update'', ''delete'')'
        '          OFFSET 0) AS x'
        '    OFFSET 0) AS f'
        '), latest AS (SELECT DISTINCT ON (ev.k) * FROM ev ORDER BY ev.k, ev.seq DESC'
        '), upserted AS ('
        '  INSERT INTO %s AS t (%I%s) SELECT latest.k%s FROM latest WHERE latest.op <> ''delete'''
        '  ON CONFLICT (%I) %s RETURNING 1'
        ') DELETE FROM %s AS t USING latest WHERE latest.op = ''delete'' AND t.%I = latest.k',
        ds_sink_convert('f.key', k.key_column, v_key_type),
        (SELECT string_agg(format(', %s AS c%s', u.v, u.o), '')
           FROM unnest(v_values) WITH ORDINALITY AS u(v, o)),
        array_to_string(v_fields, ''),
        v_table, k.key_column,
        (SELECT string_agg(', ' || u.c, '') FROM unnest(v_columns) AS u(c)),
        (SELECT string_agg(format(', latest.c%s', u.o), '')
           FROM unnest(v_values) WITH ORDINALITY AS u(v, o)),
        k.key_column,
        CASE WHEN cardinality(v_updates) = 0 THEN 'DO NOTHING'
             ELSE 'DO UPDATE SET ' || array_to_string(v_updates, ', ') END,
        v_table, k.key_column);
END;
$$;

-- Apply messages [p_from, p_to) with the sink's statement; an upsert sink's range is split at
-- each reset, which empties the table (STATE-PROTOCOL.md 4.2.2). All or nothing: an error
-- propagates.
CREATE OR REPLACE FUNCTION ds_sink_apply(
    k ds_stream_sink, p_statement text, p_from bigint, p_to bigint
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_from bigint := p_from;
    v_reset bigint;
BEGIN
    IF k.mode = 'upsert' THEN
        FOR v_reset IN
            SELECT m.seq FROM ds_message AS m
             WHERE m.stream_id = k.stream_id AND m.seq >= p_from AND m.seq < p_to
               AND position('"reset"'::bytea IN m.data) > 0
               AND convert_from(m.data, 'UTF8')::jsonb -> 'headers' ->> 'control' = 'reset'
             ORDER BY m.seq
        LOOP
            IF v_reset > v_from THEN
                EXECUTE p_statement USING k.stream_id, v_from, v_reset, k.entity_type;
            END IF;
            EXECUTE format('DELETE FROM %s', k.table_oid::oid::regclass);
            v_from := v_reset + 1;
        END LOOP;
    END IF;
    IF p_to > v_from THEN
        EXECUTE p_statement USING k.stream_id, v_from, p_to, k.entity_type;
    END IF;
END;
$$;

-- Apply [p_from, p_to), isolating the messages that do not fit: a range failing on data
-- (classes 22 and 23; 21, two messages of one key in an upsert's batch; 54, a value past what
-- an index or row holds) is split in halves, down to single messages, which are recorded in
-- ds_sink_error and skipped. Other errors (the table gone, a right missing) fail the run,
-- which applies nothing and is tried again. The order of everything applied is kept. Returns the errors.
-- Each try is a subtransaction: one per run when all fits, about 2 log2(n) per misfit.
CREATE OR REPLACE FUNCTION ds_sink_apply_isolating(
    k ds_stream_sink, p_statement text, p_from bigint, p_to bigint
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_state text;
    v_error text;
    v_mid bigint;
    v_message text;
    m record;
BEGIN
    BEGIN
        PERFORM ds_sink_apply(k, p_statement, p_from, p_to);
        RETURN 0;
    EXCEPTION WHEN data_exception OR integrity_constraint_violation OR cardinality_violation
              OR program_limit_exceeded THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_error = MESSAGE_TEXT;
    END;
    IF p_to - p_from > 1 THEN
        v_mid := p_from + (p_to - p_from) / 2;
        RETURN ds_sink_apply_isolating(k, p_statement, p_from, v_mid)
             + ds_sink_apply_isolating(k, p_statement, v_mid, p_to);
    END IF;
    SELECT x.seq, x.pos, x.data INTO STRICT m FROM ds_message AS x
     WHERE x.stream_id = k.stream_id AND x.seq = p_from;
    BEGIN
        v_message := left(convert_from(m.data, 'UTF8'), 4000);
    EXCEPTION WHEN others THEN
        v_message := encode(substring(m.data FROM 1 FOR 4000), 'escape');
    END;
    INSERT INTO ds_sink_error (sink_id, seq, message_offset, sqlstate, error, message)
    VALUES (k.id, m.seq, ds_offset(m.seq, m.pos), v_state, v_error, v_message);
    RETURN 1;
END;
$$;

-- Apply the next messages of a sink, at most p_limit, in one transaction with its new
-- position. Returns the messages consumed (applied or recorded as errors), or -1 when another
-- session is applying this sink (its row is locked: SKIP LOCKED, nobody waits).
CREATE OR REPLACE FUNCTION ds_sink_run(p_sink_id bigint, p_limit int) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    k ds_stream_sink;
    s ds_stream;
    v_from bigint;
    v_to bigint;
    v_pos bigint;
    v_errors bigint;
BEGIN
    SELECT * INTO k FROM ds_stream_sink WHERE id = p_sink_id FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN CASE WHEN EXISTS (SELECT 1 FROM ds_stream_sink WHERE id = p_sink_id)
                    THEN -1 ELSE 0 END;
    ELSIF k.state <> 'active' THEN
        RETURN 0;
    END IF;
    SELECT * INTO s FROM ds_stream WHERE id = k.stream_id;
    IF NOT FOUND OR s.deleted_at IS NOT NULL OR ds_is_expired(s) THEN
        UPDATE ds_stream_sink
           SET state = 'stream_gone', last_error = 'the stream was deleted', last_error_at = now()
         WHERE id = k.id;
        RETURN 0;
    END IF;
    v_from := k.applied_seq;
    v_errors := 0;
    IF v_from < s.first_seq THEN
        -- Trimmed (retention, an explicit trim) before this sink applied them: gone for every
        -- reader, and perhaps purged already. The gap is recorded once, as an error with its
        -- offsets, and the sink goes on from the stream's first retained message.
        INSERT INTO ds_sink_error (sink_id, seq, message_offset, sqlstate, error, message)
        VALUES (k.id, v_from, ds_offset(v_from, k.applied_pos), '',
                format('%s messages, from offset %s to %s, were trimmed from the stream before'
                       ' this sink applied them', s.first_seq - v_from,
                       ds_offset(v_from, k.applied_pos), ds_offset(s.first_seq, s.first_pos)),
                '');
        v_from := s.first_seq;
        v_errors := 1;
    END IF;
    v_to := least(s.next_seq, v_from + p_limit);
    IF v_to <= v_from AND v_errors = 0 THEN
        RETURN 0;
    END IF;
    IF v_to > v_from THEN
        v_errors := v_errors + ds_sink_apply_isolating(k, ds_sink_statement(k), v_from, v_to);
    END IF;
    -- Where the next message starts: compaction of a state stream leaves gaps in seq.
    v_pos := coalesce((SELECT m.pos FROM ds_message AS m
                        WHERE m.stream_id = k.stream_id AND m.seq >= v_to
                        ORDER BY m.seq LIMIT 1), s.next_pos);
    UPDATE ds_stream_sink
       SET applied_seq = v_to, applied_pos = v_pos, applied_at = now(),
           error_count = error_count + v_errors, last_error = ''
     WHERE id = k.id;
    RETURN v_to - k.applied_seq;
END;
$$;

-- A published table's stream keeps its history, as a registered state stream does (state.sql's
-- rule, which this replaces, included): its readers need the snapshot and every change since.
-- The server-wide retention default passes it by, and a client's trim is refused (ds_trim).
CREATE OR REPLACE FUNCTION ds_hook_keeps_history(p_stream_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM ds_state_stream WHERE stream_id = p_stream_id)
        OR EXISTS (SELECT 1 FROM ds_table_publication WHERE stream_id = p_stream_id);
END;
$$;

-- The purge (streams/store/sql/retention.sql) keeps a stream's rows from the position of its
-- least advanced active sink: a run reads the stream (its start) first and its rows after, so
-- a trim and purge that committed in between would otherwise make it skip rows without
-- recording the gap. A sink behind a trim records the gap on its next run and moves past it.
-- A sink whose runs fail (last_error: its table gone, a permission missing) holds nothing: it
-- could hold the purge off for good, and a failed run applies nothing, so it skips nothing.
CREATE OR REPLACE FUNCTION ds_hook_purge_floor(p_stream_id bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT min(k.applied_seq) FROM ds_stream_sink AS k
             WHERE k.stream_id = p_stream_id AND k.state = 'active' AND k.last_error = '');
END;
$$;

-- Server processes reload their sinks and published streams when these tables change
-- (tablesync/runner.py): "tablesync:<table>" on the live-delivery channel, on commit.
CREATE OR REPLACE FUNCTION ds_tablesync_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ds_streams', 'tablesync:' || TG_TABLE_NAME);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS ds_stream_sink_changed ON ds_stream_sink;
CREATE TRIGGER ds_stream_sink_changed AFTER INSERT OR DELETE OR UPDATE OF state, stream_id
    ON ds_stream_sink FOR EACH STATEMENT EXECUTE FUNCTION ds_tablesync_changed();
DROP TRIGGER IF EXISTS ds_table_publication_changed ON ds_table_publication;
CREATE TRIGGER ds_table_publication_changed AFTER INSERT OR DELETE OR UPDATE OF stream_id
    ON ds_table_publication FOR EACH STATEMENT EXECUTE FUNCTION ds_tablesync_changed();
