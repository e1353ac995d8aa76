-- Retention: trimming, purging and the retention sweep's time index (docs/gaps.md, Retention;
-- docs/decisions.md). Installed after functions.sql (file name order).
--
-- A stream's earliest retained position is (first_seq, first_pos). Trimming moves it forward
-- under the stream's row lock, in a transaction that writes one row: from then on reads of
-- earlier offsets answer 410 and `offset=-1` starts there. The rows below it are deleted
-- afterwards, in bounded batches that take no stream lock at all (ds_purge): appends only
-- insert at the tail, and readers never look below the start. Rows that forks still read
-- through the stream are kept until no fork needs them (ds_fork_reads).
--
-- Age retention needs to know when messages were appended without a timestamp on every row
-- (the hot path stays as it is): the sweep records the tail of each stream with an age policy
-- now and then (ds_stream_mark). Every message before a mark's position was appended before
-- the mark's time, so age retention trims to the newest mark older than the maximum age:
-- messages are kept at least that long, and at most one mark interval longer.

-- Extension points (replaced by other apps' SQL, installed after this file).
-- ds_hook_trimming: a stream's start is about to move forward (state/ materializes what it
-- has not yet, so its state never misses an event). ds_hook_keeps_history: the server-wide
-- default retention does not apply to the stream (state/: registered state streams).
-- ds_hook_mark_horizon: how long the stream's marks are needed besides its age policy, in
-- seconds (state/: a compacted stream's tombstone period), or NULL. ds_hook_purge_floor: the
-- lowest seq of the stream that something besides the protocol's readers may still read below
-- its start (tablesync/: a sink's position), or NULL; the purge keeps the rows from there.
CREATE OR REPLACE FUNCTION ds_hook_trimming(s ds_stream) RETURNS void
LANGUAGE plpgsql AS $$ BEGIN END; $$;
CREATE OR REPLACE FUNCTION ds_hook_keeps_history(p_stream_id bigint) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$ BEGIN RETURN false; END; $$;
CREATE OR REPLACE FUNCTION ds_hook_mark_horizon(s ds_stream) RETURNS double precision
LANGUAGE plpgsql STABLE AS $$ BEGIN RETURN NULL; END; $$;
CREATE OR REPLACE FUNCTION ds_hook_purge_floor(p_stream_id bigint) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$ BEGIN RETURN NULL; END; $$;

-- The streams whose rows make up stream s, oldest first, as parallel arrays: rows of ids[i]
-- with lo[i] <= seq < hi[i] (the last hi is s's tail). A plain stream is one segment.
CREATE OR REPLACE FUNCTION ds_segments(s ds_stream, OUT ids bigint[], OUT lo bigint[],
                                       OUT hi bigint[])
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_cur ds_stream := s;
    v_hi bigint := s.next_seq;
BEGIN
    ids := '{}';
    lo := '{}';
    hi := '{}';
    LOOP
        ids := v_cur.id || ids;
        lo := coalesce(v_cur.fork_seq, 0) || lo;
        hi := v_hi || hi;
        EXIT WHEN v_cur.fork_source_id IS NULL;
        v_hi := v_cur.fork_seq;
        SELECT * INTO v_cur FROM ds_stream WHERE id = v_cur.fork_source_id;
        EXIT WHEN NOT FOUND;
    END LOOP;
END;
$$;

-- The first stored message of stream s (through its fork chain) at or after p_seq, before its
-- tail: (seq, pos, end position); no row when there is none.
CREATE OR REPLACE FUNCTION ds_message_at_or_after(s ds_stream, p_seq bigint)
RETURNS TABLE (seq bigint, pos bigint, end_pos bigint)
LANGUAGE plpgsql STABLE ROWS 1 AS $$
DECLARE
    g record;
    i int;
BEGIN
    g := ds_segments(s);
    FOR i IN 1..cardinality(g.ids) LOOP
        CONTINUE WHEN g.hi[i] <= p_seq;
        RETURN QUERY
            SELECT m.seq, m.pos, m.pos + octet_length(m.data) FROM ds_message AS m
             WHERE m.stream_id = g.ids[i] AND m.seq >= greatest(p_seq, g.lo[i])
               AND m.seq < g.hi[i]
             ORDER BY m.seq LIMIT 1;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- The last stored message of stream s (through its fork chain) before p_seq: (seq, end
-- position); no row when there is none.
CREATE OR REPLACE FUNCTION ds_message_before(s ds_stream, p_seq bigint)
RETURNS TABLE (seq bigint, end_pos bigint)
LANGUAGE plpgsql STABLE ROWS 1 AS $$
DECLARE
    g record;
    i int;
BEGIN
    g := ds_segments(s);
    FOR i IN REVERSE cardinality(g.ids)..1 LOOP
        CONTINUE WHEN g.lo[i] >= p_seq;
        RETURN QUERY
            SELECT m.seq, m.pos + octet_length(m.data) FROM ds_message AS m
             WHERE m.stream_id = g.ids[i] AND m.seq < least(p_seq, g.hi[i])
               AND m.seq >= g.lo[i]
             ORDER BY m.seq DESC LIMIT 1;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- Is (p_seq, p_pos) a retained position of stream s: its tail, the start of a retained
-- message, its start, or (in compacted history, where compacted messages left gaps) a
-- position that fits between the stored messages around it?
CREATE OR REPLACE FUNCTION ds_is_retained_position(s ds_stream, p_seq bigint, p_pos bigint)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_next record;
    v_prev record;
BEGIN
    IF p_seq > s.next_seq OR (p_seq, p_pos) < (s.first_seq, s.first_pos) THEN
        RETURN false;
    ELSIF p_seq = s.next_seq THEN
        RETURN p_pos = s.next_pos;
    ELSIF (p_seq, p_pos) = (s.first_seq, s.first_pos) THEN
        RETURN true;
    END IF;
    SELECT * INTO v_next FROM ds_message_at_or_after(s, p_seq);
    IF FOUND AND v_next.seq = p_seq THEN
        RETURN v_next.pos = p_pos;
    ELSIF p_seq >= s.compacted_seq THEN
        RETURN false;  -- no gaps here: a position is a message's start
    END IF;
    -- Every message holds at least one byte: the gap must have room for the messages in it.
    IF FOUND THEN
        IF p_pos > v_next.pos OR v_next.pos - p_pos < v_next.seq - p_seq THEN
            RETURN false;
        END IF;
    ELSIF p_pos > s.next_pos OR s.next_pos - p_pos < s.next_seq - p_seq THEN
        RETURN false;
    END IF;
    SELECT * INTO v_prev FROM ds_message_before(s, p_seq);
    RETURN NOT FOUND OR (v_prev.end_pos <= p_pos AND p_pos - v_prev.end_pos >= p_seq - v_prev.seq - 1);
END;
$$;

-- What of stream p_stream_id's own rows its forks read (through any depth of forks: a fork
-- reads the rows of its source chain below the fork points on the way, from its own start):
-- they read within [lowest, highest); NULLs when no fork reads any. Soft-deleted streams read
-- nothing themselves, but their forks still read through them.
CREATE OR REPLACE FUNCTION ds_fork_reads(p_stream_id bigint, OUT lowest bigint,
                                         OUT highest bigint)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE tree (id, upper, first_seq, deleted) AS (
        SELECT c.id, c.fork_seq, c.first_seq, c.deleted_at IS NOT NULL
          FROM ds_stream AS c WHERE c.fork_source_id = p_stream_id
        UNION ALL
        SELECT c.id, least(c.fork_seq, t.upper), c.first_seq, c.deleted_at IS NOT NULL
          FROM ds_stream AS c JOIN tree AS t ON c.fork_source_id = t.id
    )
    SELECT min(first_seq), max(upper) FROM tree WHERE NOT deleted AND first_seq < upper
$$;

-- Delete one batch of a stream's rows that nobody reads any more, in the caller's (short)
-- transaction, without taking the stream's row lock: rows below its start (all of them when
-- it is soft-deleted) that no fork reads and no sink still needs (ds_hook_purge_floor). At
-- most p_batch consecutive seq, from p_from (NULL: the stream's lowest row). next_from: where
-- the next batch starts, NULL when there is nothing more to delete now; then the stream
-- leaves the purge queue (what its forks still hold is queued again when they are trimmed or
-- deleted), or, when a sink holds rows back, comes due again 10 s later. A range of seq keeps a batch bounded
-- even where compaction left gaps; the caller carries the position from batch to batch, since
-- looking for the lowest row again would step over the index entries of every row deleted
-- so far. p_claim: the due time ds_purge_claim set.
CREATE OR REPLACE FUNCTION ds_purge(
    p_stream_id bigint, p_claim timestamptz, p_from bigint, p_batch int,
    OUT next_from bigint, OUT deleted int
)
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
    f record;
    v_end bigint;
    v_from bigint;
    v_to bigint;
    v_goal bigint;
BEGIN
    deleted := 0;
    SELECT * INTO s FROM ds_stream AS t WHERE t.id = p_stream_id;
    IF FOUND THEN
        v_goal := CASE WHEN s.deleted_at IS NULL THEN s.first_seq ELSE s.next_seq END;
        -- A sink may be applying rows below the start: it read the stream before a trim that
        -- committed since, and reads its rows now (tablesync.sql, ds_sink_run).
        v_end := least(v_goal, ds_hook_purge_floor(s.id));
        f := ds_fork_reads(s.id);
        v_from := coalesce(p_from, (SELECT min(m.seq) FROM ds_message AS m
                                     WHERE m.stream_id = p_stream_id));
        IF f.lowest IS NOT NULL AND v_from >= f.lowest AND v_from < f.highest THEN
            v_from := f.highest;  -- what the forks read stays
        END IF;
    END IF;
    IF v_from IS NULL OR v_from >= v_end THEN
        IF v_from < v_goal THEN
            -- Held back by a sink: again later, when it may have moved on.
            UPDATE ds_purge_pending AS q SET due_at = now() + interval '10 seconds'
             WHERE q.stream_id = p_stream_id AND q.due_at = p_claim;
            RETURN;
        END IF;
        -- Unless it was queued again meanwhile (a trim moved its due time back to now).
        DELETE FROM ds_purge_pending AS q
         WHERE q.stream_id = p_stream_id AND q.due_at = p_claim;
        RETURN;
    END IF;
    v_to := least(v_end, v_from + p_batch);
    IF f.lowest IS NOT NULL AND v_from < f.lowest THEN
        v_to := least(v_to, f.lowest);
    END IF;
    DELETE FROM ds_message AS m
     WHERE m.stream_id = p_stream_id AND m.seq >= v_from AND m.seq < v_to;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    next_from := v_to;
END;
$$;

-- Move the start of stream s (row locked by the caller) forward to (p_seq, p_pos), a retained
-- position after the current start. Its rows below, and rows its sources kept for it, are
-- queued for purging.
CREATE OR REPLACE FUNCTION ds_trim_to(s ds_stream, p_seq bigint, p_pos bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ds_hook_trimming(s);
    UPDATE ds_stream SET first_seq = p_seq, first_pos = p_pos WHERE id = s.id;
    INSERT INTO ds_purge_pending (stream_id, due_at)
    SELECT u.id, now() FROM unnest((ds_segments(s)).ids) AS u(id)
    ON CONFLICT (stream_id) DO UPDATE SET due_at = least(ds_purge_pending.due_at, now());
    DELETE FROM ds_stream_mark WHERE stream_id = s.id AND seq < p_seq;
    -- Processes keep recent appends of watched streams for their live readers: they drop them
    -- ("<id>:-1:t", streams/live.py), so that a reader behind the trim reads the store (410).
    IF s.watched_until > now() THEN
        PERFORM pg_notify('ds_streams', s.id || ':-1:t');
    END IF;
END;
$$;

-- Trim on behalf of a client: drop everything before (p_seq, p_pos), or everything when
-- p_seq is NULL (`now`). Outcomes: ds_trim_outcome (streams/store/outcomes.py). Returns the
-- stream's start and tail after it.
CREATE OR REPLACE FUNCTION ds_trim(p_path text, p_seq bigint, p_pos bigint)
RETURNS TABLE (
    outcome ds_trim_outcome, first_seq bigint, first_pos bigint, next_seq bigint,
    next_pos bigint
)
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    s ds_stream;
    v_seq bigint;
    v_pos bigint;
BEGIN
    SELECT * INTO s FROM ds_stream AS t WHERE t.path = p_path FOR UPDATE;
    IF NOT FOUND THEN
        outcome := 'not_found';
    ELSIF s.deleted_at IS NOT NULL THEN
        outcome := 'gone';
    ELSIF ds_is_expired(s) THEN
        PERFORM ds_expire(s);
        outcome := 'not_found';
    END IF;
    IF outcome IS NOT NULL THEN
        RETURN NEXT;
        RETURN;
    END IF;
    v_seq := coalesce(p_seq, s.next_seq);
    v_pos := CASE WHEN p_seq IS NULL THEN s.next_pos ELSE p_pos END;
    -- A stream that keeps its history (a registered state stream, whose readers and rebuilds
    -- need all of it: it compacts instead) is not the client's to trim.
    outcome := CASE
        WHEN (v_seq, v_pos) <= (s.first_seq, s.first_pos) THEN 'unchanged'
        WHEN NOT ds_is_retained_position(s, v_seq, v_pos) THEN 'offset_invalid'
        WHEN ds_hook_keeps_history(s.id) THEN 'keeps_history'
        ELSE 'trimmed'
    END;
    IF outcome = 'trimmed' THEN
        PERFORM ds_trim_to(s, v_seq, v_pos);
        first_seq := v_seq;
        first_pos := v_pos;
    ELSE
        first_seq := s.first_seq;
        first_pos := s.first_pos;
    END IF;
    -- A client's trim is a write: it renews a sliding TTL (PROTOCOL.md 5.1). The sweep's
    -- trims are not client accesses and do not.
    IF outcome IN ('trimmed', 'unchanged') AND s.ttl_seconds IS NOT NULL THEN
        UPDATE ds_stream AS t SET accessed_at = now() WHERE t.id = s.id;
    END IF;
    next_seq := s.next_seq;
    next_pos := s.next_pos;
    RETURN NEXT;
END;
$$;

-- The first retained message of stream s whose position is at least p_pos (the tail when
-- none): where size retention trims to. A binary search over seq on the primary key, since
-- positions grow with seq: about log2(messages) index probes.
CREATE OR REPLACE FUNCTION ds_seek_pos(s ds_stream, p_pos bigint, OUT seq bigint, OUT pos bigint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_lo bigint := s.first_seq;
    v_hi bigint := s.next_seq;
    v_mid bigint;
    r record;
BEGIN
    -- The answer's seq is in [v_lo, v_hi]; v_hi = the tail's seq means the tail.
    WHILE v_lo < v_hi LOOP
        v_mid := v_lo + (v_hi - v_lo) / 2;
        SELECT * INTO r FROM ds_message_at_or_after(s, v_mid);
        IF NOT FOUND OR r.pos >= p_pos THEN
            v_hi := v_mid;
        ELSE
            v_lo := r.seq + 1;
        END IF;
    END LOOP;
    SELECT m.seq, m.pos INTO seq, pos FROM ds_message_at_or_after(s, v_lo) AS m;
    IF NOT FOUND THEN
        seq := s.next_seq;
        pos := s.next_pos;
    END IF;
END;
$$;

-- Record stream s's tail in its time index when it moved since the last mark and that mark is
-- at least p_resolution seconds old; forget marks nobody will need: below its start, and older
-- than p_horizon seconds except the newest of those (the one age retention trims to).
CREATE OR REPLACE FUNCTION ds_mark_stream(
    s ds_stream, p_resolution double precision, p_horizon double precision
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM ds_stream_mark AS k
                    WHERE k.stream_id = s.id
                      AND (k.seq >= s.next_seq
                           OR k.marked_at > now() - make_interval(secs => p_resolution))) THEN
        INSERT INTO ds_stream_mark (stream_id, seq, pos, marked_at)
        VALUES (s.id, s.next_seq, s.next_pos, now())
        ON CONFLICT DO NOTHING;
    END IF;
    DELETE FROM ds_stream_mark AS k
     WHERE k.stream_id = s.id
       AND (k.seq < s.first_seq
            OR k.seq < (SELECT max(o.seq) FROM ds_stream_mark AS o
                         WHERE o.stream_id = s.id
                           AND o.marked_at < now() - make_interval(secs => p_horizon)));
END;
$$;

-- The newest mark of stream s at least p_age seconds old: every message before it is older.
CREATE OR REPLACE FUNCTION ds_mark_before(s ds_stream, p_age double precision,
                                          OUT seq bigint, OUT pos bigint)
LANGUAGE sql STABLE AS $$
    SELECT k.seq, k.pos FROM ds_stream_mark AS k
     WHERE k.stream_id = s.id AND k.marked_at <= now() - make_interval(secs => p_age)
     ORDER BY k.seq DESC LIMIT 1
$$;

-- One page of the retention sweep: streams after p_after_id (at most p_limit, by id) whose
-- retention policy applies (their own, or the server-wide default p_default_age /
-- p_default_bytes for streams that set none, internal streams and those ds_hook_keeps_history
-- names excepted). Each gets a mark when due; each row says where the stream should start
-- now, which is ahead of its start when it must be trimmed. Takes no stream lock: the caller
-- trims each stream in a transaction of its own (ds_retention_trim).
CREATE OR REPLACE FUNCTION ds_retention_page(
    p_after_id bigint, p_limit int, p_default_age bigint, p_default_bytes bigint,
    p_mark_interval double precision
)
RETURNS TABLE (
    stream_id bigint, path text, first_seq bigint, first_pos bigint, target_seq bigint,
    target_pos bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
    v_age bigint;
    v_bytes bigint;
    v_target record;
    v_by_size record;
    v_defaults boolean := p_default_age IS NOT NULL OR p_default_bytes IS NOT NULL;
BEGIN
    FOR s IN
        SELECT * FROM ds_stream AS t
         WHERE t.id > p_after_id AND t.deleted_at IS NULL AND NOT ds_is_expired(t)
           AND (v_defaults
                OR t.retention_max_age IS NOT NULL OR t.retention_max_bytes IS NOT NULL)
         ORDER BY t.id LIMIT p_limit
    LOOP
        v_age := s.retention_max_age;
        v_bytes := s.retention_max_bytes;
        IF v_age IS NULL AND v_bytes IS NULL AND NOT starts_with(s.path, '__')
           AND NOT ds_hook_keeps_history(s.id) THEN
            v_age := p_default_age;
            v_bytes := p_default_bytes;
        END IF;
        stream_id := s.id;
        path := s.path;
        first_seq := s.first_seq;
        first_pos := s.first_pos;
        target_seq := s.first_seq;
        target_pos := s.first_pos;
        IF v_age IS NOT NULL THEN
            PERFORM ds_mark_stream(
                s, greatest(p_mark_interval, v_age / 100.0),
                greatest(v_age, coalesce(ds_hook_mark_horizon(s), 0)));
            SELECT * INTO v_target FROM ds_mark_before(s, v_age);
            IF v_target.seq IS NOT NULL AND v_target.seq > target_seq THEN
                target_seq := v_target.seq;
                target_pos := v_target.pos;
            END IF;
        END IF;
        -- Sizes count positions: bytes appended in the window, compacted or not.
        IF v_bytes IS NOT NULL AND s.next_pos - target_pos > v_bytes THEN
            SELECT * INTO v_by_size FROM ds_seek_pos(s, s.next_pos - v_bytes);
            IF v_by_size.seq > target_seq THEN
                target_seq := v_by_size.seq;
                target_pos := v_by_size.pos;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- Trim a stream for its retention policy to (p_seq, p_pos), found by ds_retention_page: one
-- short transaction under the stream's row lock. Skips a stream locked by someone else (the
-- next sweep comes back) or already trimmed that far. Returns whether it trimmed.
CREATE OR REPLACE FUNCTION ds_retention_trim(p_stream_id bigint, p_seq bigint, p_pos bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    s ds_stream;
BEGIN
    SELECT * INTO s FROM ds_stream WHERE id = p_stream_id AND deleted_at IS NULL
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND OR (p_seq, p_pos) <= (s.first_seq, s.first_pos) OR p_seq > s.next_seq THEN
        RETURN false;
    END IF;
    PERFORM ds_trim_to(s, p_seq, p_pos);
    RETURN true;
END;
$$;

-- Claim the stream that waits longest for its trimmed rows to be purged (NULL: none due): its
-- queue entry is pushed p_lease seconds ahead, so other processes leave it alone meanwhile and
-- take it over if this one stops before it is done.
CREATE OR REPLACE FUNCTION ds_purge_claim(p_lease double precision)
RETURNS TABLE (stream_id bigint, path text, claim timestamptz)
LANGUAGE sql ROWS 1 AS $$
    UPDATE ds_purge_pending AS p SET due_at = now() + make_interval(secs => p_lease)
     WHERE p.stream_id = (SELECT q.stream_id FROM ds_purge_pending AS q WHERE q.due_at <= now()
                           ORDER BY q.due_at, q.stream_id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING p.stream_id, (SELECT s.path FROM ds_stream AS s WHERE s.id = p.stream_id),
              p.due_at
$$;

-- Set a stream's retention policy (the admin). NULL: none of its own.
CREATE OR REPLACE FUNCTION ds_set_retention(
    p_stream_id bigint, p_max_age bigint, p_max_bytes bigint
) RETURNS void
LANGUAGE sql AS $$
    UPDATE ds_stream SET retention_max_age = p_max_age, retention_max_bytes = p_max_bytes
     WHERE id = p_stream_id
$$;
