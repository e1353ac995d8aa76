-- Server-side functions of the write path (DESIGN.md, Storage).
--
-- Each write is ONE round trip: the stream row lock (SELECT ... FOR UPDATE) is held only while
-- this code runs inside PostgreSQL, never across client round trips. Appends to one stream are
-- totally ordered by that lock; appends to different streams run in parallel.
--
-- Installed (CREATE OR REPLACE) by a post_migrate handler from this file, so the file is the one
-- source of truth. Functions return outcome codes, never raise for client errors: the Python
-- store maps outcomes to protocol errors in one place.

-- An offset as clients see it: "{seq:016d}_{pos:016d}" (streams/protocol/offsets.py; the one
-- formatter of the SQL side).
CREATE OR REPLACE FUNCTION ds_offset(p_seq bigint, p_pos bigint) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT lpad(p_seq::text, 16, '0') || '_' || lpad(p_pos::text, 16, '0')
$$;

-- The media type of a Content-Type: "Application/JSON; charset=utf-8" -> "application/json".
-- Trims HTTP OWS, space and tab, exactly like media_type in streams/protocol/headers.py.
CREATE OR REPLACE FUNCTION ds_media_type(p_content_type text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT lower(btrim(split_part(p_content_type, ';', 1), E' \t'))
$$;

-- Extension points. Other apps' SQL files, installed after this one in the same transaction,
-- replace these no-ops (state/ records the __registry__ stream and materializes state).
-- ds_hook_created / ds_hook_deleted: a stream appeared / disappeared for clients (created;
-- deleted, soft-deleted or expired). (The version of the extra validation appends to a stream
-- must have passed is not a hook but a column, ds_stream.validation_version, kept by the app
-- that validates: read with the row an append locks, it costs the append nothing.)
CREATE OR REPLACE FUNCTION ds_hook_created(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$ BEGIN END; $$;
-- ds_hook_created_batch: several streams appeared at once (ds_create_streams), in this order.
CREATE OR REPLACE FUNCTION ds_hook_created_batch(p_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$ BEGIN END; $$;
CREATE OR REPLACE FUNCTION ds_hook_deleted(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$ BEGIN END; $$;

-- Has the stream's sliding TTL or absolute expiry passed? (PROTOCOL.md 5.1) A sliding TTL does
-- not pass while the stream is watched (a process has live readers of it: its mark, renewed
-- while they wait, streams.live): "a stream with active live readers will not expire" (5.1).
-- A reader held longer than the TTL saw the stream expire under it, and was told it was up to
-- date (probe 10f).
CREATE OR REPLACE FUNCTION ds_is_expired(s ds_stream) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (s.expires_at IS NOT NULL AND s.expires_at <= now())
        OR (s.ttl_seconds IS NOT NULL
            AND s.accessed_at + make_interval(secs => s.ttl_seconds) <= now()
            AND NOT coalesce(s.watched_until > now(), false))
$$;

-- p_value, once the lock timeout of the calling statement's transaction is p_ms milliseconds
-- (NULL: the session's own): an argument of a statement's function, so that it is set before
-- that function runs (streams.store.writes, _APPEND and APPEND_STREAMS).
CREATE OR REPLACE FUNCTION ds_lock_wait(p_value text, p_ms int) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_ms IS NOT NULL THEN
        PERFORM set_config('lock_timeout', p_ms || 'ms', true);
    END IF;
    RETURN p_value;
END;
$$;

-- Of the streams at p_paths, those whose rows another transaction holds now, waiting for none
-- of them, and at most p_ms for the table itself (locked: all of them). Group commit asks after
-- a transaction of several streams missed a lock (streams.store.group_commit).
CREATE OR REPLACE FUNCTION ds_held_streams(p_paths text[], p_ms int) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    v_free text[];
BEGIN
    PERFORM set_config('lock_timeout', p_ms || 'ms', true);
    SELECT coalesce(array_agg(f.path), '{}') INTO v_free
      FROM (SELECT s.path FROM ds_stream AS s WHERE s.path = ANY(p_paths)
             FOR UPDATE SKIP LOCKED) AS f;
    RETURN QUERY SELECT p FROM unnest(p_paths) AS p WHERE p <> ALL(v_free);
EXCEPTION WHEN lock_not_available THEN
    RETURN QUERY SELECT unnest(p_paths);
END;
$$;

-- Tell live readers a stream is gone: "<id>:-1:d" (streams/live.py).
CREATE OR REPLACE FUNCTION ds_notify_deleted(p_stream_id bigint) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('ds_streams', p_stream_id || ':-1:d')
$$;

-- Remove a stream whose row is locked by the caller, with its data, and release its fork
-- source; cascades up a chain of soft-deleted sources whose last fork is gone (PROTOCOL.md 4.2).
CREATE OR REPLACE FUNCTION ds_remove(p_stream_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint := p_stream_id;
    v_source bigint;
    v_src ds_stream;
BEGIN
    LOOP
        DELETE FROM ds_stream WHERE id = v_id RETURNING fork_source_id INTO v_source;
        DELETE FROM ds_message WHERE stream_id = v_id;
        DELETE FROM ds_producer WHERE stream_id = v_id;
        DELETE FROM ds_stream_mark WHERE stream_id = v_id;
        DELETE FROM ds_purge_pending WHERE stream_id = v_id;
        PERFORM ds_notify_deleted(v_id);
        EXIT WHEN v_source IS NULL;
        UPDATE ds_stream SET fork_refcount = fork_refcount - 1
         WHERE id = v_source RETURNING * INTO v_src;
        -- The source kept rows for this fork (below its start, or all of them when it is
        -- soft-deleted): they may go now (retention.sql).
        IF FOUND AND (v_src.first_seq > 0 OR v_src.deleted_at IS NOT NULL) THEN
            INSERT INTO ds_purge_pending (stream_id, due_at) VALUES (v_source, now())
            ON CONFLICT (stream_id) DO UPDATE SET due_at = least(ds_purge_pending.due_at, now());
        END IF;
        EXIT WHEN NOT FOUND OR v_src.fork_refcount > 0 OR v_src.deleted_at IS NULL;
        v_id := v_source;
    END LOOP;
END;
$$;

-- Lock order. Every transaction that locks several streams' rows takes them in path order:
-- appends and creates batched across streams (ds_append_streams, ds_create_streams), watch
-- marks (ds_watch_streams), and a fork's removal, which updates its source's fork_refcount and
-- may remove a chain of soft-deleted sources (ds_remove): ds_delete locks the whole chain first
-- (ds_lock_chain). A removal that finds its stream expired holds that row already; it takes
-- the sources only if nobody holds them (ds_lock_sources). Before this, a fork's delete took
-- the fork's row and then its source's while a batch took them in path order: deadlocks, each
-- costing a second (deadlock_timeout) and answering 500.

-- The stream at p_path (NULL: none) with every source up its fork chain, locked in path order.
CREATE OR REPLACE FUNCTION ds_lock_chain(p_path text) RETURNS ds_stream
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
    v_ids bigint[];
BEGIN
    LOOP
        -- The chain read without locks: fork_source_id never changes, and a source stays
        -- while a fork of it exists (fork_refcount). Gone by the time it is locked: again.
        SELECT * INTO s FROM ds_stream AS t WHERE t.path = p_path;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        v_ids := ARRAY[s.id] || ds_sources(s);
        PERFORM 1 FROM ds_stream AS t WHERE t.id = ANY (v_ids) ORDER BY t.path FOR UPDATE;
        SELECT * INTO s FROM ds_stream AS t WHERE t.id = v_ids[1];
        IF FOUND THEN
            RETURN s;
        END IF;
    END LOOP;
END;
$$;

-- The sources up stream s's fork chain, nearest first (empty for a stream that is no fork).
CREATE OR REPLACE FUNCTION ds_sources(s ds_stream) RETURNS bigint[]
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE chain (id, source, depth) AS (
        SELECT t.id, t.fork_source_id, 1 FROM ds_stream AS t WHERE t.id = s.fork_source_id
        UNION ALL
        SELECT t.id, t.fork_source_id, c.depth + 1
          FROM ds_stream AS t JOIN chain AS c ON t.id = c.source
    )
    SELECT coalesce(array_agg(id ORDER BY depth), '{}') FROM chain
$$;

-- Lock the sources up stream s's fork chain (s locked by the caller) if nobody else holds any
-- of them; whether it did. Taken after s, they would break path order: never wait for them.
CREATE OR REPLACE FUNCTION ds_lock_sources(s ds_stream) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_ids bigint[] := ds_sources(s);
    v_locked int;
BEGIN
    IF cardinality(v_ids) = 0 THEN
        RETURN true;
    END IF;
    -- Rows this transaction holds already (ds_lock_chain) are not skipped.
    SELECT count(*) INTO v_locked
      FROM (SELECT 1 FROM ds_stream AS t WHERE t.id = ANY (v_ids)
             ORDER BY t.path FOR UPDATE SKIP LOCKED) AS l;
    RETURN v_locked = cardinality(v_ids);
END;
$$;

-- A stream gone for clients (expired, or deleted by a client), row locked by the caller:
-- removed, or soft-deleted while forks still read through it. A fork whose sources another
-- transaction holds is left as it is (ds_lock_sources): expired, it answers as gone all the
-- same, and the next access or the sweep removes it; the caller can tell by the row, still
-- there and not deleted (ds_delete locks the chain first, so its removals always happen).
CREATE OR REPLACE FUNCTION ds_expire(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF s.fork_refcount > 0 THEN
        UPDATE ds_stream SET deleted_at = coalesce(deleted_at, now()) WHERE id = s.id;
        PERFORM ds_notify_deleted(s.id);
        -- Only what its forks read is kept: the rest is purged (retention.sql).
        INSERT INTO ds_purge_pending (stream_id, due_at) VALUES (s.id, now())
        ON CONFLICT (stream_id) DO UPDATE SET due_at = least(ds_purge_pending.due_at, now());
    ELSIF ds_lock_sources(s) THEN
        PERFORM ds_remove(s.id);
    ELSE
        RETURN;
    END IF;
    PERFORM ds_hook_deleted(s);
END;
$$;

-- Is stream s (as read before ds_expire) still there for clients to see after ds_expire: its
-- removal was left for later (ds_expire), though it is expired?
CREATE OR REPLACE FUNCTION ds_expire_postponed(s ds_stream) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM ds_stream AS t WHERE t.id = s.id AND t.deleted_at IS NULL)
$$;

-- Delete on behalf of a client. A stream with forks is soft-deleted: it answers 410 and keeps
-- its data for fork reads until its last fork is gone (PROTOCOL.md 5.4). An expired stream
-- is expired on the spot, the same removal, and answers not_found (PROTOCOL.md 5.1).
-- Outcomes: ds_delete_outcome (streams/store/outcomes.py maps them to answers).
CREATE OR REPLACE FUNCTION ds_delete(p_path text) RETURNS ds_delete_outcome
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
    v_expired boolean;
BEGIN
    -- With its sources: its removal updates them (lock order above).
    s := ds_lock_chain(p_path);
    IF s.id IS NULL THEN
        RETURN 'not_found';
    ELSIF s.deleted_at IS NOT NULL THEN
        RETURN 'gone';
    END IF;
    v_expired := ds_is_expired(s);
    PERFORM ds_expire(s);
    IF v_expired THEN
        RETURN 'not_found';
    ELSIF s.fork_refcount > 0 THEN
        RETURN 'soft_deleted';
    END IF;
    RETURN 'deleted';
END;
$$;

-- Sweep expired streams (a periodic job in every server process; cheap when nothing expired).
CREATE OR REPLACE FUNCTION ds_sweep_expired(p_limit int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
    v_count int := 0;
BEGIN
    FOR s IN
        -- ds_is_expired is inlined: the plan still scans the partial expiry and TTL indexes.
        SELECT * FROM ds_stream
         WHERE deleted_at IS NULL AND ds_is_expired(ds_stream.*)
         ORDER BY id
         LIMIT p_limit
         FOR UPDATE SKIP LOCKED
    LOOP
        PERFORM ds_expire(s);
        IF NOT ds_expire_postponed(s) THEN
            v_count := v_count + 1;
        END IF;
    END LOOP;
    RETURN v_count;
END;
$$;

-- Stream metadata for a read, HEAD or live wait, renewing a sliding TTL when p_touch
-- (reads renew it, HEAD does not: PROTOCOL.md 5.1). An expired stream is expired on the spot.
-- For a fork, chain_ids/chain_lo/chain_hi list the segments whose rows make up the stream:
-- rows of chain_ids[i] with chain_lo[i] <= seq < chain_hi[i] (NULL hi: no upper bound).
-- Retention (retention.sql): the earliest retained position (first_seq, first_pos), the
-- compaction bounds (compacted_seq, resume_seq) and the stream's own retention policy.
-- ROWS 1 (here, in ds_create and ds_append): joined to a range of messages, the default
-- estimate of 1000 rows makes the plan look costly enough for JIT, which takes ~150 ms.
CREATE OR REPLACE FUNCTION ds_stream_meta(p_path text, p_touch boolean)
RETURNS TABLE (
    id bigint, content_type text, next_seq bigint, next_pos bigint, closed boolean,
    ttl_seconds bigint, expires_at timestamptz, deleted boolean, created_at timestamptz,
    chain_ids bigint[], chain_lo bigint[], chain_hi bigint[],
    first_seq bigint, first_pos bigint, resume_seq bigint, compacted_seq bigint,
    retention_max_age bigint, retention_max_bytes bigint
)
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    s ds_stream;
    v_ids bigint[];
    v_lo bigint[];
    v_hi bigint[];
    v_cur ds_stream;
    v_hi_bound bigint;
BEGIN
    SELECT * INTO s FROM ds_stream AS t WHERE t.path = p_path;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF s.deleted_at IS NULL AND ds_is_expired(s) THEN
        SELECT * INTO s FROM ds_stream AS t WHERE t.id = s.id FOR UPDATE;
        IF FOUND AND ds_is_expired(s) THEN
            PERFORM ds_expire(s);
        END IF;
        RETURN;
    END IF;
    -- The renewal waits for a writer holding the row, not SKIP LOCKED: an idempotent PUT, a
    -- fork's creation or a watch mark holds it without renewing the TTL, and skipping would
    -- lose this read's renewal. It cannot deadlock: the only lock of its statement, taken last.
    IF p_touch AND s.ttl_seconds IS NOT NULL AND s.deleted_at IS NULL THEN
        UPDATE ds_stream AS t SET accessed_at = now() WHERE t.id = s.id;
    END IF;
    v_cur := s;
    v_hi_bound := NULL;
    LOOP
        v_ids := v_ids || v_cur.id;
        v_lo := v_lo || coalesce(v_cur.fork_seq, 0);
        v_hi := v_hi || v_hi_bound;
        EXIT WHEN v_cur.fork_source_id IS NULL;
        v_hi_bound := v_cur.fork_seq;
        SELECT * INTO v_cur FROM ds_stream AS t WHERE t.id = v_cur.fork_source_id;
        EXIT WHEN NOT FOUND;
    END LOOP;
    RETURN QUERY SELECT s.id, s.content_type, s.next_seq, s.next_pos, s.closed, s.ttl_seconds,
        s.expires_at, s.deleted_at IS NOT NULL, s.created_at, v_ids, v_lo, v_hi,
        s.first_seq, s.first_pos, s.resume_seq, s.compacted_seq, s.retention_max_age,
        s.retention_max_bytes;
END;
$$;

-- The stream of a fork chain whose own rows hold position p_seq, starting from p_stream_id.
CREATE OR REPLACE FUNCTION ds_chain_owner(p_stream_id bigint, p_seq bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_cur ds_stream;
BEGIN
    SELECT * INTO v_cur FROM ds_stream WHERE id = p_stream_id;
    WHILE v_cur.fork_source_id IS NOT NULL AND p_seq < v_cur.fork_seq LOOP
        SELECT * INTO v_cur FROM ds_stream WHERE id = v_cur.fork_source_id;
    END LOOP;
    RETURN v_cur.id;
END;
$$;

-- Is (p_seq, p_pos) a position of stream src: its tail, or the start of one of its messages?
CREATE OR REPLACE FUNCTION ds_is_position(src ds_stream, p_seq bigint, p_pos bigint)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN p_seq > src.next_seq THEN false
        WHEN p_seq = src.next_seq THEN p_pos = src.next_pos
        ELSE EXISTS (SELECT 1 FROM ds_message
                      WHERE stream_id = ds_chain_owner(src.id, p_seq)
                        AND seq = p_seq AND pos = p_pos)
    END
$$;

-- What a fork copies past its anchor (PROTOCOL.md 4.2, Stream-Fork-Sub-Offset): the first
-- p_sub bytes of the message at the anchor, or for JSON the first p_sub messages of the append
-- that starts there. NULL when p_sub passes the end of that append ("past the next data
-- boundary"). The copy becomes the fork's own first append, so reads need no partial rows.
CREATE OR REPLACE FUNCTION ds_fork_prefix(src ds_stream, p_anchor bigint, p_sub bigint)
RETURNS bytea[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_owner bigint;
    v_rows bytea[];
    v_ends boolean[];
    v_data bytea;
BEGIN
    IF p_sub = 0 THEN
        RETURN '{}';
    ELSIF p_anchor >= src.next_seq THEN
        RETURN NULL;
    END IF;
    v_owner := ds_chain_owner(src.id, p_anchor);
    IF ds_media_type(src.content_type) = 'application/json' THEN
        SELECT array_agg(t.data ORDER BY t.seq), array_agg(t.batch_end ORDER BY t.seq)
          INTO v_rows, v_ends
          FROM (SELECT m.seq, m.data, m.batch_end FROM ds_message AS m
                 WHERE m.stream_id = v_owner AND m.seq >= p_anchor
                 ORDER BY m.seq LIMIT p_sub) AS t;
        IF coalesce(array_length(v_rows, 1), 0) < p_sub OR true = ANY (v_ends[1:p_sub - 1]) THEN
            RETURN NULL;
        END IF;
        RETURN v_rows;
    END IF;
    SELECT m.data INTO v_data FROM ds_message AS m
     WHERE m.stream_id = v_owner AND m.seq = p_anchor;
    IF v_data IS NULL OR p_sub > octet_length(v_data) THEN
        RETURN NULL;
    END IF;
    RETURN ARRAY[substring(v_data FROM 1 FOR p_sub::int)];
END;
$$;

-- Insert one append's messages at (p_seq, p_pos), its last message ending the batch. Returns
-- the bytes written.
CREATE OR REPLACE FUNCTION ds_insert_messages(
    p_stream_id bigint, p_seq bigint, p_pos bigint, p_data bytea[]
) RETURNS bigint
LANGUAGE sql AS $$
    WITH inserted AS (
        INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
        SELECT p_stream_id, p_seq + u.ord - 1,
               p_pos + sum(octet_length(u.d)) OVER w - octet_length(u.d), u.d,
               u.ord = cardinality(p_data)
          FROM unnest(p_data) WITH ORDINALITY AS u(d, ord)
        WINDOW w AS (ORDER BY u.ord)
        RETURNING octet_length(data) AS len
    )
    SELECT coalesce(sum(len), 0)::bigint FROM inserted
$$;

-- A fork's source (ds_create, step 2): locked, judged, and what the fork starts from. outcome
-- is NULL when the fork may be made; otherwise it says why not.
-- How many forks deep a chain may go: every read and HEAD of a fork walks its chain, so a client
-- making one thousands deep made each of them cost tens of milliseconds of the database's time
-- (found by a probe). The server's connections set it (DS_LIMITS__MAX_FORK_DEPTH).
CREATE OR REPLACE FUNCTION ds_max_fork_depth() RETURNS int
LANGUAGE sql STABLE AS $$
    SELECT coalesce(nullif(current_setting('ds.max_fork_depth', true), '')::int, 100)
$$;

-- How many forks deep s is (0: not a fork), counted up to p_limit.
CREATE OR REPLACE FUNCTION ds_fork_depth(s ds_stream, p_limit int) RETURNS int
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE chain (source, depth) AS (
        SELECT s.fork_source_id, 0
        UNION ALL
        SELECT t.fork_source_id, c.depth + 1
          FROM chain AS c JOIN ds_stream AS t ON t.id = c.source
         WHERE c.depth < p_limit
    )
    SELECT max(depth) FROM chain
$$;

CREATE OR REPLACE FUNCTION ds_create_fork_plan(
    p_fork_from text, p_content_type text, p_fork_seq bigint, p_fork_pos bigint,
    p_fork_sub bigint,
    OUT outcome ds_create_outcome, OUT src ds_stream, OUT fork_type text,
    OUT anchor_seq bigint, OUT anchor_pos bigint, OUT prefix bytea[]
)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT * INTO src FROM ds_stream AS t WHERE t.path = p_fork_from FOR UPDATE;
    IF FOUND AND src.deleted_at IS NULL AND ds_is_expired(src) THEN
        PERFORM ds_expire(src);
        -- Still there when its removal was left for later (ds_expire): expired, not found.
        SELECT * INTO src FROM ds_stream AS t
         WHERE t.path = p_fork_from AND (t.deleted_at IS NOT NULL OR NOT ds_is_expired(t))
           FOR UPDATE;
    END IF;
    outcome := CASE
        WHEN NOT FOUND THEN 'source_not_found'
        WHEN src.deleted_at IS NOT NULL THEN 'source_gone'
        WHEN p_content_type IS NOT NULL
             AND ds_media_type(p_content_type) <> ds_media_type(src.content_type)
            THEN 'content_type_mismatch'
        -- Before the source's start, or inside its compacted history (whose events were
        -- judged against later ones): not retained as it was (PROTOCOL.md 5.6).
        WHEN p_fork_seq IS NOT NULL
             AND ((p_fork_seq, p_fork_pos) < (src.first_seq, src.first_pos)
                  OR p_fork_seq < src.compacted_seq)
            THEN 'fork_offset_gone'
        WHEN p_fork_seq IS NOT NULL AND NOT ds_is_position(src, p_fork_seq, p_fork_pos)
            THEN 'fork_offset_invalid'
        WHEN ds_fork_depth(src, ds_max_fork_depth()) >= ds_max_fork_depth()
            THEN 'fork_too_deep'
    END;
    IF outcome IS NOT NULL THEN
        RETURN;
    END IF;
    fork_type := coalesce(p_content_type, src.content_type);
    anchor_seq := coalesce(p_fork_seq, src.next_seq);
    anchor_pos := coalesce(p_fork_pos, src.next_pos);
    prefix := ds_fork_prefix(src, anchor_seq, p_fork_sub);
    IF prefix IS NULL THEN
        outcome := 'sub_offset_invalid';
    END IF;
END;
$$;

-- Create a stream, or a fork of one (PROTOCOL.md 4.2, 5.1). Idempotent: an existing stream with
-- the same configuration answers `exists`, a different one `conflict`. p_content_type NULL
-- means "not given": the source's type for a fork (the caller supplies the default otherwise).
-- p_fork_seq NULL means the source's tail. p_retention_max_age / _bytes: the stream's retention
-- policy (retention.sql), NULL for none of its own (a fork then inherits its source's). Three
-- steps, numbered below: an existing stream answers at once; a fork's source is judged
-- (ds_create_fork_plan); the row and its first messages (a fork's sub-offset prefix, then the
-- request's) are stored.
-- Outcomes: ds_create_outcome (streams/store/outcomes.py maps them to answers).
-- p_created_hook: call ds_hook_created for the new stream (ds_create_streams calls
-- ds_hook_created_batch once for its whole batch instead).
DROP FUNCTION IF EXISTS ds_create(text, text, bigint, timestamptz, boolean, bytea[], bigint, text,
                                  bigint, bigint, bigint, text, bigint, bigint);
CREATE OR REPLACE FUNCTION ds_create(
    p_path text,
    p_content_type text,
    p_ttl_seconds bigint,
    p_expires_at timestamptz,
    p_closed boolean,
    p_data bytea[],
    p_max_stream_bytes bigint,
    p_fork_from text,
    p_fork_seq bigint,
    p_fork_pos bigint,
    p_fork_sub bigint,
    p_created_by text,
    p_retention_max_age bigint,
    p_retention_max_bytes bigint,
    p_created_hook boolean DEFAULT true
)
RETURNS TABLE (
    outcome ds_create_outcome, id bigint, content_type text, next_seq bigint, next_pos bigint,
    closed boolean
)
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    s ds_stream;
    plan record;
    src ds_stream;
    v_refusal ds_create_outcome;
    v_type text := p_content_type;
    v_ttl bigint := p_ttl_seconds;
    v_expires timestamptz := p_expires_at;
    v_max_age bigint := p_retention_max_age;
    v_max_bytes bigint := p_retention_max_bytes;
    -- What a fork inherits of its source's retention (its start, compaction bounds).
    v_first_seq bigint := 0;
    v_first_pos bigint := 0;
    v_compacted_seq bigint := 0;
    v_compacted_bytes bigint := 0;
    v_resume_seq bigint := 0;
    v_anchor_seq bigint := 0;
    v_anchor_pos bigint := 0;
    v_prefix bytea[] := '{}';
    v_id bigint;
    v_seq bigint;
    v_pos bigint;
BEGIN
    <<attempt>>
    LOOP
        -- 1. An existing stream (expired ones are expired on the spot) answers at once.
        SELECT * INTO s FROM ds_stream AS t WHERE t.path = p_path FOR UPDATE;
        IF FOUND AND s.deleted_at IS NULL AND ds_is_expired(s) THEN
            PERFORM ds_expire(s);
            IF ds_expire_postponed(s) THEN
                -- An expired fork whose sources another transaction holds: the path is not
                -- free yet. The statement is run again (streams/store/conflicts.py).
                RAISE EXCEPTION 'expired stream % waits for its sources', p_path
                      USING ERRCODE = 'serialization_failure';
            END IF;
            SELECT * INTO s FROM ds_stream AS t WHERE t.path = p_path FOR UPDATE;
        END IF;
        IF FOUND THEN
            RETURN QUERY SELECT
                CASE WHEN ds_create_matches(s, p_content_type, p_ttl_seconds, p_expires_at,
                            p_closed, p_fork_from, p_fork_seq, p_fork_pos, p_fork_sub)
                          -- Retention policies compare only when the request gives them
                          -- (docs/gaps.md, Retention).
                          AND (p_retention_max_age IS NULL
                               OR p_retention_max_age = s.retention_max_age)
                          AND (p_retention_max_bytes IS NULL
                               OR p_retention_max_bytes = s.retention_max_bytes)
                     THEN 'exists' ELSE 'conflict' END::ds_create_outcome,
                s.id, s.content_type, s.next_seq, s.next_pos, s.closed;
            RETURN;
        END IF;

        -- 2. A fork starts where its source's plan says, with the source's TTL and expiry
        -- unless it has its own (PROTOCOL.md 4.2 table).
        IF p_fork_from IS NOT NULL THEN
            plan := ds_create_fork_plan(p_fork_from, p_content_type, p_fork_seq, p_fork_pos,
                                        p_fork_sub);
            v_refusal := plan.outcome;
            src := plan.src;
            IF v_refusal IS NULL THEN
                v_type := plan.fork_type;
                v_anchor_seq := plan.anchor_seq;
                v_anchor_pos := plan.anchor_pos;
                v_prefix := plan.prefix;
                IF p_ttl_seconds IS NULL AND p_expires_at IS NULL THEN
                    v_ttl := src.ttl_seconds;
                    v_expires := src.expires_at;
                END IF;
                -- Retention: the fork's own policy when given, else the source's; it starts
                -- where the source does, with the source's compacted history (docs/gaps.md,
                -- Retention).
                IF p_retention_max_age IS NULL AND p_retention_max_bytes IS NULL THEN
                    v_max_age := src.retention_max_age;
                    v_max_bytes := src.retention_max_bytes;
                END IF;
                v_first_seq := least(src.first_seq, v_anchor_seq);
                v_first_pos := least(src.first_pos, v_anchor_pos);
                v_compacted_seq := least(src.compacted_seq, v_anchor_seq);
                v_compacted_bytes := src.compacted_bytes;
                v_resume_seq := least(src.resume_seq, v_anchor_seq);
            END IF;
        END IF;
        -- The size limit counts retained bytes (a fork's inherited ones included).
        IF v_refusal IS NULL AND v_anchor_pos - v_first_pos - v_compacted_bytes
                + (SELECT coalesce(sum(octet_length(d)), 0)
                     FROM unnest(v_prefix || coalesce(p_data, '{}')) AS d)
                > p_max_stream_bytes THEN
            v_refusal := 'too_large';
        END IF;
        IF v_refusal IS NOT NULL THEN
            -- fork_offset_gone answers with the source's start, where it now begins.
            RETURN QUERY SELECT v_refusal, NULL::bigint, NULL::text,
                CASE WHEN v_refusal = 'fork_offset_gone' THEN src.first_seq END,
                CASE WHEN v_refusal = 'fork_offset_gone' THEN src.first_pos END,
                NULL::boolean;
            RETURN;
        END IF;

        -- 3. The row, then its first messages.
        INSERT INTO ds_stream AS t (
            path, content_type, created_at, accessed_at, ttl_seconds, expires_at, next_seq,
            next_pos, closed, fork_source_id, fork_seq, fork_pos, fork_sub_offset,
            fork_refcount, created_by, retention_max_age, retention_max_bytes, first_seq,
            first_pos, compacted_seq, compacted_bytes, resume_seq
        ) VALUES (
            p_path, v_type, now(), now(), v_ttl, v_expires, v_anchor_seq, v_anchor_pos,
            p_closed, src.id,
            CASE WHEN src.id IS NOT NULL THEN v_anchor_seq END,
            CASE WHEN src.id IS NOT NULL THEN v_anchor_pos END,
            CASE WHEN src.id IS NOT NULL THEN p_fork_sub END,
            0, p_created_by, v_max_age, v_max_bytes, v_first_seq, v_first_pos, v_compacted_seq,
            v_compacted_bytes, v_resume_seq
        )
        ON CONFLICT (path) DO NOTHING
        RETURNING t.id INTO v_id;
        -- NULL: a concurrent create won the race; answer as if it had come first.
        EXIT attempt WHEN v_id IS NOT NULL;
    END LOOP;

    IF src.id IS NOT NULL THEN
        UPDATE ds_stream AS t SET fork_refcount = t.fork_refcount + 1 WHERE t.id = src.id;
    END IF;
    -- Two appends, each ending its batch: the prefix a fork copied, then the request's.
    v_seq := v_anchor_seq;
    v_pos := v_anchor_pos;
    IF cardinality(v_prefix) > 0 THEN
        v_pos := v_pos + ds_insert_messages(v_id, v_seq, v_pos, v_prefix);
        v_seq := v_seq + cardinality(v_prefix);
    END IF;
    IF cardinality(p_data) > 0 THEN
        v_pos := v_pos + ds_insert_messages(v_id, v_seq, v_pos, p_data);
        v_seq := v_seq + cardinality(p_data);
    END IF;
    IF v_seq <> v_anchor_seq THEN
        UPDATE ds_stream AS t SET next_seq = v_seq, next_pos = v_pos WHERE t.id = v_id;
    END IF;
    IF p_created_hook THEN
        SELECT * INTO s FROM ds_stream AS t WHERE t.id = v_id;
        PERFORM ds_hook_created(s);
    END IF;
    RETURN QUERY SELECT 'created'::ds_create_outcome, v_id, v_type, v_seq, v_pos, p_closed;
END;
$$;

-- Group commit of creates (streams/store/create_commit.py): several creates in ONE statement,
-- each judged by ds_create as it would be alone, in the order given (the caller sorts them by
-- path, the order every process locks streams in). The streams created are told to
-- ds_hook_created_batch at once, after all of them (state/: one append to the registry for
-- the batch, not one each). p_requests: per create, [path, content type, ttl seconds, expires
-- at, closed, how many messages, fork source, fork seq, fork pos, fork sub-offset, created
-- by, retention max age, retention max bytes]; p_data: every create's messages, in order.
-- Rows: the create's ordinal (1-based), then ds_create's row.
CREATE OR REPLACE FUNCTION ds_create_streams(
    p_requests jsonb, p_data bytea[], p_max_stream_bytes bigint
)
RETURNS TABLE (
    ord int, outcome ds_create_outcome, id bigint, content_type text, next_seq bigint,
    next_pos bigint, closed boolean
)
LANGUAGE plpgsql AS $$
DECLARE
    r jsonb;
    c record;
    v_first int := 1;
    v_count int;
    v_created bigint[] := '{}';
BEGIN
    -- The existing streams every create will lock, its own and its fork source, all at once in
    -- path order: one by one, a fork's source (locked after the fork's own path) could come
    -- before a path locked already (lock order, ds_lock_chain).
    PERFORM 1 FROM ds_stream AS t
     WHERE t.path IN (SELECT e ->> 0 FROM jsonb_array_elements(p_requests) AS e
                      UNION SELECT e ->> 6 FROM jsonb_array_elements(p_requests) AS e)
     ORDER BY t.path FOR UPDATE;
    FOR i IN 1..jsonb_array_length(p_requests) LOOP
        r := p_requests -> (i - 1);
        v_count := (r ->> 5)::int;
        SELECT * INTO c FROM ds_create(
            r ->> 0, r ->> 1, (r ->> 2)::bigint, (r ->> 3)::timestamptz, (r ->> 4)::boolean,
            coalesce(p_data[v_first : v_first + v_count - 1], '{}'), p_max_stream_bytes,
            r ->> 6, (r ->> 7)::bigint, (r ->> 8)::bigint, (r ->> 9)::bigint, r ->> 10,
            (r ->> 11)::bigint, (r ->> 12)::bigint, false) AS d;
        v_first := v_first + v_count;
        IF c.outcome = 'created' THEN
            v_created := v_created || c.id;
        END IF;
        RETURN QUERY SELECT i, c.outcome, c.id, c.content_type, c.next_seq, c.next_pos, c.closed;
    END LOOP;
    PERFORM ds_hook_created_batch(v_created);
END;
$$;

-- Would creating with this configuration produce the existing stream s? (idempotent PUT)
CREATE OR REPLACE FUNCTION ds_create_matches(
    s ds_stream, p_content_type text, p_ttl_seconds bigint, p_expires_at timestamptz,
    p_closed boolean, p_fork_from text, p_fork_seq bigint, p_fork_pos bigint, p_fork_sub bigint
) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_source_path text;
BEGIN
    IF s.deleted_at IS NOT NULL OR p_closed <> s.closed THEN
        RETURN false;
    ELSIF p_content_type IS NOT NULL
          AND ds_media_type(p_content_type) <> ds_media_type(s.content_type) THEN
        RETURN false;
    END IF;
    IF p_fork_from IS NULL THEN
        RETURN s.fork_source_id IS NULL
           AND p_ttl_seconds IS NOT DISTINCT FROM s.ttl_seconds
           AND p_expires_at IS NOT DISTINCT FROM s.expires_at;
    END IF;
    SELECT t.path INTO v_source_path FROM ds_stream AS t WHERE t.id = s.fork_source_id;
    -- A fork's TTL/expiry may have been inherited: compare only what the request gives. An
    -- omitted fork offset (the source's tail) matches the recorded anchor.
    RETURN v_source_path IS NOT DISTINCT FROM p_fork_from
       AND (p_fork_seq IS NULL OR (p_fork_seq, p_fork_pos) = (s.fork_seq, s.fork_pos))
       AND p_fork_sub = s.fork_sub_offset
       AND (p_ttl_seconds IS NULL OR p_ttl_seconds = s.ttl_seconds)
       AND (p_expires_at IS NULL OR p_expires_at = s.expires_at);
END;
$$;

-- The notification of an append: "<id>:<next seq>:<o|c>" (open or closed), and when every
-- request of the batch was stored and the data is small (and not empty), the data itself:
-- ":<first seq>:<first pos>:<message lengths, comma-separated>:<base64 of the messages>".
-- Readers in other processes then deliver it without reading the store; without it (or when
-- it does not continue exactly where a reader is) they re-read (streams/live.py).
CREATE OR REPLACE FUNCTION ds_notify_payload(
    s ds_stream, p_next_seq bigint, p_closed boolean, p_lengths int[], p_data bytea,
    p_all_stored boolean
) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_head text := s.id || ':' || p_next_seq || ':' || CASE WHEN p_closed THEN 'c' ELSE 'o' END;
BEGIN
    -- NOTIFY payloads are limited to 8000 bytes; base64 grows data by a third.
    IF NOT p_all_stored OR p_data IS NULL OR octet_length(p_data) > 4096
       OR coalesce(array_length(p_lengths, 1), 0) NOT BETWEEN 1 AND 256 THEN
        RETURN v_head;
    END IF;
    RETURN v_head || ':' || s.next_seq || ':' || s.next_pos || ':'
        || array_to_string(p_lengths, ',') || ':'
        || translate(encode(p_data, 'base64'), E'\n', '');
END;
$$;

-- The verdict on one append request, in the protocol's order of precedence (PROTOCOL.md 5.2,
-- 5.2.1; STYLE.md: epoch 403 -> duplicate 204 -> closed 409 -> gap 409), from what the stream and
-- the producer ledger hold at that point of its batch. A pure decision table (inlined by the
-- planner), so the order is read in one place. p_known: the ledger has the producer, with
-- p_epoch / p_last; p_fits: the data fits the size limit; p_validated: the request passed the
-- stream's current extra validation (streams.extensions) or has no data to validate.
CREATE OR REPLACE FUNCTION ds_append_verdict(
    p_known boolean, p_epoch bigint, p_last bigint,
    p_producer text, p_req_epoch bigint, p_req_seq bigint,
    p_closed boolean, p_closed_by text, p_closed_epoch bigint, p_closed_seq bigint,
    p_count int, p_close boolean, p_media text, p_stream_media text,
    p_req_stream_seq text, p_stream_seq text, p_fits boolean, p_validated boolean
) RETURNS ds_append_outcome
LANGUAGE sql IMMUTABLE AS $$
    -- Each outcome a constant of the ENUM (a cast of text would be a stable, not immutable,
    -- call, and keep the planner from inlining the function: +70 us an append, measured).
    SELECT CASE
        WHEN p_known AND p_req_epoch < p_epoch
            THEN 'stale_epoch'::ds_append_outcome
        WHEN p_known AND p_req_epoch = p_epoch AND p_req_seq <= p_last
            THEN 'duplicate'::ds_append_outcome
        WHEN p_closed AND p_count = 0 AND p_close
            THEN 'already_closed'::ds_append_outcome
        -- The retry of the request that closed the stream is a duplicate of it.
        WHEN p_closed AND p_producer IS NOT NULL
             AND (p_producer, p_req_epoch, p_req_seq) = (p_closed_by, p_closed_epoch, p_closed_seq)
            THEN 'duplicate'::ds_append_outcome
        WHEN p_closed
            THEN 'stream_closed'::ds_append_outcome
        WHEN p_count > 0 AND p_media IS DISTINCT FROM p_stream_media
            THEN 'content_type_mismatch'::ds_append_outcome
        WHEN p_known AND p_req_epoch > p_epoch AND p_req_seq <> 0
            THEN 'epoch_seq_not_zero'::ds_append_outcome
        WHEN p_producer IS NOT NULL AND NOT p_known AND p_req_seq <> 0
            THEN 'sequence_gap'::ds_append_outcome
        WHEN p_known AND p_req_epoch = p_epoch AND p_req_seq > p_last + 1
            THEN 'sequence_gap'::ds_append_outcome
        WHEN p_req_stream_seq COLLATE "C" <= p_stream_seq COLLATE "C"
            THEN 'stream_seq_regression'::ds_append_outcome
        WHEN NOT p_fits
            THEN 'too_large'::ds_append_outcome
        -- Last: a request refused anyway gets that answer, not a re-validation.
        WHEN NOT p_validated
            THEN 'validation_stale'::ds_append_outcome
        ELSE 'appended'::ds_append_outcome
    END
$$;

-- Store the messages of a batch's accepted requests (p_accept[request]) after the stream's tail,
-- the last message of each request ending its batch (batch_end). Messages travel flat: p_lengths
-- and p_owners give each message's length and (1-based) request, p_data their bytes.
CREATE OR REPLACE FUNCTION ds_append_messages(
    s ds_stream, p_accept boolean[], p_lengths int[], p_owners int[], p_data bytea
) RETURNS void
-- plpgsql, not sql: called from plpgsql, an SQL function is planned on every call.
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
    SELECT s.id, s.next_seq + row_number() OVER w - 1,
           s.next_pos + sum(u.len) OVER w - u.len,
           substring(p_data FROM (u.start + 1)::int FOR u.len),
           lead(u.owner) OVER w IS DISTINCT FROM u.owner
      FROM (SELECT m.len, m.owner, m.ord,
                   sum(m.len) OVER (ORDER BY m.ord) - m.len AS start
              FROM unnest(p_lengths, p_owners) WITH ORDINALITY AS m(len, owner, ord)
           ) AS u
     WHERE p_accept[u.owner]
    WINDOW w AS (ORDER BY u.ord);
END;
$$;

-- Append a batch of requests to one stream in one transaction (group commit: requests that
-- arrive while the stream's previous batch is being written share the next one, and its fsync).
-- Each request is judged on its own, in order, exactly as if it had come alone
-- (ds_append_verdict), so one refused request never affects another. Three steps, numbered
-- below: lock the stream, judge each request, store the accepted ones. (The lock and the store
-- stay inline: as functions of their own they cost a fifth of an append, measured.)
--
-- The batch travels in few, flat parameters (cheap to send from Python):
--   p_requests: one JSON array per request:
--       [media type or null (empty body), close, producer id or null, epoch, producer seq,
--        Stream-Seq or null, message count, byte count, validation version or null]
--   p_lengths / p_owners: each message's byte length and the request (1-based) it belongs to;
--   p_data: all messages' bytes, concatenated in order.
-- Outcomes: ds_append_outcome (streams/store/outcomes.py maps them to answers).
CREATE OR REPLACE FUNCTION ds_append(
    p_path text,
    p_requests jsonb,
    p_lengths int[],
    p_owners int[],
    p_data bytea,
    p_max_stream_bytes bigint
)
RETURNS TABLE (
    outcome ds_append_outcome, next_seq bigint, next_pos bigint, closed boolean,
    producer_epoch bigint, producer_seq bigint, expected_seq bigint, stream_id bigint
)
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    s ds_stream;
    n int := jsonb_array_length(p_requests);
    i int;
    r jsonb;
    v_producer text;
    v_req_epoch bigint;
    v_req_seq bigint;
    v_req_stream_seq text;
    v_count int;
    v_bytes bigint;
    v_accept boolean[] := array_fill(false, ARRAY[n]);
    v_any boolean := false;
    -- The stream as the requests judged so far left it.
    v_seq bigint;
    v_pos bigint;
    v_closed boolean;
    v_closed_by text;
    v_closed_epoch bigint;
    v_closed_seq bigint;
    v_stream_seq text;
    v_validation bigint;
    v_stream_media text;
    -- The request's producer in the ledger.
    v_known boolean;
    v_epoch bigint;
    v_last bigint;
BEGIN
    -- 1. The stream, locked until the transaction ends: appends to one stream are ordered by
    -- this lock. An expired stream is expired on the spot.
    SELECT * INTO s FROM ds_stream AS t WHERE t.path = p_path FOR UPDATE;
    IF NOT FOUND THEN
        outcome := 'not_found';
    ELSIF s.deleted_at IS NOT NULL THEN
        outcome := 'gone';
    ELSIF (s.ttl_seconds IS NOT NULL OR s.expires_at IS NOT NULL) AND ds_is_expired(s) THEN
        PERFORM ds_expire(s);
        outcome := 'not_found';
    END IF;
    IF outcome IS NOT NULL THEN
        FOR i IN 1..n LOOP
            RETURN NEXT;
        END LOOP;
        RETURN;
    END IF;

    v_seq := s.next_seq;
    v_pos := s.next_pos;
    v_closed := s.closed;
    v_closed_by := s.closed_by_producer;
    v_closed_epoch := s.closed_by_epoch;
    v_closed_seq := s.closed_by_seq;
    v_stream_seq := s.last_stream_seq;
    v_validation := s.validation_version;
    v_stream_media := ds_media_type(s.content_type);
    stream_id := s.id;

    -- 2. Judge each request (ds_append_verdict) against the stream as the requests before it
    -- left it, and apply what an accepted one changes: the tail, the producer ledger, closure.
    FOR i IN 1..n LOOP
        r := p_requests -> (i - 1);
        v_producer := r ->> 2;
        v_req_epoch := (r ->> 3)::bigint;
        v_req_seq := (r ->> 4)::bigint;
        v_req_stream_seq := r ->> 5;
        v_count := (r ->> 6)::int;
        v_bytes := (r ->> 7)::bigint;
        v_known := false;
        IF v_producer IS NOT NULL THEN
            SELECT p.epoch, p.last_seq INTO v_epoch, v_last
              FROM ds_producer AS p
             WHERE p.stream_id = s.id AND p.producer_id = v_producer;
            v_known := FOUND;
        END IF;

        outcome := ds_append_verdict(
            v_known, v_epoch, v_last, v_producer, v_req_epoch, v_req_seq,
            v_closed, v_closed_by, v_closed_epoch, v_closed_seq,
            v_count, (r ->> 1)::boolean, r ->> 0, v_stream_media,
            v_req_stream_seq, v_stream_seq,
            v_pos - s.first_pos - s.compacted_bytes + v_bytes <= p_max_stream_bytes,
            v_count = 0 OR (r ->> 8)::bigint IS NOT DISTINCT FROM v_validation);
        -- What the answer carries (PROTOCOL.md 5.2.1).
        producer_epoch := CASE
            WHEN outcome IN ('stale_epoch', 'duplicate') AND v_known AND v_req_epoch <= v_epoch
                THEN v_epoch
            WHEN outcome IN ('duplicate', 'appended') AND v_producer IS NOT NULL THEN v_req_epoch
        END;
        producer_seq := CASE
            WHEN outcome = 'duplicate' AND v_known AND v_req_epoch = v_epoch AND v_req_seq <= v_last
                THEN v_last
            WHEN outcome IN ('duplicate', 'appended') AND v_producer IS NOT NULL THEN v_req_seq
        END;
        expected_seq := CASE
            WHEN outcome = 'sequence_gap' THEN CASE WHEN v_known THEN v_last + 1 ELSE 0 END
        END;

        IF outcome = 'appended' THEN
            v_accept[i] := true;
            v_any := true;
            v_seq := v_seq + v_count;
            v_pos := v_pos + v_bytes;
            v_stream_seq := coalesce(v_req_stream_seq, v_stream_seq);
            IF v_producer IS NOT NULL THEN
                INSERT INTO ds_producer AS p (stream_id, producer_id, epoch, last_seq, updated_at)
                VALUES (s.id, v_producer, v_req_epoch, v_req_seq, now())
                ON CONFLICT ON CONSTRAINT ds_producer_pkey DO UPDATE
                   SET epoch = excluded.epoch, last_seq = excluded.last_seq,
                       updated_at = excluded.updated_at;
            END IF;
            IF (r ->> 1)::boolean THEN
                v_closed := true;
                v_closed_by := v_producer;
                v_closed_epoch := v_req_epoch;
                v_closed_seq := v_req_seq;
            END IF;
        END IF;
        next_seq := v_seq;
        next_pos := v_pos;
        closed := v_closed;
        RETURN NEXT;
    END LOOP;

    -- 3. Store the accepted requests' messages after the tail, the last message of each ending
    -- its batch (batch_end), and advance the stream; readers are notified after commit.
    IF v_any THEN
        IF cardinality(p_lengths) = 1 THEN
            -- The common case, one message: a plain insert, inline (a call costs more).
            INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
            VALUES (s.id, s.next_seq, s.next_pos, p_data, true);
        ELSE
            PERFORM ds_append_messages(s, v_accept, p_lengths, p_owners, p_data);
        END IF;
        UPDATE ds_stream AS t
           SET next_seq = v_seq, next_pos = v_pos, closed = v_closed,
               closed_by_producer = v_closed_by, closed_by_epoch = v_closed_epoch,
               closed_by_seq = v_closed_seq, last_stream_seq = v_stream_seq,
               -- Only a sliding TTL counts from the last access. accessed_at is indexed:
               -- changing it for every append ruled out HOT updates, so each append added
               -- an entry to every index of ds_stream (docs/benchmarks.md).
               accessed_at = CASE WHEN s.ttl_seconds IS NOT NULL THEN now()
                                  ELSE t.accessed_at END
         WHERE t.id = s.id;
        -- Readers in other processes hear of it only while some process watches the stream
        -- (streams.live). A process marks a stream watched BEFORE its readers read it, and the
        -- mark waits for this row lock: an append either committed before the mark (its
        -- readers read it) or sees the mark (its readers are notified).
        IF s.watched_until > now() THEN
            PERFORM pg_notify('ds_streams', ds_notify_payload(
                s, v_seq, v_closed, p_lengths, p_data, NOT (false = ANY (v_accept))));
        END IF;
    ELSIF s.ttl_seconds IS NOT NULL THEN
        UPDATE ds_stream AS t SET accessed_at = now() WHERE t.id = s.id;
    END IF;
END;
$$;

-- Group commit across streams: the batches of several streams in ONE statement (and so one
-- transaction, one commit), each stream's batch judged exactly as ds_append would judge it
-- alone. Every stream is locked first, in the order given (the caller sorts them by path, the
-- order every process locks streams in). The streams whose requests are all plain appends
-- (data of one media type and validation version, no producer, no close, no Stream-Seq) that
-- ds_append would accept as they are (the stream open, unexpired, of that media type and
-- version, with room for them) are written together, by one statement for all of them:
-- ds_append costs three times as much per stream, each of its statements starting an executor
-- of its own (docs/benchmarks.md). Every other stream goes through ds_append. Parameters:
--   p_paths: the streams; p_requests: per stream, its ds_append requests (for ds_append);
--   per stream (1-based in p_paths): p_messages / p_bytes, how many messages and bytes it
--   has; p_first_message / p_first_byte, where they start in p_lengths / p_owners and p_data;
--   p_media / p_versions, the media type and validation version of all of its requests when
--   they are plain appends (NULL media type: they are not);
--   per message: p_lengths, p_owners (its request within its stream, from 1), p_streams (its
--   stream), p_seqs / p_poss (messages and bytes of its stream before it), p_ends (it ends its
--   request); p_data: every message's bytes, in order.
-- Rows: the stream's ordinal, then ds_append's row; each stream's rows in request order.
-- Plans are generic: planned anew for each call's arrays, the write alone cost 0.4 ms.
CREATE OR REPLACE FUNCTION ds_append_streams(
    p_paths text[],
    p_requests jsonb,
    p_messages int[],
    p_bytes bigint[],
    p_first_message int[],
    p_first_byte int[],
    p_media text[],
    p_versions bigint[],
    p_lengths int[],
    p_owners int[],
    p_streams int[],
    p_seqs int[],
    p_poss bigint[],
    p_ends boolean[],
    p_data bytea,
    p_max_stream_bytes bigint
)
RETURNS TABLE (
    ordinal int, outcome ds_append_outcome, next_seq bigint, next_pos bigint, closed boolean,
    producer_epoch bigint, producer_seq bigint, expected_seq bigint, stream_id bigint
)
LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    c record;
    k int;
    -- The streams written together: ordinals, ids and tails before the batch.
    v_plain int[] := '{}';
    v_ids bigint[] := '{}';
    v_seqs bigint[] := '{}';
    v_poss bigint[] := '{}';
BEGIN
    -- 1. Every stream locked until the transaction ends, in path order; which ones take only
    -- plain appends that ds_append would accept (ds_append_verdict, for a request without
    -- producer, close or Stream-Seq), and their tails.
    FOR c IN
        SELECT p.k::int AS k, t AS s, t.deleted_at IS NULL AND NOT t.closed
                   AND (t.ttl_seconds IS NULL AND t.expires_at IS NULL OR NOT ds_is_expired(t))
                   AND p.media = ds_media_type(t.content_type)
                   AND p.version IS NOT DISTINCT FROM t.validation_version
                   AND t.next_pos - t.first_pos - t.compacted_bytes + p_bytes[p.k]
                       <= p_max_stream_bytes AS plain
          FROM ds_stream AS t
          JOIN unnest(p_paths, p_media, p_versions) WITH ORDINALITY AS p(path, media, version, k)
            ON p.path = t.path
         ORDER BY t.path
           FOR UPDATE OF t
    LOOP
        CONTINUE WHEN c.plain IS NOT TRUE;  -- NULL: no plain media type given
        v_plain := v_plain || c.k;
        v_ids := v_ids || (c.s).id;
        v_seqs := v_seqs || (c.s).next_seq;
        v_poss := v_poss || (c.s).next_pos;
        -- Readers in other processes hear of it (as in ds_append).
        IF (c.s).watched_until > now() THEN
            PERFORM pg_notify('ds_streams', ds_notify_payload(
                c.s, (c.s).next_seq + p_messages[c.k], false,
                p_lengths[p_first_message[c.k] : p_first_message[c.k] + p_messages[c.k] - 1],
                substring(p_data FROM p_first_byte[c.k] FOR p_bytes[c.k]::int), true));
        END IF;
    END LOOP;

    -- 2. The plain streams' messages stored after their tails, the streams advanced, each
    -- request answered with the tail after it (its last message's end).
    IF cardinality(v_plain) > 0 THEN
        RETURN QUERY
        WITH plain AS (
            SELECT * FROM unnest(v_plain, v_ids, v_seqs, v_poss) AS a(k, id, next_seq, next_pos)
        ), message AS (
            SELECT m.*, a.id, a.next_seq + m.seq AS at_seq, a.next_pos + m.pos AS at_pos
              FROM unnest(p_streams, p_seqs, p_poss, p_lengths, p_ends)
                   WITH ORDINALITY AS m(k, seq, pos, len, last, ord)
              JOIN plain AS a ON a.k = m.k
        ), stored AS (
            INSERT INTO ds_message (stream_id, seq, pos, data, batch_end)
            SELECT m.id, m.at_seq, m.at_pos,
                   substring(p_data FROM p_first_byte[m.k] + m.pos::int FOR m.len), m.last
              FROM message AS m
        ), advanced AS (
            UPDATE ds_stream AS t
               SET next_seq = a.next_seq + p_messages[a.k], next_pos = a.next_pos + p_bytes[a.k],
                   -- As in ds_append: only a sliding TTL counts from the last access.
                   accessed_at = CASE WHEN t.ttl_seconds IS NOT NULL THEN now()
                                      ELSE t.accessed_at END
              FROM plain AS a
             WHERE t.id = a.id
        )
        SELECT m.k, 'appended'::ds_append_outcome, m.at_seq + 1, m.at_pos + m.len, false,
               NULL::bigint, NULL::bigint, NULL::bigint, m.id
          FROM message AS m WHERE m.last ORDER BY m.ord;
    END IF;

    -- 3. Every other stream, judged and written by ds_append.
    FOR k IN 1..cardinality(p_paths) LOOP
        CONTINUE WHEN k = ANY (v_plain);
        RETURN QUERY SELECT k, a.* FROM ds_append(
            p_paths[k], p_requests -> (k - 1),
            p_lengths[p_first_message[k] : p_first_message[k] + p_messages[k] - 1],
            p_owners[p_first_message[k] : p_first_message[k] + p_messages[k] - 1],
            substring(p_data FROM p_first_byte[k] FOR p_bytes[k]::int),
            p_max_stream_bytes) AS a;
    END LOOP;
END;
$$;

-- Mark streams watched for p_seconds: their appends notify until then (streams.live, Watched
-- streams). The rows are locked in path order, the order every writer locks streams in, so a
-- mark of many streams cannot deadlock with a group commit across them; each lock waits for
-- the appends in flight on its stream to commit. The commit does not wait for its WAL flush
-- (synchronous_commit off, for this transaction only): the order of locks is what readers
-- rely on, and a mark a crash loses is made again when the process reconnects.
CREATE OR REPLACE FUNCTION ds_watch_streams(p_ids bigint[], p_seconds double precision)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE ds_stream AS t SET watched_until = now() + make_interval(secs => p_seconds)
      FROM (SELECT id FROM ds_stream WHERE id = ANY(p_ids) ORDER BY path FOR UPDATE) AS w
     WHERE t.id = w.id;
END;
$$;

-- Renew marks, as ds_watch_streams makes them, of the streams whose rows nobody else holds: one
-- row another session held made the renewal of every stream a process watched wait, time out
-- and fail, and their marks ran out (probe 10i). A held row's mark is renewed at the next
-- round. The streams renewed, each with whether its mark had run out: appends may have
-- committed meanwhile without notifying, and its readers must read again.
CREATE OR REPLACE FUNCTION ds_renew_watches(p_ids bigint[], p_seconds double precision)
RETURNS TABLE (stream_id bigint, lapsed boolean)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
    WITH w AS (
        SELECT s.id, s.watched_until FROM ds_stream AS s
         WHERE s.id = ANY(p_ids) ORDER BY s.path FOR UPDATE SKIP LOCKED
    ), renewed AS (
        UPDATE ds_stream AS t SET watched_until = now() + make_interval(secs => p_seconds)
          FROM w WHERE t.id = w.id
        RETURNING t.id, coalesce(w.watched_until <= now(), true)
    )
    SELECT * FROM renewed;
END;
$$;
