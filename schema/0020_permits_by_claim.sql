-- 0020: concurrency permits that cost the same however many there are and however often they
-- turn over.
--
-- Until now a permit was taken by the claim and given back by every statement that ends an
-- attempt (complete, retry, hand back, release, rescue, a dead worker's rows), through two
-- partial indexes whose predicates the update changed: every take and every give-back wrote a new
-- index entry, and a queue's permits left dead entries behind by the thousand a second. The
-- claim's cost grew with the size of the limit and with time.
--
-- Now a permit is free when nobody holds it or when its holder's attempt no longer runs under a
-- live lease: whatever ends an attempt (an acknowledgement, a rescue, an operator, an UPDATE by
-- hand) frees its permit at once, and only the claim writes to limit_permits. The table keeps
-- its primary key alone, so that write is a heap-only update on the permit's own page.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

DROP INDEX {schema}.limit_permits_free_idx;
DROP INDEX {schema}.limit_permits_task_idx;
-- Room on each page for the next version of its permits, and a vacuum soon after they turn over
-- (the worker's own vacuum service also vacuums them, between autovacuum's visits).
ALTER TABLE {schema}.limit_permits SET (fillfactor = 50, autovacuum_vacuum_scale_factor = 0,
                                        autovacuum_vacuum_threshold = 2000);

-- Keep a queue's permits up to its limit: slots above it go (a row still running on one counts
-- toward the limit by the claim's own count until it ends), and so do the per-key permits of a
-- queue without a per-key limit.
CREATE OR REPLACE FUNCTION {schema}.sync_limit_permits(q text) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    c integer;
BEGIN
    SELECT l.concurrency INTO c FROM {schema}.queue_limits AS l WHERE l.queue = q;
    INSERT INTO {schema}.limit_permits (queue, limit_key, slot)
    SELECT q, '', g FROM generate_series(1, coalesce(c, 0)) AS g
    ON CONFLICT DO NOTHING;
    DELETE FROM {schema}.limit_permits AS p
     WHERE p.queue = q AND p.limit_key = '' AND p.slot > coalesce(c, 0);
    IF NOT EXISTS (SELECT 1 FROM {schema}.queue_limits AS l
                    WHERE l.queue = q AND l.key_concurrency IS NOT NULL) THEN
        DELETE FROM {schema}.limit_permits AS p WHERE p.queue = q AND p.limit_key <> '';
    END IF;
    IF EXISTS (SELECT 1 FROM {schema}.queue_limits AS l WHERE l.queue = q AND l.rate IS NOT NULL)
    THEN
        INSERT INTO {schema}.limit_rates (queue, limit_key) VALUES (q, '') ON CONFLICT DO NOTHING;
    ELSE
        DELETE FROM {schema}.limit_rates AS r WHERE r.queue = q AND r.limit_key = '';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {schema}.queue_limits AS l
                    WHERE l.queue = q AND l.key_rate IS NOT NULL) THEN
        DELETE FROM {schema}.limit_rates AS r WHERE r.queue = q AND r.limit_key <> '';
    END IF;
END;
$$;

-- The free permits: nobody holds them, or their holder's attempt no longer runs under a live
-- lease (as of the transaction's start: a lease that lapsed since still counts, the safe side).
-- One definition for every claim; a view, so that the planner reads it as part of each query
-- (and SELECT ... FOR UPDATE on it locks the permits).
CREATE VIEW {schema}.free_permits AS
SELECT p.queue, p.limit_key, p.slot
  FROM {schema}.limit_permits AS p
 WHERE p.task_id IS NULL
    OR NOT EXISTS (SELECT 1 FROM {schema}.tasks AS t
                    WHERE t.id = p.task_id AND t.attempts = p.attempt
                      AND t.state = 'in_progress' AND t.lease_expires_at >= now());

-- A free permit of key k (slot <= c), locked for this claim, or NULL. `mine`: the slots this
-- claim already took for k (its own locks do not keep it from taking them twice).
DROP FUNCTION {schema}.take_key_permit(text, text, integer, timestamptz);
CREATE FUNCTION {schema}.take_key_permit(q text, k text, c integer, mine integer[])
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    got integer;
BEGIN
    LOOP
        SELECT p.slot INTO got FROM {schema}.free_permits AS p
         WHERE p.queue = q AND p.limit_key = k AND p.slot <= c AND p.slot <> ALL(mine)
         ORDER BY p.slot LIMIT 1 FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        -- Checked again now that it is locked (see the same check in claim_limited_rows).
        IF EXISTS (SELECT 1 FROM {schema}.free_permits AS p
                    WHERE p.queue = q AND p.limit_key = k AND p.slot = got) THEN
            RETURN got;
        END IF;
        mine := mine || got;
    END LOOP;
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

-- The pace of queue q (its next start if the starts so far had been spaced evenly), locked for
-- this claim; NULL when another claim holds it for longer than 20 ms. Another claim commits
-- within a few milliseconds: waiting for it costs less than leaving the queue for 20 ms, as
-- SKIP LOCKED did whenever two workers claimed one rate-limited queue at once. A claim stuck in
-- its transaction (a frozen worker) holds the others up 20 ms at most.
CREATE FUNCTION {schema}.take_pace(q text) RETURNS timestamptz
LANGUAGE plpgsql
SET lock_timeout = '20ms'
AS $$
DECLARE
    pace timestamptz;
BEGIN
    SELECT r.tat INTO pace FROM {schema}.limit_rates AS r
     WHERE r.queue = q AND r.limit_key = '' FOR UPDATE;
    RETURN pace;
EXCEPTION WHEN lock_not_available THEN
    RETURN NULL;
END;
$$;

-- The claim of one limited queue (see 0017), with the permits above: a permit is taken if free by
-- that rule, and written once, when its row is claimed.
CREATE OR REPLACE FUNCTION {schema}.claim_limited_rows(
    q text,
    want integer,
    lookahead double precision DEFAULT 0.5,
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
        permits := ARRAY(
            SELECT p.slot FROM {schema}.free_permits AS p
             WHERE p.queue = q AND p.limit_key = '' AND p.slot <= lim.concurrency
             ORDER BY p.slot LIMIT room
               FOR UPDATE SKIP LOCKED);
        -- Checked again, now that they are locked, by a statement whose snapshot is taken after
        -- the locks: a permit that another claim took and committed just before this one locked
        -- it came to the statement above in its new version, but with its new holder's row as
        -- it was before that claim (not yet running), so it looked free.
        IF cardinality(permits) > 0 THEN
            permits := ARRAY(
                SELECT p.slot FROM {schema}.free_permits AS p
                 WHERE p.queue = q AND p.limit_key = ''
                   AND p.slot BETWEEN permits[1] AND permits[cardinality(permits)]
                   AND array_position(permits, p.slot) IS NOT NULL
                 ORDER BY p.slot);
        END IF;
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

    IF lim.rate IS NOT NULL AND room > 0 THEN
        gap := make_interval(secs => lim.rate_seconds / lim.rate * 1.05);
        tat := {schema}.take_pace(q);
        IF tat IS NULL THEN
            -- Busy for longer than a claim takes to commit: another claim paces this queue and
            -- is stuck (a frozen worker). Try again in a moment.
            wait_seconds := 0.02;
            room := 0;
        END IF;
    END IF;

    keyed := lim.key_concurrency IS NOT NULL OR lim.key_rate IS NOT NULL;
    IF lim.key_rate IS NOT NULL THEN
        key_gap := make_interval(secs => lim.key_rate_seconds / lim.key_rate * 1.05);
    END IF;

    IF room > 0 AND NOT keyed THEN
        take := room;
        IF lim.rate IS NOT NULL THEN
            -- The pace in closed form: after `tat`, the i-th start of this claim (from 1) is due
            -- at greatest(t0, m + (i - burst) * gap) with m = greatest(tat, t0), which is what
            -- spacing the starts one by one gives; those due within the horizon are taken.
            m := greatest(tat, t0);
            fit := coalesce(lim.burst, 1)
                   + floor(extract(epoch FROM horizon - m) / extract(epoch FROM gap))::integer;
            take := least(room, greatest(fit, 0));
            IF take < room THEN
                wait_seconds := greatest(extract(epoch FROM
                    greatest(t0, m + (take + 1 - coalesce(lim.burst, 1)) * gap) - horizon), 0.001);
            END IF;
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
            start_at := ARRAY(SELECT greatest(t0, m + (i - coalesce(lim.burst, 1)) * gap)
                                FROM generate_series(1, cardinality(ids)) AS i ORDER BY i);
            tat := m + cardinality(ids) * gap;
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

    IF lim.rate IS NOT NULL AND tat IS NOT NULL AND cardinality(ids) > 0 THEN
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
        used := permits[1:cardinality(ids)];
        UPDATE {schema}.limit_permits AS p
           SET task_id = ids[array_position(used, p.slot)],
               attempt = atts[array_position(used, p.slot)]
         WHERE p.queue = q AND p.limit_key = ''
           AND p.slot BETWEEN (SELECT min(u) FROM unnest(used) AS u)
                          AND (SELECT max(u) FROM unnest(used) AS u)
           AND array_position(used, p.slot) IS NOT NULL;
    END IF;
    IF lim.key_concurrency IS NOT NULL AND cardinality(ids) > 0 THEN
        UPDATE {schema}.limit_permits AS p
           SET task_id = x.id, attempt = x.att
          FROM unnest(rowslots, rowkeys, ids, atts) AS x(slot, k, id, att)
         WHERE x.slot IS NOT NULL AND p.queue = q AND p.limit_key = x.k AND p.slot = x.slot;
    END IF;
    IF wait_seconds >= 1e9 THEN
        wait_seconds := NULL;
    END IF;
END;
$$;
