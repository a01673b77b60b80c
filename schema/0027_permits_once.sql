-- 0027: a concurrency permit is checked once.
--
-- A claim looked for free permits (FOR UPDATE SKIP LOCKED), then looked at the ones it locked a
-- second time, in a statement of its own: a permit another claim had taken and committed after
-- the first statement's snapshot reached the lock in its new version, naming a holder whose row,
-- in that snapshot, was not yet running, so it looked free. The second look cost as much as the
-- first (a quarter of a millisecond per claim of 100 rows). Now each permit records the
-- transaction that took it last (taken_by), and a permit taken by a transaction this snapshot
-- does not see is held, whatever its holder's row says: the first look is right by itself.
-- A claim also wrote its permits with a search of the batch per permit (batch x batch
-- comparisons); it now finds each permit's row with one array look-up. And the rows of a queue
-- limited by a rate alone are no longer marked limit_held: that mark is what a concurrency
-- limit counts, and it cost each such row an entry in tasks_limit_running_idx.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.limit_permits ADD COLUMN taken_by xid8;

-- A permit is free when nobody ever held it, or when the transaction that took it last is one
-- this snapshot sees (committed before it) and its holder's attempt no longer runs under a live
-- lease. Permits taken before this version have no taken_by: those claims committed long ago.
CREATE OR REPLACE VIEW {schema}.free_permits AS
SELECT p.queue, p.limit_key, p.slot
  FROM {schema}.limit_permits AS p
 WHERE p.task_id IS NULL
    OR ((p.taken_by IS NULL OR pg_visible_in_snapshot(p.taken_by, pg_current_snapshot()))
        AND NOT coalesce((SELECT t.attempts = p.attempt AND t.state = 'in_progress'
                                 AND t.lease_expires_at >= now()
                            FROM {schema}.tasks AS t WHERE t.id = p.task_id), false));

-- One permit of key k (see 0020), looked at once (see free_permits).
CREATE OR REPLACE FUNCTION {schema}.take_key_permit(q text, k text, c integer, mine integer[])
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    got integer;
BEGIN
    SELECT p.slot INTO got FROM {schema}.free_permits AS p
     WHERE p.queue = q AND p.limit_key = k AND p.slot <= c AND p.slot <> ALL(mine)
     ORDER BY p.slot LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        RETURN got;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {schema}.limit_permits AS p
                    WHERE p.queue = q AND p.limit_key = k) THEN
        BEGIN
            PERFORM {schema}.make_key_limits(q, k, c);
        EXCEPTION WHEN lock_not_available THEN
            RETURN NULL;
        END;
        RETURN {schema}.take_key_permit(q, k, c, mine);
    END IF;
    RETURN NULL;
END;
$$;

-- The claim of one limited queue (see 0024), its permits looked at once.
CREATE OR REPLACE FUNCTION {schema}.claim_limited_rows(
    q text,
    want integer,
    lookahead double precision DEFAULT 0.5,
    -- The pace taken ahead for this claim (pace_ahead), if any: NULL pace_n when none was.
    pace_t0 timestamptz DEFAULT NULL,
    pace_m timestamptz DEFAULT NULL,
    pace_gap double precision DEFAULT NULL,
    pace_burst integer DEFAULT NULL,
    pace_n integer DEFAULT NULL,
    pace_wait double precision DEFAULT NULL,
    pace_end timestamptz DEFAULT NULL,
    OUT ids bigint[],
    OUT start_at timestamptz[],
    OUT wait_seconds double precision,
    OUT held boolean
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
-- Every statement below looks rows up by key; a hash join over a queue's permits (the generic
-- plan's guess for a join with the batch) would read them all.
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_variable
DECLARE
    lim      {schema}.queue_limits;
    -- The database clock now (not the transaction's start): the pace is counted from it.
    t0       timestamptz := clock_timestamp();
    room     integer := want;
    permits  integer[] := '{}';
    used     integer[];
    take     integer;
    fit      integer;
    m        timestamptz;
    atts     integer[] := '{}';
    keyed    boolean;
    gap      interval;
    key_gap  interval;
    tat      timestamptz;
    horizon  timestamptz;
    cand     record;
    kbusy    text[] := '{}';
    s        timestamptz;
    rowslots integer[] := '{}';
    rowkeys  text[] := '{}';
    kslot    integer;
    pt0      timestamptz;
    burst    integer;
    pend     timestamptz;
    lo       integer;
    pos      integer[];
    ix       integer;
BEGIN
    ids := '{}';
    start_at := '{}';
    held := false;
    SELECT * INTO lim FROM {schema}.queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND OR want <= 0 THEN
        RETURN;
    END IF;
    horizon := t0 + make_interval(secs => lookahead);

    IF lim.concurrency IS NOT NULL THEN
        -- Free permits, lowest slots first: never held, or held by an attempt that no longer
        -- runs under a live lease. Nothing gives a permit back: the attempt's end does.
        -- A permit another claim took after this statement's snapshot comes to the lock in its
        -- new version, with its holder's row as the snapshot has it (not yet running): the view
        -- counts it as held (taken_by, see free_permits), so no second look is needed.
        permits := ARRAY(
            SELECT p.slot FROM {schema}.free_permits AS p
             WHERE p.queue = q AND p.limit_key = '' AND p.slot <= lim.concurrency
             ORDER BY p.slot LIMIT room
               FOR UPDATE SKIP LOCKED);
        -- Rows running under the limit that hold no permit (written by hand, or from before
        -- permits) count too: never more running than the limit, whatever the permits say.
        room := least(cardinality(permits), lim.concurrency - (
            SELECT count(*) FROM {schema}.tasks AS t
             WHERE t.queue = q AND t.state = 'in_progress' AND t.limit_held
               AND t.lease_expires_at >= t0));
        IF room < want THEN
            held := true;
        END IF;
        room := greatest(room, 0);
    END IF;

    keyed := lim.key_concurrency IS NOT NULL OR lim.key_rate IS NOT NULL;
    IF lim.rate IS NOT NULL AND NOT keyed AND pace_n IS NOT NULL THEN
        -- The pace was taken ahead, in a transaction of its own (pace_ahead): the starts it
        -- allows are this claim's, and what it does not use goes back below.
        pt0 := pace_t0;
        m := pace_m;
        gap := make_interval(secs => pace_gap);
        burst := pace_burst;
        fit := pace_n;
        pend := pace_end;
        wait_seconds := pace_wait;
    ELSIF lim.rate IS NOT NULL AND NOT keyed AND room > 0 THEN
        SELECT p.t0, p.m, make_interval(secs => p.gap_seconds), p.burst, p.n, p.wait_seconds,
               p.tat_end
          INTO pt0, m, gap, burst, fit, wait_seconds, pend
          FROM {schema}.take_starts(q, room, lookahead) AS p;
    ELSIF lim.rate IS NOT NULL AND room > 0 THEN
        gap := make_interval(secs => lim.rate_seconds / lim.rate * 1.05);
        tat := {schema}.take_pace(q);
        IF tat IS NULL THEN
            -- Busy for longer than a claim takes to commit: another claim paces this queue and
            -- is stuck (a frozen worker). Try again in a moment.
            wait_seconds := 0.02;
            room := 0;
        END IF;
    END IF;

    IF lim.key_rate IS NOT NULL THEN
        key_gap := make_interval(secs => lim.key_rate_seconds / lim.key_rate * 1.05);
    END IF;

    IF room > 0 AND NOT keyed THEN
        take := room;
        IF lim.rate IS NOT NULL THEN
            take := least(room, coalesce(fit, 0));
        END IF;
        -- The queue's first rows in claim order, as many as the limits allow.
        IF take > 0 THEN
            SELECT coalesce(array_agg(c.id), '{}'), coalesce(array_agg(c.attempts + 1), '{}')
              INTO ids, atts
              FROM (SELECT t.id, t.attempts FROM {schema}.tasks AS t
                     WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT take
                       FOR UPDATE SKIP LOCKED) AS c;
        END IF;
        IF lim.rate IS NOT NULL AND cardinality(ids) > 0 THEN
            -- The pace in closed form (see take_starts): the i-th start from m.
            start_at := ARRAY(SELECT greatest(pt0, m + (i - burst) * gap)
                                FROM generate_series(1, cardinality(ids)) AS i ORDER BY i);
        END IF;
    ELSIF room > 0 THEN
        -- Per key: the first rows of each key (one probe of tasks_limit_key_idx per key with
        -- queued rows, found by a skip scan), merged in claim order with the rows without a
        -- key (among the queue's first rows only), so that a key at its limit with a deep
        -- backlog costs the others nothing. Each row is then taken if its key has a permit and
        -- its pace allows it, and if no other claim has locked it.
        FOR cand IN
            WITH RECURSIVE keys AS (
                (SELECT t.limit_key AS k FROM {schema}.tasks AS t
                  WHERE t.queue = q AND t.state = 'queued' AND t.limit_key IS NOT NULL
                  ORDER BY t.limit_key LIMIT 1)
                UNION ALL
                SELECT (SELECT t.limit_key FROM {schema}.tasks AS t
                         WHERE t.queue = q AND t.state = 'queued' AND t.limit_key IS NOT NULL
                           AND t.limit_key > keys.k
                         ORDER BY t.limit_key LIMIT 1)
                  FROM keys WHERE keys.k IS NOT NULL
            ), candidates AS (
                SELECT f.id, f.attempts, f.k, f.neg_priority, f.run_at
                  FROM keys
                 CROSS JOIN LATERAL (
                    SELECT t.id, t.attempts, t.limit_key AS k, -t.priority AS neg_priority,
                           t.run_at
                      FROM {schema}.tasks AS t
                     WHERE t.queue = q AND t.state = 'queued' AND t.limit_key = keys.k
                       AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT room) AS f
                 WHERE keys.k IS NOT NULL
                UNION ALL
                SELECT u.id, u.attempts, NULL, u.neg_priority, u.run_at FROM (
                    SELECT t.id, t.attempts, -t.priority AS neg_priority, t.run_at, t.limit_key
                      FROM {schema}.tasks AS t
                     WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT 256) AS u
                 WHERE u.limit_key IS NULL
            )
            SELECT c.id, c.attempts, c.k FROM candidates AS c
             ORDER BY c.neg_priority, c.run_at, c.id
        LOOP
            EXIT WHEN cardinality(ids) >= room;
            CONTINUE WHEN cand.k = ANY(kbusy);
            s := NULL;
            kslot := NULL;
            IF cand.k IS NOT NULL AND lim.key_concurrency IS NOT NULL THEN
                kslot := {schema}.take_key_permit(
                    q, cand.k, lim.key_concurrency,
                    ARRAY(SELECT x.s FROM unnest(rowkeys, rowslots) AS x(k, s)
                           WHERE x.k = cand.k AND x.s IS NOT NULL));
                IF kslot IS NULL THEN
                    kbusy := kbusy || cand.k;
                    held := true;
                    CONTINUE;
                END IF;
            END IF;
            IF cand.k IS NOT NULL AND lim.key_rate IS NOT NULL THEN
                s := {schema}.take_key_start(q, cand.k, key_gap, coalesce(lim.key_burst, 1),
                                             t0, horizon);
                IF s IS NULL THEN
                    -- The key's pace allows nothing more now (or another claim has it).
                    kbusy := kbusy || cand.k;
                    wait_seconds := least(coalesce(wait_seconds, 1e9), greatest(extract(
                        epoch FROM (SELECT r.tat FROM {schema}.limit_rates AS r
                                     WHERE r.queue = q AND r.limit_key = cand.k)
                                   - (coalesce(lim.key_burst, 1) - 1) * key_gap - horizon),
                        0.001));
                END IF;
            END IF;
            IF lim.rate IS NOT NULL AND (cand.k IS NULL OR lim.key_rate IS NULL OR s IS NOT NULL)
            THEN
                s := greatest(coalesce(s, t0), tat - (coalesce(lim.burst, 1) - 1) * gap);
                IF s > horizon THEN
                    wait_seconds := least(coalesce(wait_seconds, 1e9),
                                          greatest(extract(epoch FROM s - horizon), 0.001));
                    s := NULL;
                    kbusy := kbusy || coalesce(cand.k, '');
                END IF;
            END IF;
            IF (cand.k IS NOT NULL AND lim.key_rate IS NOT NULL AND s IS NULL)
               OR (lim.rate IS NOT NULL AND s IS NULL AND (cand.k IS NULL OR lim.key_rate IS NULL))
               OR NOT EXISTS (SELECT 1 FROM {schema}.tasks AS t
                               WHERE t.id = cand.id AND t.state = 'queued'
                                 FOR UPDATE SKIP LOCKED)
            THEN
                -- Not taken after all (the permit locked for it stays free).
                CONTINUE;
            END IF;
            IF lim.rate IS NOT NULL THEN
                tat := greatest(tat, s) + gap;
            END IF;
            ids := ids || cand.id;
            atts := atts || (cand.attempts + 1);
            start_at := start_at || s;
            rowkeys := rowkeys || coalesce(cand.k, '');
            rowslots := rowslots || kslot;
        END LOOP;
    END IF;

    IF NOT keyed AND fit > cardinality(ids) THEN
        -- Starts taken and not used (fewer rows, fewer permits, or none asked after all) go back
        -- to the pace, unless another claim took starts after them meanwhile.
        PERFORM {schema}.give_back_pace(q, m, gap, cardinality(ids), pend);
    END IF;
    IF keyed AND lim.rate IS NOT NULL AND tat IS NOT NULL AND cardinality(ids) > 0 THEN
        UPDATE {schema}.limit_rates AS r
           SET tat = greatest(r.tat, tat),
               window_starts = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                    THEN r.window_starts + cardinality(ids)
                                    ELSE cardinality(ids) END,
               window_start = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                   THEN r.window_start ELSE t0 END
         WHERE r.queue = q AND r.limit_key = '';
    END IF;
    IF lim.concurrency IS NOT NULL AND cardinality(ids) > 0 THEN
        -- The permits used name their rows and the attempt the claim makes; the others were
        -- only locked, and are free to the next claim. No column of an index changes: the
        -- update stays on its page (a heap-only tuple), however often permits turn over.
        -- The permits taken are the lowest free ones: one short range of the primary key (each
        -- key of `= ANY(used)` would be a descent of its own, several times slower).
        -- Each permit finds its row through `pos` (slot - lo + 1 -> its place in `used`): one
        -- array look-up per permit, not a search of the batch (batch x batch comparisons).
        used := permits[1:cardinality(ids)];
        lo := used[1];
        pos := array_fill(NULL::integer, ARRAY[used[cardinality(used)] - lo + 1]);
        FOR ix IN 1..cardinality(used) LOOP
            pos[used[ix] - lo + 1] := ix;
        END LOOP;
        UPDATE {schema}.limit_permits AS p
           SET task_id = ids[pos[p.slot - lo + 1]],
               attempt = atts[pos[p.slot - lo + 1]],
               taken_by = pg_current_xact_id()
         WHERE p.queue = q AND p.limit_key = ''
           AND p.slot BETWEEN lo AND used[cardinality(used)]
           AND pos[p.slot - lo + 1] IS NOT NULL;
    END IF;
    IF lim.key_concurrency IS NOT NULL AND cardinality(ids) > 0 THEN
        UPDATE {schema}.limit_permits AS p
           SET task_id = x.id, attempt = x.att, taken_by = pg_current_xact_id()
          FROM unnest(rowslots, rowkeys, ids, atts) AS x(slot, k, id, att)
         WHERE x.slot IS NOT NULL AND p.queue = q AND p.limit_key = x.k AND p.slot = x.slot;
    END IF;
    IF wait_seconds >= 1e9 THEN
        wait_seconds := NULL;
    END IF;
END;
$$;


-- The claim of the limited queues (see 0024). A row it takes comes with `held` true when it
-- holds a place under a concurrency limit (the queue's or its keys'): the claim marks those
-- limit_held, and tasks_limit_running_idx counts them. A row of a queue limited by rates alone
-- comes with NULL: it costs no entry in that index. (A queue held back comes as a row without an
-- id, as before.)
CREATE OR REPLACE FUNCTION {schema}.claim_limited_batch(
    queues text[], want integer, lookahead double precision DEFAULT 0.5,
    pace_queue text DEFAULT NULL, pace_t0 timestamptz DEFAULT NULL,
    pace_m timestamptz DEFAULT NULL, pace_gap double precision DEFAULT NULL,
    pace_burst integer DEFAULT NULL, pace_n integer DEFAULT NULL,
    pace_wait double precision DEFAULT NULL, pace_end timestamptz DEFAULT NULL
) RETURNS TABLE (id bigint, start_at timestamptz, queue text, wait_seconds double precision,
                 held boolean)
LANGUAGE plpgsql AS $$
DECLARE
    q     text;
    holds boolean;
    rest  integer := want;
    r     record;
    paced boolean := false;
BEGIN
    IF want > 0 AND cardinality(queues) > 0 THEN
        FOR q, holds IN
                 SELECT l.queue, l.concurrency IS NOT NULL OR l.key_concurrency IS NOT NULL
                   FROM {schema}.queue_limits AS l
                  WHERE l.queue = ANY(queues)
                    AND NOT EXISTS (SELECT 1 FROM {schema}.paused_queues AS p
                                     WHERE p.queue = l.queue)
                  ORDER BY l.queue
        LOOP
            EXIT WHEN rest <= 0;
            IF q = pace_queue THEN
                paced := true;
                SELECT * INTO r FROM {schema}.claim_limited_rows(
                    q, rest, lookahead, pace_t0, pace_m, pace_gap, pace_burst, pace_n, pace_wait,
                    pace_end);
            ELSE
                SELECT * INTO r FROM {schema}.claim_limited_rows(q, rest, lookahead);
            END IF;
            RETURN QUERY SELECT x.id, x.s, q, NULL::double precision,
                                CASE WHEN holds THEN true END
                           FROM unnest(r.ids, r.start_at) AS x(id, s);
            rest := rest - cardinality(r.ids);
            IF r.held OR r.wait_seconds IS NOT NULL THEN
                RETURN QUERY SELECT NULL::bigint, NULL::timestamptz, q, r.wait_seconds, r.held;
            END IF;
        END LOOP;
    END IF;
    IF NOT paced AND pace_n > 0 THEN
        -- The queue paced ahead was not reached (the batch filled first, or it was paused):
        -- its starts go back.
        PERFORM {schema}.give_back_pace(pace_queue, pace_m, make_interval(secs => pace_gap), 0,
                                        pace_end);
    END IF;
END;
$$;
