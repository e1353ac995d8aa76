-- Subscriptions in the database (PROTOCOL.md 6, 7), installed after streams/store/sql/.
--
-- Every subscription's state is a row of ds_subscription (the wake in flight, its lease, the
-- retry schedule) and one ds_subscription_link row per followed stream (its acked offset), so
-- any server process can act for any subscription: each change locks the subscription's row,
-- which is what keeps one wake in flight per subscription across processes. Functions return
-- ds_sub_outcome values (subscriptions/outcomes.py maps them to answers).
--
-- Triggers on ds_stream see every path that changes a stream (client writes, the server's own
-- writes to __registry__ and wake streams, deletes by expiry or cascade), without sharing the
-- streams app's ds_hook_* functions with the state app:
-- * a stream created is linked to the subscriptions whose pattern matches it, at its tail, in
--   its own transaction: before its first append wakes anyone (PROTOCOL.md 6.2);
-- * an append to a linked stream sends a NOTIFY "sub:<subscription ids>" on the live-delivery
--   channel, after commit; any process hearing it issues the wake (subscriptions/delivery.py);
-- * a deleted stream loses its glob links; its explicit links go back to offset zero.
-- An append to a stream no subscription follows costs nothing once it is known to be one.
--
-- Lock order: a subscription row, then a wake stream's row (its wake event), then link rows.
-- Wakes of several subscriptions lock them in id order. Deadlocks left possible by concurrent
-- stream deletes are detected by PostgreSQL and the statement retried by the caller.

-- Subscription creation (exclusive) and stream creation (shared) take this advisory lock, so
-- a stream created while a pattern subscription is being created is either backfilled by it or
-- linked by the trigger: never neither.
CREATE OR REPLACE FUNCTION ds_sub_link_lock() RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT 6275718392001::bigint $$;

-- Paths subscriptions can follow: not the reserved __ds/ streams (Yjs documents).
CREATE OR REPLACE FUNCTION ds_sub_followable(p_path text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$ SELECT NOT starts_with(p_path, '__ds/') $$;

-- A webhook retry's delay after p_failures failed attempts in a row (PROTOCOL.md 7.1): 1 s
-- doubling up to 60 s, times 1 + p_jitter (p_jitter drawn in [-0.2, 0.2] by the caller).
CREATE OR REPLACE FUNCTION ds_sub_retry_delay(p_failures int, p_jitter float8) RETURNS interval
LANGUAGE sql IMMUTABLE AS $$
    SELECT make_interval(secs => least(2.0 ^ greatest(p_failures - 1, 0), 60.0)
                                 * (1 + greatest(-0.2, least(0.2, p_jitter))))
$$;

-- ---------------------------------------------------------------------------------------------
-- Triggers on ds_stream

-- The literal beginnings a pattern matching p_path can have (subscriptions.protocol
-- .glob_prefix): '', each run of whole segments with its '/', the path itself (a pattern
-- without wildcards) and the path with a '/' ('a/' of 'a/**', whose '**' matches no segment
-- at all, so 'a' itself). Looked up in an index, so a stream's creation costs the same with 10
-- or 100,000 pattern subscriptions.
-- plpgsql, not sql: an SQL function with a query is planned at every call (80 us here). Not
-- IMMUTABLE: folded into a constant, it made each caller's plan a custom one, planned anew at
-- every stream creation (300 us).
CREATE OR REPLACE FUNCTION ds_sub_prefixes(p_path text) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_parts text[] := string_to_array(p_path, '/');
    v_prefix text := '';
    v_prefixes text[] := ARRAY['', p_path, p_path || '/'];
BEGIN
    FOR n IN 1 .. cardinality(v_parts) - 1 LOOP
        v_prefix := v_prefix || v_parts[n] || '/';
        v_prefixes := v_prefixes || v_prefix;
    END LOOP;
    RETURN v_prefixes;
END;
$$;

CREATE OR REPLACE FUNCTION ds_sub_stream_created() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    s record;
BEGIN
    IF NOT ds_sub_followable(NEW.path) THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(ds_sub_link_lock());
    -- Links kept by path (explicit links, links of a deleted stream) start at the new tail.
    UPDATE ds_subscription_link SET acked_seq = NEW.next_seq, acked_pos = NEW.next_pos
     WHERE path = NEW.path;
    -- No pattern subscription at all (after the lock: one being created is visible by now):
    -- nothing to match, and the candidates' lookup below is most of this trigger's cost.
    IF NOT EXISTS (SELECT 1 FROM ds_subscription AS c WHERE c.pattern_regex IS NOT NULL) THEN
        RETURN NULL;
    END IF;
    -- Candidates by literal beginning first, then their regular expression (compiled for each
    -- row it is tried on: 9 ms for 1,000 patterns, against microseconds for the prefixes); an
    -- insert only for a match (an INSERT ... ON CONFLICT costs its planning even with no row).
    FOR s IN SELECT c.id, c.pattern_regex, c.wake_stream
               FROM unnest(ds_sub_prefixes(NEW.path)) AS p(prefix)
               JOIN ds_subscription AS c
                 ON c.pattern_prefix = p.prefix AND c.pattern_regex IS NOT NULL
              ORDER BY c.id
    LOOP
        IF ('/' || NEW.path) ~ s.pattern_regex AND NEW.path IS DISTINCT FROM s.wake_stream THEN
            INSERT INTO ds_subscription_link AS l (sid, path, explicit, glob, acked_seq, acked_pos)
            VALUES (s.id, NEW.path, false, true, NEW.next_seq, NEW.next_pos)
            ON CONFLICT (sid, path) DO UPDATE SET glob = true;
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

-- BEFORE, not AFTER: no after-trigger event to queue, on the append path.
-- Runs only for a stream marked followed (ds_stream.followed, true when it is created): one
-- that no subscription follows is marked not followed by its next append, and its appends
-- after that call nothing (the lookup and the call were 30 us of an append). A link added
-- marks its stream followed again (ds_sub_links_added), taking the stream's row lock first: so
-- an append that found no link either committed before that lock (and the mark comes after
-- it) or waits for it (and finds the link).
CREATE OR REPLACE FUNCTION ds_sub_stream_advanced() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_sids text;
    v_count int;
BEGIN
    SELECT string_agg(l.sid::text, ','), count(*) INTO v_sids, v_count
      FROM ds_subscription_link AS l WHERE l.path = NEW.path;
    IF v_count > 0 THEN
        -- NOTIFY payloads are bounded (8000 bytes): past 200 subscriptions, the stream's id
        -- ("@id"), whose subscriptions the listener looks up.
        PERFORM pg_notify('ds_streams',
                          'sub:' || CASE WHEN v_count > 200 THEN '@' || NEW.id ELSE v_sids END);
    ELSE
        NEW.followed := false;
    END IF;
    RETURN NEW;
END;
$$;

-- Links added (whichever way: creation, backfill, a stream created under a pattern, the admin)
-- mark their streams followed. Every one of those stream rows is locked, in path order (the
-- order writers lock streams in), even one already marked: an append holding it may be about
-- to mark it not followed (ds_sub_stream_advanced).
CREATE OR REPLACE FUNCTION ds_sub_links_added() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE ds_stream AS t SET followed = true
      FROM (SELECT s.id, s.followed FROM ds_stream AS s
             WHERE s.path IN (SELECT a.path FROM added AS a)
             ORDER BY s.path FOR UPDATE) AS w
     WHERE t.id = w.id AND NOT w.followed;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION ds_sub_stream_removed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM ds_subscription_link WHERE path = OLD.path AND NOT explicit;
    UPDATE ds_subscription_link SET glob = false, acked_seq = 0, acked_pos = 0
     WHERE path = OLD.path;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS ds_sub_stream_created ON ds_stream;
CREATE TRIGGER ds_sub_stream_created AFTER INSERT ON ds_stream
    FOR EACH ROW EXECUTE FUNCTION ds_sub_stream_created();
DROP TRIGGER IF EXISTS ds_sub_stream_advanced ON ds_stream;
CREATE TRIGGER ds_sub_stream_advanced BEFORE UPDATE OF next_seq ON ds_stream
    FOR EACH ROW WHEN (NEW.next_seq > OLD.next_seq AND OLD.followed)
    EXECUTE FUNCTION ds_sub_stream_advanced();
DROP TRIGGER IF EXISTS ds_sub_links_added ON ds_subscription_link;
CREATE TRIGGER ds_sub_links_added AFTER INSERT ON ds_subscription_link
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION ds_sub_links_added();
DROP TRIGGER IF EXISTS ds_sub_stream_deleted ON ds_stream;
CREATE TRIGGER ds_sub_stream_deleted AFTER DELETE ON ds_stream
    FOR EACH ROW EXECUTE FUNCTION ds_sub_stream_removed();
DROP TRIGGER IF EXISTS ds_sub_stream_soft_deleted ON ds_stream;
CREATE TRIGGER ds_sub_stream_soft_deleted AFTER UPDATE OF deleted_at ON ds_stream
    FOR EACH ROW WHEN (OLD.deleted_at IS NULL AND NEW.deleted_at IS NOT NULL)
    EXECUTE FUNCTION ds_sub_stream_removed();

-- ---------------------------------------------------------------------------------------------
-- Reading a subscription

-- The links of a subscription as the protocol shows them (PROTOCOL.md 6.3, 7.1, 7.2): path,
-- link_type (explicit wins over glob), acked_offset, and with p_tails the stream's tail and
-- whether it has pending work. A stream that does not exist has tail zero.
CREATE OR REPLACE FUNCTION ds_sub_streams(p_sid bigint, p_tails boolean) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_agg(
        CASE WHEN p_tails THEN jsonb_build_object(
            'path', l.path,
            'link_type', CASE WHEN l.explicit THEN 'explicit' ELSE 'glob' END,
            'acked_offset', ds_offset(l.acked_seq, l.acked_pos),
            'tail_offset', ds_offset(coalesce(t.next_seq, 0), coalesce(t.next_pos, 0)),
            'has_pending', coalesce(t.next_seq, 0) > l.acked_seq,
            'stream_id', t.id)
        ELSE jsonb_build_object(
            'path', l.path,
            'link_type', CASE WHEN l.explicit THEN 'explicit' ELSE 'glob' END,
            'acked_offset', ds_offset(l.acked_seq, l.acked_pos))
        END ORDER BY l.path), '[]'::jsonb)
      FROM ds_subscription_link AS l
      LEFT JOIN ds_stream AS t ON t.path = l.path AND t.deleted_at IS NULL
     WHERE l.sid = p_sid
$$;

-- The first followed stream (by path) with events past its acked offset; NULL: no pending work.
CREATE OR REPLACE FUNCTION ds_sub_first_pending(p_sid bigint) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT l.path FROM ds_subscription_link AS l
      JOIN ds_stream AS t ON t.path = l.path AND t.deleted_at IS NULL
     WHERE l.sid = p_sid AND t.next_seq > l.acked_seq
     ORDER BY l.path LIMIT 1
$$;

-- The streams of a wake as clients see them: without the ids of the streams listed.
CREATE OR REPLACE FUNCTION ds_sub_public_streams(p_streams jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(jsonb_agg(e - 'stream_id' ORDER BY o), '[]'::jsonb)
      FROM jsonb_array_elements(coalesce(p_streams, '[]'::jsonb)) WITH ORDINALITY AS x(e, o)
$$;

-- Whether the wake listed p_path as another stream than p_id (one since deleted, or none at
-- all then). A path the wake does not list, or listed before ids were recorded, is not.
CREATE OR REPLACE FUNCTION ds_sub_listed_other(p_streams jsonb, p_path text, p_id bigint)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM jsonb_array_elements(coalesce(p_streams, '[]'::jsonb)) AS e
         WHERE e ->> 'path' = p_path AND e ? 'stream_id'
           AND (e ->> 'stream_id')::bigint IS DISTINCT FROM p_id)
$$;

-- What the process that issued a webhook wake sends (subscriptions/delivery.py).
CREATE OR REPLACE FUNCTION ds_sub_delivery(s ds_subscription) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'sid', s.id, 'subscription_id', s.subscription_id, 'generation', s.generation,
        'wake_id', s.wake_id, 'url', s.webhook_url, 'base_url', s.base_url,
        'streams', ds_sub_public_streams(s.wake_streams))
$$;

-- ---------------------------------------------------------------------------------------------
-- Management (PROTOCOL.md 6)

-- Explicit links of subscription p_sid to p_streams, each at its stream's tail (0 for a
-- stream not created yet); a stream already linked (by the glob) is marked explicit, its
-- cursor kept.
CREATE OR REPLACE FUNCTION ds_sub_link_explicit(p_sid bigint, p_streams text[]) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO ds_subscription_link AS l (sid, path, explicit, glob, acked_seq, acked_pos)
    SELECT p_sid, p.path, true, false, coalesce(t.next_seq, 0), coalesce(t.next_pos, 0)
      FROM unnest(p_streams) AS p(path)
      LEFT JOIN ds_stream AS t ON t.path = p.path AND t.deleted_at IS NULL
    ON CONFLICT (sid, path) DO UPDATE SET explicit = true;
$$;

-- Create, or re-confirm with the same configuration hash (6.2). New links start at the
-- stream's tail: explicit streams, and existing streams the pattern matches (the backfill).
-- Only a pattern needs the link lock (ds_sub_link_lock); two creations of one id race on the
-- unique id, and the loser answers as if it had come second.
CREATE OR REPLACE FUNCTION ds_sub_create(
    p_id text, p_type text, p_pattern text, p_regex text, p_prefix text, p_streams text[],
    p_url text, p_wake_stream text, p_lease_ttl_ms int, p_description text, p_hash text,
    p_base_url text, p_created_by text
) RETURNS ds_sub_outcome
LANGUAGE plpgsql AS $$
DECLARE
    v_sid bigint;
    v_hash text;
BEGIN
    SELECT id, config_hash INTO v_sid, v_hash FROM ds_subscription WHERE subscription_id = p_id;
    IF FOUND THEN
        IF v_hash = p_hash THEN
            PERFORM ds_sub_adopt(v_sid, p_created_by);
        END IF;
        RETURN CASE WHEN v_hash = p_hash THEN 'exists' ELSE 'conflict' END::ds_sub_outcome;
    END IF;
    IF p_wake_stream = ANY (p_streams) THEN
        RETURN 'invalid_stream';
    END IF;
    IF p_regex IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(ds_sub_link_lock());
    END IF;
    INSERT INTO ds_subscription (
        subscription_id, type, pattern, pattern_regex, pattern_prefix, webhook_url, wake_stream,
        lease_ttl_ms, description, config_hash, base_url, created_at, created_by, paused,
        generation, failed_attempts, last_error
    ) VALUES (
        p_id, p_type, p_pattern, p_regex, p_prefix, p_url, p_wake_stream,
        p_lease_ttl_ms, p_description, p_hash, p_base_url, now(), p_created_by, false, 0, 0, ''
    ) ON CONFLICT (subscription_id) DO NOTHING
    RETURNING id INTO v_sid;
    IF v_sid IS NULL THEN
        SELECT config_hash INTO v_hash FROM ds_subscription WHERE subscription_id = p_id;
        RETURN CASE WHEN v_hash = p_hash THEN 'exists' ELSE 'conflict' END::ds_sub_outcome;
    END IF;
    PERFORM ds_sub_link_explicit(v_sid, p_streams);
    IF p_regex IS NOT NULL THEN
        INSERT INTO ds_subscription_link AS l (sid, path, explicit, glob, acked_seq, acked_pos)
        SELECT v_sid, t.path, false, true, t.next_seq, t.next_pos
          FROM ds_stream AS t
         WHERE t.deleted_at IS NULL AND ds_sub_followable(t.path)
           -- || '/': the prefix 'a/' of 'a/**' begins the path 'a' it matches.
           AND starts_with(t.path || '/', p_prefix) AND ('/' || t.path) ~ p_regex
           AND t.path IS DISTINCT FROM p_wake_stream
        ON CONFLICT (sid, path) DO UPDATE SET glob = true;
    END IF;
    RETURN 'created';
END;
$$;

-- Delete (6.3): the links go with it; a wake in flight is fenced (its token names a row that
-- no longer exists). A subscription is deleted under the link lock, as a pattern one is
-- created: a stream's creation links it to the pattern subscriptions its trigger finds, and one
-- deleted meanwhile failed that insert, and with it the create (a 500). Every delete takes it
-- (one that looked at the row first could find a pattern subscription created after its look,
-- found by review); deletes are rare. The lock comes before the row's: the trigger holds it
-- shared when its insert checks the row.
CREATE OR REPLACE FUNCTION ds_sub_delete(p_id text) RETURNS ds_sub_outcome
LANGUAGE plpgsql AS $$
DECLARE
    v_sid bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(ds_sub_link_lock());
    SELECT id INTO v_sid FROM ds_subscription WHERE subscription_id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    DELETE FROM ds_subscription_link WHERE sid = v_sid;
    DELETE FROM ds_subscription WHERE id = v_sid;
    RETURN 'ok';
END;
$$;

-- Explicit membership (6.4): add links at the streams' tails (already linked: marked
-- explicit, cursor kept), or drop the explicit mark (the link stays while the glob matches).
CREATE OR REPLACE FUNCTION ds_sub_add_streams(p_id text, p_streams text[]) RETURNS ds_sub_outcome
LANGUAGE plpgsql AS $$
DECLARE
    s ds_subscription;
BEGIN
    SELECT * INTO s FROM ds_subscription WHERE subscription_id = p_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN 'not_found';
    ELSIF s.wake_stream = ANY (p_streams) THEN
        RETURN 'invalid_stream';
    END IF;
    PERFORM ds_sub_link_explicit(s.id, p_streams);
    RETURN 'ok';
END;
$$;

CREATE OR REPLACE FUNCTION ds_sub_remove_stream(p_id text, p_path text) RETURNS ds_sub_outcome
LANGUAGE plpgsql AS $$
DECLARE
    v_sid bigint;
BEGIN
    SELECT id INTO v_sid FROM ds_subscription WHERE subscription_id = p_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    UPDATE ds_subscription_link SET explicit = false WHERE sid = v_sid AND path = p_path;
    DELETE FROM ds_subscription_link
     WHERE sid = v_sid AND path = p_path AND NOT explicit AND NOT glob;
    RETURN 'ok';
END;
$$;

-- ---------------------------------------------------------------------------------------------
-- Wakes (PROTOCOL.md 7)

-- End the wake in flight (done, released, failed, lease expired): no holder, no token.
CREATE OR REPLACE FUNCTION ds_sub_end_wake(p_sid bigint) RETURNS void
LANGUAGE sql AS $$
    UPDATE ds_subscription
       SET wake_id = NULL, wake_state = NULL, holder = NULL, lease_expires_at = NULL,
           sender = NULL, send_deadline = NULL, wake_streams = NULL
     WHERE id = p_sid
$$;

-- Append a wake event to a pull-wake subscription's wake stream (7.2), through ds_append like
-- any append (its readers are woken by its NOTIFY). NULL when written, else why not: the wake
-- stays claimable anyway, and the reason is recorded.
CREATE OR REPLACE FUNCTION ds_sub_wake_event(
    s ds_subscription, p_generation bigint, p_stream text, p_max_bytes bigint
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_media text;
    v_event bytea;
    v_outcome ds_append_outcome;
BEGIN
    SELECT ds_media_type(t.content_type) INTO v_media FROM ds_stream AS t
     WHERE t.path = s.wake_stream AND t.deleted_at IS NULL;
    IF NOT FOUND THEN
        RETURN 'the wake stream ' || s.wake_stream || ' does not exist';
    ELSIF v_media <> 'application/json' THEN
        -- Events are JSON messages; in a stream of bytes they would run together.
        RETURN 'the wake stream ' || s.wake_stream || ' is ' || v_media
            || ', not application/json';
    END IF;
    v_event := convert_to(jsonb_build_object(
        'type', 'wake', 'subscription_id', s.subscription_id, 'stream', p_stream,
        'generation', p_generation,
        'ts', (extract(epoch FROM clock_timestamp()) * 1000)::bigint)::text, 'UTF8');
    SELECT a.outcome INTO v_outcome FROM ds_append(
        s.wake_stream,
        jsonb_build_array(jsonb_build_array(
            v_media, false, NULL, NULL, NULL, NULL, 1, octet_length(v_event), NULL)),
        ARRAY[octet_length(v_event)], ARRAY[1], v_event, p_max_bytes) AS a;
    IF v_outcome <> 'appended' THEN
        RETURN 'the wake stream ' || s.wake_stream || ' refused the wake event: ' || v_outcome;
    END IF;
    RETURN NULL;
END;
$$;

-- Why a subscription is paused when its creator lost standing (ds_sub_orphaned): its
-- last_error, which ds_sub_adopt and ds_sub_pause recognize.
CREATE OR REPLACE FUNCTION ds_sub_orphaned_reason() RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT 'paused: the API key that created it was revoked, has expired or was deleted'
$$;

-- Whether a subscription made by p_created_by lost its creator (a key revoked, expired or
-- deleted: ds_sub_orphaned).
CREATE OR REPLACE FUNCTION ds_sub_creator_lost(p_created_by text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT p_created_by IS NOT NULL AND split_part(p_created_by, ':', 1) IN ('key', 'signed-url')
       AND NOT EXISTS (SELECT 1 FROM ds_api_key AS k
                        WHERE k.prefix = split_part(p_created_by, ':', 2) AND NOT k.revoked
                          AND (k.expiry_date IS NULL OR k.expiry_date > now()))
$$;

-- The same configuration PUT again (6.2: 200) by p_created_by, who stands, for a subscription
-- paused because its creator lost standing (ds_sub_orphaned): it is theirs now, and resumes.
-- (A PUT answered 200 and left it paused for good: review.) A pause of an operator's stays.
CREATE OR REPLACE FUNCTION ds_sub_adopt(p_sid bigint, p_created_by text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_created_by IS NULL OR ds_sub_creator_lost(p_created_by) THEN
        RETURN;
    END IF;
    UPDATE ds_subscription
       SET created_by = p_created_by, paused = false, last_error = '',
           last_error_at = NULL
     WHERE id = p_sid AND paused AND last_error = ds_sub_orphaned_reason()
       AND ds_sub_creator_lost(created_by);
    IF FOUND THEN
        PERFORM pg_notify('ds_streams', 'sub:' || p_sid);
    END IF;
END;
$$;

-- Whether the subscription s (its row locked by the caller) lost its creator: one made with an
-- API key wakes nobody once the key is revoked, has expired or was deleted (its webhooks went
-- on naming the streams that changed to whoever holds the URL: a review's finding). It is
-- paused then, with the reason, where staff see it. Other creators are not judged again: a
-- JWT's subject outlives any one token, and staff and services are the server's own.
CREATE OR REPLACE FUNCTION ds_sub_orphaned(s ds_subscription) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ds_sub_creator_lost(s.created_by) THEN
        RETURN false;
    END IF;
    UPDATE ds_subscription
       SET paused = true,
           last_error = ds_sub_orphaned_reason(),
           last_error_at = now()
     WHERE id = s.id;
    RETURN true;
END;
$$;

-- Issue a wake for the subscription s (its row locked by the caller) when it is idle, not
-- paused, not waiting for a webhook retry, and has pending work (7): a new generation and
-- wake id, the streams' tails reported; a webhook wake is sent by process p_sender (presumed
-- dead after p_send_secs), a pull-wake one written to the wake stream (p_event) for a worker
-- to claim. Returns the subscription as it now is, or NULL when no wake was issued.
CREATE OR REPLACE FUNCTION ds_sub_issue(
    s ds_subscription, p_sender text, p_send_secs float8, p_max_bytes bigint, p_event boolean
) RETURNS ds_subscription
LANGUAGE plpgsql AS $$
DECLARE
    v_stream text;
    v_error text;
    r ds_subscription;
BEGIN
    IF s.wake_id IS NOT NULL OR s.paused OR s.next_attempt_at > now() THEN
        RETURN NULL;
    END IF;
    v_stream := ds_sub_first_pending(s.id);
    IF v_stream IS NULL OR ds_sub_orphaned(s) THEN
        RETURN NULL;
    END IF;
    IF s.type = 'pull-wake' AND p_event THEN
        v_error := ds_sub_wake_event(s, s.generation + 1, v_stream, p_max_bytes);
    END IF;
    UPDATE ds_subscription AS t
       SET generation = s.generation + 1,
           wake_id = 'w_' || replace(gen_random_uuid()::text, '-', ''),
           wake_state = CASE WHEN s.type = 'webhook' THEN 'sending' ELSE 'issued' END,
           woken_at = now(),
           wake_streams = ds_sub_streams(s.id, true),
           sender = CASE WHEN s.type = 'webhook' THEN p_sender END,
           send_deadline = CASE WHEN s.type = 'webhook'
                                THEN now() + make_interval(secs => p_send_secs) END,
           -- A pull-wake wake whose event could not be written (the wake stream missing,
           -- closed, full) ends after a lease unless claimed, and is announced again then
           -- (ds_sub_expire): no worker hears of it otherwise, and a wake in flight blocks
           -- every later one (found by a probe: the subscription stalled for good). One whose
           -- event was written waits for a claim, as 7.3 has it (announcing it again every
           -- lease filled an idle subscription's wake stream, found by review). A claim sets
           -- the lease proper.
           lease_expires_at = CASE WHEN s.type = 'pull-wake' AND p_event AND v_error IS NOT NULL
                                   THEN now() + make_interval(secs => s.lease_ttl_ms / 1000.0)
                              END,
           last_error = coalesce(v_error, t.last_error),
           last_error_at = CASE WHEN v_error IS NOT NULL THEN now() ELSE t.last_error_at END
     WHERE t.id = s.id
    RETURNING t.* INTO r;
    RETURN r;
END;
$$;

-- Wake these subscriptions if they are idle with pending work (a NOTIFY of an append, the
-- sweep): locked in id order, waiting for a lock held by another process's change, so that
-- a wake ending there and an append committing meanwhile are both seen. Whether a wake is in
-- flight is judged only once the row is locked: a condition in the WHERE clause would be
-- judged on the snapshot taken before the wait, and a wake ended meanwhile (by a done that
-- did not see the append) would leave the append unwoken until the sweep (measured: 1% of
-- wakes 1 s late). Returns what this process must now send: one delivery per webhook wake.
CREATE OR REPLACE FUNCTION ds_sub_wake(
    p_sids bigint[], p_sender text, p_send_secs float8, p_max_bytes bigint
) RETURNS SETOF jsonb
LANGUAGE plpgsql AS $$
DECLARE
    s ds_subscription;
    r ds_subscription;
BEGIN
    FOR s IN SELECT * FROM ds_subscription WHERE id = ANY (p_sids) ORDER BY id FOR NO KEY UPDATE
    LOOP
        r := ds_sub_issue(s, p_sender, p_send_secs, p_max_bytes, true);
        IF r.id IS NOT NULL AND r.type = 'webhook' THEN
            RETURN NEXT ds_sub_delivery(r);
        END IF;
    END LOOP;
END;
$$;

-- Idle subscriptions with pending work whose retry (if any) is due: the sweep wakes them.
CREATE OR REPLACE FUNCTION ds_sub_candidates(p_limit int) RETURNS SETOF bigint
LANGUAGE sql STABLE AS $$
    SELECT s.id FROM ds_subscription AS s
     WHERE s.wake_id IS NULL AND NOT s.paused
       AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= now())
       AND ds_sub_first_pending(s.id) IS NOT NULL
     ORDER BY s.next_attempt_at NULLS LAST, s.id
     LIMIT p_limit
$$;

-- The sweep's look for work a lost notification left behind, a step at a time: idle
-- subscriptions in id order from the cursor (p_after_sid, and past p_after_path within it),
-- looking at no more than p_links links in all. ds_sub_candidates looked at every link of every
-- idle subscription every second in each process: one tenant's 30 subscriptions over 20,000
-- streams kept two backends busy all the time (found by a probe). Returns the subscriptions
-- found with pending work and where the next step starts (0 and '' once every subscription
-- was looked at: the next step starts over). Subscriptions whose retry fell due are found by
-- ds_sub_due, every sweep.
CREATE OR REPLACE FUNCTION ds_sub_sweep_step(
    p_after_sid bigint, p_after_path text, p_links int,
    OUT sids bigint[], OUT next_sid bigint, OUT next_path text
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_sid bigint;
    v_budget int := greatest(p_links, 1);
    v_seen int;
    v_last text;
    v_pending boolean;
    v_from text;
BEGIN
    sids := '{}';
    FOR v_sid IN
        SELECT s.id FROM ds_subscription AS s
         WHERE s.id >= p_after_sid AND s.wake_id IS NULL AND NOT s.paused
           AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= now())
         ORDER BY s.id
    LOOP
        -- Where to start in its links: a bound of the (sid, path) index, not a filter (that
        -- read every link before the cursor again at each step).
        v_from := CASE WHEN v_sid = p_after_sid THEN p_after_path ELSE '' END;
        SELECT count(*), max(l.path), coalesce(bool_or(t.next_seq > l.acked_seq), false)
          INTO v_seen, v_last, v_pending
          FROM (SELECT l.path, l.acked_seq FROM ds_subscription_link AS l
                 WHERE l.sid = v_sid AND l.path > v_from
                 ORDER BY l.path LIMIT v_budget) AS l
          LEFT JOIN ds_stream AS t ON t.path = l.path AND t.deleted_at IS NULL;
        IF v_pending THEN
            sids := sids || v_sid;
        END IF;
        v_budget := v_budget - greatest(v_seen, 1);  -- one without links costs a look too
        IF v_budget <= 0 THEN
            -- Spent: go on within this subscription, unless it is known to have work.
            next_sid := CASE WHEN v_pending THEN v_sid + 1 ELSE v_sid END;
            next_path := CASE WHEN v_pending THEN '' ELSE v_last END;
            RETURN;
        END IF;
    END LOOP;
    next_sid := 0;
    next_path := '';
END;
$$;

-- Idle subscriptions whose retry fell due within the last minute, with pending work (one due
-- longer ago, whose work went away, is not looked at every second for ever: the sweep's
-- steps find it, found by review).
CREATE OR REPLACE FUNCTION ds_sub_due(p_limit int) RETURNS SETOF bigint
LANGUAGE sql STABLE AS $$
    SELECT s.id FROM ds_subscription AS s
     WHERE s.wake_id IS NULL AND NOT s.paused
       AND s.next_attempt_at <= now() AND s.next_attempt_at > now() - interval '1 minute'
       AND ds_sub_first_pending(s.id) IS NOT NULL
     ORDER BY s.next_attempt_at, s.id
     LIMIT p_limit
$$;

-- End wakes whose lease expired (7.3) or whose webhook sender stopped (its deadline passed);
-- the caller then wakes the returned subscriptions again if work is pending.
CREATE OR REPLACE FUNCTION ds_sub_expire(p_limit int) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    s ds_subscription;
BEGIN
    FOR s IN SELECT * FROM ds_subscription
              WHERE lease_expires_at < now() OR send_deadline < now()
              ORDER BY id LIMIT p_limit FOR NO KEY UPDATE SKIP LOCKED
    LOOP
        PERFORM ds_sub_end_wake(s.id);
        UPDATE ds_subscription
           SET last_error = CASE
                   WHEN s.wake_state = 'sending'
                       THEN 'the process sending generation ' || s.generation || ' stopped'
                   WHEN s.wake_state = 'claimed'
                       THEN 'the lease of ' || s.holder || ' on generation ' || s.generation
                            || ' expired'
                   WHEN s.wake_state = 'issued'
                       THEN 'the wake event of generation ' || s.generation
                            || ' could not be written, and no worker claimed it within the lease'
                   ELSE 'no callback for generation ' || s.generation || ' within the lease'
               END,
               last_error_at = now()
         WHERE id = s.id;
        RETURN NEXT s.id;
    END LOOP;
END;
$$;

-- The outcome of sending a webhook wake (7.1), by the process that sent it: a failure ends
-- the wake and schedules the next attempt (the schedule lives here, so any process, after any
-- restart, honours it); {"done": true} acks the tails the wake reported and ends it; any other
-- 2xx leaves the receiver the lease to call back. Nothing happens when the wake is no longer
-- current (a callback ended it first). Returns the next delivery when a done left pending
-- work (issued at once, for this process to send).
CREATE OR REPLACE FUNCTION ds_sub_delivered(
    p_sid bigint, p_wake text, p_done boolean, p_error text, p_jitter float8,
    p_sender text, p_send_secs float8, p_max_bytes bigint
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    s ds_subscription;
    r ds_subscription;
BEGIN
    SELECT * INTO s FROM ds_subscription WHERE id = p_sid FOR NO KEY UPDATE;
    IF NOT FOUND OR s.wake_id IS DISTINCT FROM p_wake THEN
        RETURN NULL;
    END IF;
    IF p_error IS NOT NULL THEN
        UPDATE ds_subscription
           SET wake_id = NULL, wake_state = NULL, holder = NULL, lease_expires_at = NULL,
               sender = NULL, send_deadline = NULL, wake_streams = NULL,
               failed_attempts = s.failed_attempts + 1,
               next_attempt_at = now() + ds_sub_retry_delay(s.failed_attempts + 1, p_jitter),
               last_error = p_error, last_error_at = now()
         WHERE id = s.id;
        RETURN NULL;
    ELSIF NOT p_done THEN
        UPDATE ds_subscription
           SET wake_state = 'waiting', sender = NULL, send_deadline = NULL,
               lease_expires_at = coalesce(
                   lease_expires_at, now() + make_interval(secs => s.lease_ttl_ms / 1000.0)),
               failed_attempts = 0, next_attempt_at = NULL, last_delivered_at = now()
         WHERE id = s.id;
        RETURN NULL;
    END IF;
    PERFORM ds_sub_ack_reported(s);
    -- One new version of the row: the wake ends, the delivery succeeded.
    UPDATE ds_subscription
       SET wake_id = NULL, wake_state = NULL, holder = NULL, lease_expires_at = NULL,
           sender = NULL, send_deadline = NULL, wake_streams = NULL,
           failed_attempts = 0, next_attempt_at = NULL, last_delivered_at = now()
     WHERE id = s.id
    RETURNING * INTO s;
    r := ds_sub_issue(s, p_sender, p_send_secs, p_max_bytes, true);
    RETURN CASE WHEN r.id IS NOT NULL THEN ds_sub_delivery(r) END;
END;
$$;

-- Ack the tails the wake in flight reported ({"done": true}, 7.1), never moving a cursor back,
-- nor past the tail of a stream re-created meanwhile.
CREATE OR REPLACE FUNCTION ds_sub_ack_reported(s ds_subscription) RETURNS void
LANGUAGE sql AS $$
    UPDATE ds_subscription_link AS l
       SET acked_seq = w.seq, acked_pos = w.pos
      FROM (SELECT e ->> 'path' AS path,
                   split_part(e ->> 'tail_offset', '_', 1)::bigint AS seq,
                   split_part(e ->> 'tail_offset', '_', 2)::bigint AS pos,
                   e ? 'stream_id' AS listed, (e ->> 'stream_id')::bigint AS stream_id
              FROM jsonb_array_elements(coalesce(s.wake_streams, '[]'::jsonb)) AS e) AS w
     WHERE l.sid = s.id AND l.path = w.path
       AND (w.seq, w.pos) > (l.acked_seq, l.acked_pos)
       AND EXISTS (SELECT 1 FROM ds_stream AS t
                    WHERE t.path = l.path AND t.deleted_at IS NULL AND t.next_seq >= w.seq
                      AND NOT (w.listed AND t.id IS DISTINCT FROM w.stream_id))
$$;

-- A callback (webhook), ack or release (pull-wake) of the wake a token names (7.1-7.3).
-- Fenced unless the token's subscription, generation and wake, and the request's, are the
-- current ones; an expired lease ends the wake first (whether or not the sweep got there).
-- Acks (p_acks: [[path, seq, pos], ...]) must name linked streams, not move a cursor back
-- and be positions the stream minted, of the stream the wake was issued for (not one created
-- at that path since); all apply or none. Without done (or release) the lease
-- is extended (a heartbeat); with it the wake ends, and pending work gets the next wake at
-- once (next_wake; for a webhook, delivery is what this process must send).
CREATE OR REPLACE FUNCTION ds_sub_report(
    p_id text, p_type text, p_token_sid bigint, p_token_generation bigint, p_token_wake text,
    p_generation bigint, p_wake text, p_acks jsonb, p_done boolean, p_release boolean,
    p_sender text, p_send_secs float8, p_max_bytes bigint
) RETURNS TABLE (outcome ds_sub_outcome, next_wake boolean, detail text, delivery jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    s ds_subscription;
    r ds_subscription;
    a jsonb;
    v_link ds_subscription_link;
    v_stream ds_stream;
    v_seq bigint;
    v_pos bigint;
BEGIN
    next_wake := false;
    SELECT * INTO s FROM ds_subscription WHERE subscription_id = p_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        outcome := 'not_found';
    ELSIF s.type <> p_type THEN
        outcome := 'wrong_type';
        detail := p_type;
    ELSIF s.id <> p_token_sid THEN
        outcome := 'token_invalid';
    END IF;
    IF outcome IS NOT NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;
    IF s.lease_expires_at < now() THEN
        PERFORM ds_sub_end_wake(s.id);
        SELECT * INTO s FROM ds_subscription WHERE id = s.id;
    END IF;
    IF s.wake_id IS NULL OR p_token_generation <> s.generation OR p_generation <> s.generation
       OR p_token_wake <> s.wake_id OR p_wake <> s.wake_id
       OR (s.type = 'pull-wake' AND s.wake_state <> 'claimed') THEN
        outcome := 'fenced';
        RETURN NEXT;
        RETURN;
    END IF;

    FOR a IN SELECT * FROM jsonb_array_elements(coalesce(p_acks, '[]'::jsonb)) LOOP
        v_seq := (a ->> 1)::bigint;
        v_pos := (a ->> 2)::bigint;
        SELECT * INTO v_link FROM ds_subscription_link
         WHERE sid = s.id AND path = a ->> 0 FOR UPDATE;
        IF NOT FOUND THEN
            outcome := 'invalid_offset';
            detail := 'the subscription does not follow ' || (a ->> 0);
        ELSIF (v_seq, v_pos) < (v_link.acked_seq, v_link.acked_pos) THEN
            outcome := 'invalid_offset';
            detail := 'the ack of ' || (a ->> 0) || ' moves its cursor back from '
                      || ds_offset(v_link.acked_seq, v_link.acked_pos);
        ELSE
            SELECT * INTO v_stream FROM ds_stream
             WHERE path = a ->> 0 AND deleted_at IS NULL;
            IF FOUND AND (v_seq, v_pos) <> (0, 0)
               AND ds_sub_listed_other(s.wake_streams, a ->> 0, v_stream.id) THEN
                -- Not the stream the wake listed at this path: an offset of the one deleted
                -- since would move the new one's cursor past messages never delivered.
                outcome := 'invalid_offset';
                detail := (a ->> 0) || ' is not the stream this wake listed (deleted and'
                          || ' created again since)';
            ELSIF NOT FOUND AND (v_seq, v_pos) <> (0, 0)
               OR FOUND AND NOT ds_is_position(v_stream, v_seq, v_pos) THEN
                outcome := 'invalid_offset';
                detail := ds_offset(v_seq, v_pos) || ' is not an offset of ' || (a ->> 0);
            END IF;
        END IF;
        IF outcome IS NOT NULL THEN
            RETURN NEXT;
            RETURN;
        END IF;
    END LOOP;
    -- Valid, so none moves a cursor back; of several acks of one stream the last counts.
    FOR a IN SELECT * FROM jsonb_array_elements(coalesce(p_acks, '[]'::jsonb)) LOOP
        UPDATE ds_subscription_link
           SET acked_seq = (a ->> 1)::bigint, acked_pos = (a ->> 2)::bigint
         WHERE sid = s.id AND path = a ->> 0;
    END LOOP;

    outcome := 'ok';
    IF NOT (p_done OR p_release) THEN
        UPDATE ds_subscription
           SET lease_expires_at = now() + make_interval(secs => s.lease_ttl_ms / 1000.0)
         WHERE id = s.id;
        RETURN NEXT;
        RETURN;
    END IF;
    PERFORM ds_sub_end_wake(s.id);
    SELECT * INTO s FROM ds_subscription WHERE id = s.id;
    r := ds_sub_issue(s, p_sender, p_send_secs, p_max_bytes, true);
    next_wake := r.id IS NOT NULL;
    IF next_wake AND r.type = 'webhook' THEN
        delivery := ds_sub_delivery(r);
    END IF;
    RETURN NEXT;
END;
$$;

-- A pull-wake worker's claim (7.2): the wake issued (or one issued now, when work is pending
-- and none was), unless another worker holds an unexpired lease (already_claimed, with the
-- holder and generation). The lease starts now.
CREATE OR REPLACE FUNCTION ds_sub_claim(p_id text, p_worker text, p_max_bytes bigint)
RETURNS TABLE (
    outcome ds_sub_outcome, sid bigint, generation bigint, wake_id text, holder text,
    lease_ttl_ms int, streams jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    s ds_subscription;
    r ds_subscription;
BEGIN
    SELECT * INTO s FROM ds_subscription AS t WHERE t.subscription_id = p_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        outcome := 'not_found';
    ELSIF s.type <> 'pull-wake' THEN
        outcome := 'wrong_type';
    END IF;
    IF outcome IS NOT NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;
    IF s.lease_expires_at < now() THEN
        PERFORM ds_sub_end_wake(s.id);
        SELECT * INTO s FROM ds_subscription AS t WHERE t.id = s.id;
    END IF;
    sid := s.id;
    generation := s.generation;
    holder := s.holder;
    IF s.holder IS NOT NULL THEN
        outcome := 'already_claimed';
    ELSIF s.wake_id IS NULL AND (s.paused OR ds_sub_orphaned(s)) THEN
        outcome := 'paused';
    ELSIF s.wake_id IS NULL THEN
        -- A wake issued for this claim: no event (nobody else needs to hear of it).
        r := ds_sub_issue(s, NULL, 0, p_max_bytes, false);
        IF r.id IS NULL THEN
            outcome := 'no_pending_work';
        END IF;
    END IF;
    IF outcome IS NOT NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;
    UPDATE ds_subscription AS t
       SET holder = p_worker, wake_state = 'claimed',
           wake_streams = ds_sub_streams(t.id, true),
           lease_expires_at = now() + make_interval(secs => t.lease_ttl_ms / 1000.0)
     WHERE t.id = s.id
    RETURNING t.* INTO s;
    outcome := 'ok';
    generation := s.generation;
    wake_id := s.wake_id;
    holder := s.holder;
    lease_ttl_ms := s.lease_ttl_ms;
    streams := ds_sub_public_streams(s.wake_streams);
    RETURN NEXT;
END;
$$;

-- ---------------------------------------------------------------------------------------------
-- Operators (the admin)

-- Pause (no new wake; the one in flight runs its course) or resume.
CREATE OR REPLACE FUNCTION ds_sub_pause(p_sid bigint, p_paused boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- An operator's pause is theirs from now on, whoever paused it before: a PUT that takes
    -- over a subscription whose key lost standing (ds_sub_adopt) does not lift it (review).
    UPDATE ds_subscription
       SET paused = p_paused,
           last_error = CASE WHEN p_paused AND last_error = ds_sub_orphaned_reason()
                             THEN 'paused by an operator' ELSE last_error END
     WHERE id = p_sid;
    IF NOT p_paused THEN
        PERFORM pg_notify('ds_streams', 'sub:' || p_sid);
    END IF;
END;
$$;

-- Move every cursor to the streams' tails (skip what is pending) or to zero (replay
-- everything), fence the wake in flight and clear the retry schedule.
CREATE OR REPLACE FUNCTION ds_sub_reset(p_sid bigint, p_to_tail boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM ds_subscription WHERE id = p_sid FOR NO KEY UPDATE;
    PERFORM ds_sub_end_wake(p_sid);
    UPDATE ds_subscription SET failed_attempts = 0, next_attempt_at = NULL WHERE id = p_sid;
    UPDATE ds_subscription_link AS l
       SET (acked_seq, acked_pos) = (
           SELECT coalesce(max(t.next_seq), 0), coalesce(max(t.next_pos), 0)
             FROM ds_stream AS t
            WHERE p_to_tail AND t.path = l.path AND t.deleted_at IS NULL)
     WHERE l.sid = p_sid;
    PERFORM pg_notify('ds_streams', 'sub:' || p_sid);
END;
$$;

-- A webhook retry due now rather than at its scheduled time (the status stays failed until a
-- delivery succeeds).
CREATE OR REPLACE FUNCTION ds_sub_retry_now(p_sid bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE ds_subscription SET next_attempt_at = now()
     WHERE id = p_sid AND next_attempt_at > now();
    PERFORM pg_notify('ds_streams', 'sub:' || p_sid);
END;
$$;
