-- 0024: the pace of a rate limit taken ahead of the claim, in a transaction of its own.
--
-- Until now a claim of a rate-limited queue locked the queue's pace (limit_rates) and kept the
-- lock until its transaction committed, which also acknowledges the worker's finished tasks: two
-- workers claiming one rate-limited queue took turns, each waiting for the other's commit (a
-- claim took about four times as long as one of an unlimited queue, and the rate-limited drain
-- fell to a half of the unlimited one on a busy machine).
--
-- Now a worker takes the starts of its next claim first, with pace_ahead, in a transaction of
-- its own that commits at once (its commit need not wait for the disk: a claim that uses those
-- starts commits durably after it, and that flushes the pace too). The claim then uses them, and
-- gives back what it did not use (fewer rows than starts, fewer permits) if nobody took starts
-- after them meanwhile; a start lost that way (or by a claim that rolled back) is a start not
-- made, never one too many. A claim given no starts ahead takes them itself, as before, with the
-- same function (take_starts). Per-key rates keep their pace taken row by row in the claim.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- The next `want` starts of queue q's rate (n of them: as many as fall within `lookahead`
-- seconds), taken: the pace moves past them. The i-th (from 1) is due at
-- greatest(t0, m + (i - burst) * gap), which is what spacing starts one by one from the pace
-- gives. n is NULL when q has no rate; 0 with wait_seconds when the pace allows none now (or
-- another transaction has held the pace for more than 20 ms). tat_end: the pace as left.
CREATE FUNCTION {schema}.take_starts(
    q text,
    want integer,
    lookahead double precision DEFAULT 0.5,
    OUT t0 timestamptz,
    OUT m timestamptz,
    OUT gap_seconds double precision,
    OUT burst integer,
    OUT n integer,
    OUT wait_seconds double precision,
    OUT tat_end timestamptz
)
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    lim     {schema}.queue_limits;
    gap     interval;
    tat     timestamptz;
    horizon timestamptz;
    fit     integer;
BEGIN
    SELECT * INTO lim FROM {schema}.queue_limits AS l WHERE l.queue = q;
    IF NOT FOUND OR lim.rate IS NULL THEN
        RETURN;
    END IF;
    -- The database clock now (not the transaction's start): the pace is counted from it.
    t0 := clock_timestamp();
    gap := make_interval(secs => lim.rate_seconds / lim.rate * 1.05);
    gap_seconds := extract(epoch FROM gap);
    burst := coalesce(lim.burst, 1);
    n := 0;
    IF want <= 0 THEN
        RETURN;
    END IF;
    tat := {schema}.take_pace(q);
    IF tat IS NULL THEN
        -- Another transaction has held the pace for longer than taking starts takes (a claim
        -- stuck in its transaction: a frozen worker). Try again in a moment.
        wait_seconds := 0.02;
        RETURN;
    END IF;
    m := greatest(tat, t0);
    horizon := t0 + make_interval(secs => lookahead);
    fit := burst + floor(extract(epoch FROM horizon - m) / extract(epoch FROM gap))::integer;
    n := least(want, greatest(fit, 0));
    IF n < want THEN
        wait_seconds := greatest(extract(epoch FROM
            greatest(t0, m + (n + 1 - burst) * gap) - horizon), 0.001);
    END IF;
    tat_end := m + n * gap;
    IF n > 0 THEN
        UPDATE {schema}.limit_rates AS r
           SET tat = tat_end,
               window_starts = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                    THEN r.window_starts + n ELSE n END,
               window_start = CASE WHEN r.window_start > t0 - make_interval(secs => lim.rate_seconds)
                                   THEN r.window_start ELSE t0 END
         WHERE r.queue = q AND r.limit_key = '';
    END IF;
END;
$$;

-- Starts taken from m and not all used (`used` of them were): the pace goes back to just after
-- the used ones, if it is still where the taking left it (`taken_end`) and nobody holds it now.
-- Otherwise the starts are lost: fewer starts than the rate allows, never more.
CREATE FUNCTION {schema}.give_back_pace(
    q text, m timestamptz, gap interval, used integer, taken_end timestamptz
) RETURNS void
LANGUAGE sql AS $$
    UPDATE {schema}.limit_rates AS r
       SET tat = m + used * gap,
           window_starts = greatest(r.window_starts
                                    - round(extract(epoch FROM taken_end - (m + used * gap))
                                            / nullif(extract(epoch FROM gap), 0))::integer, 0)
     WHERE r.queue = q AND r.limit_key = '' AND r.tat = taken_end
       AND r.ctid = (SELECT x.ctid FROM {schema}.limit_rates AS x
                      WHERE x.queue = q AND x.limit_key = '' FOR UPDATE SKIP LOCKED);
$$;

-- The starts of a worker's next claim of queue q, taken in a transaction of their own: call it
-- alone (autocommit), never inside another transaction. Only a queue with a rate and no other
-- limit is paced ahead: n is NULL for the others (the claim paces them itself), and 0 for a
-- paused queue. The commit need not wait for the disk (see above).
CREATE FUNCTION {schema}.pace_ahead(
    q text,
    want integer,
    lookahead double precision DEFAULT 0.5,
    OUT t0 timestamptz,
    OUT m timestamptz,
    OUT gap_seconds double precision,
    OUT burst integer,
    OUT n integer,
    OUT wait_seconds double precision,
    OUT tat_end timestamptz
)
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
BEGIN
    IF NOT EXISTS (SELECT 1 FROM {schema}.queue_limits AS l
                    WHERE l.queue = q AND l.rate IS NOT NULL AND l.concurrency IS NULL
                      AND l.key_concurrency IS NULL AND l.key_rate IS NULL) THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = q) THEN
        n := 0;
        RETURN;
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT s.t0, s.m, s.gap_seconds, s.burst, s.n, s.wait_seconds, s.tat_end
      INTO t0, m, gap_seconds, burst, n, wait_seconds, tat_end
      FROM {schema}.take_starts(q, want, lookahead) AS s;
END;
$$;

-- A permit's holder is read by its primary key, permit by permit: the row with that id, then
-- whether that attempt still runs under a live lease. (Asked as one EXISTS, the planner could
-- answer it with a hash of every running task in the table, whatever its queue, or by walking
-- the running tasks for each permit: a claim's cost would grow with the whole fleet's work.)
CREATE OR REPLACE VIEW {schema}.free_permits AS
SELECT p.queue, p.limit_key, p.slot
  FROM {schema}.limit_permits AS p
 WHERE p.task_id IS NULL
    OR NOT coalesce((SELECT t.attempts = p.attempt AND t.state = 'in_progress'
                            AND t.lease_expires_at >= now()
                       FROM {schema}.tasks AS t WHERE t.id = p.task_id), false);

DROP FUNCTION {schema}.claim_limited_batch(text[], integer, double precision);
DROP FUNCTION {schema}.claim_limited_rows(text, integer, double precision);

-- The claim of one limited queue (see 0020), with its pace taken ahead or by take_starts.
CREATE FUNCTION {schema}.claim_limited_rows(
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

-- The limited part of one claim (see 0017), given the starts taken ahead for one queue (pace_*).
CREATE FUNCTION {schema}.claim_limited_batch(
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
    rest  integer := want;
    r     record;
    paced boolean := false;
BEGIN
    IF want > 0 AND cardinality(queues) > 0 THEN
        FOR q IN SELECT l.queue FROM {schema}.queue_limits AS l
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
            RETURN QUERY SELECT x.id, x.s, q, NULL::double precision, NULL::boolean
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

-- An edge is written once by the workflow's enqueue and updated once, when its step settles
-- (its outcome and result, no indexed column): with room on its page for that one new version
-- the update stays on the page (heap-only), instead of adding an entry to both of the edges'
-- indexes for every step of a fan-out.
ALTER TABLE {schema}.task_deps SET (fillfactor = 50);

-- settle_steps (0023), saying also in which queues it made steps ready (the worker that
-- acknowledges a step reads those queues in the claim of the same transaction, so the next step
-- of a chain is claimed in the commit that finished the one before it, without waiting for the
-- notification that commit sends, which still wakes the other workers), and taking as settled
-- the steps whose acknowledgement in this transaction marked them so. settle_steps stays, for
-- the functions that call it, as the count alone.
CREATE FUNCTION {schema}.settle_steps_ready(
    ids bigint[], OUT released integer, OUT ready_queues text[]
)
LANGUAGE plpgsql AS $$
DECLARE
    parents  bigint[] := ids;
    n        integer;
    woken    text[] := '{}';
    earliest timestamptz;
    first_at timestamptz;
    queues   text[];
    kids     bigint[];
    counts   integer[];
    blockers bigint[];
    errors   text[];
BEGIN
    released := 0;
    WHILE cardinality(parents) > 0 LOOP
        -- The outcomes (and results) of the finished steps, onto their edges.
        -- A step is marked settled (dependents false) here, or already by the acknowledgement
        -- that ended it, in this same transaction (complete_with_result): one row version
        -- fewer per step. An edge settled before is not settled again (outcome IS NULL below).
        WITH marked AS (
            UPDATE {schema}.tasks AS t SET dependents = false
             WHERE t.id = ANY(parents) AND t.dependents
               AND t.state IN ('done', 'failed', 'cancelled')
            RETURNING t.id, t.state::text AS state, t.result, t.task
        ), p AS (
            SELECT * FROM marked
            UNION ALL
            SELECT t.id, t.state::text, t.result, t.task FROM {schema}.tasks AS t
             WHERE t.id = ANY(parents) AND NOT t.dependents
               AND t.state IN ('done', 'failed', 'cancelled')
        ), e AS (
            UPDATE {schema}.task_deps AS d
               SET outcome = p.state, result = CASE WHEN p.state = 'done' THEN p.result END
              FROM p
             WHERE d.depends_on = p.id AND d.outcome IS NULL
            RETURNING d.task_id, d.depends_on, d.run_on_failure, d.outcome, p.task
        ), c AS (
            SELECT e.task_id AS id, count(*)::integer AS n,
                   min(e.depends_on) FILTER (WHERE e.outcome <> 'done' AND NOT e.run_on_failure)
                       AS blocker
              FROM e GROUP BY e.task_id
        )
        SELECT coalesce(array_agg(c.id ORDER BY c.id), '{}'),
               coalesce(array_agg(c.n ORDER BY c.id), '{}'),
               coalesce(array_agg(c.blocker ORDER BY c.id), '{}'),
               coalesce(array_agg((SELECT format('DependencyFailed: step %s (%s) ended %s',
                                                 e.depends_on, left(e.task, 100), e.outcome)
                                     FROM e WHERE e.task_id = c.id AND e.depends_on = c.blocker)
                                  ORDER BY c.id), '{}')
          INTO kids, counts, blockers, errors
          FROM c;
        EXIT WHEN cardinality(kids) = 0;
        -- In id order: the acknowledgements of other workers settle the same joins.
        PERFORM 1 FROM {schema}.tasks AS t WHERE t.id = ANY(kids) ORDER BY t.id FOR UPDATE;
        -- A statement of its own, so that it sees what was committed before the locks.
        WITH c AS (
            SELECT * FROM unnest(kids, counts, blockers, errors) AS c(id, n, blocker, error)
        ), moved AS (
            UPDATE {schema}.tasks AS t
               SET pending_deps = t.pending_deps - c.n,
                   state = CASE WHEN c.blocker IS NOT NULL THEN 'cancelled'::{schema}.task_state
                                WHEN t.pending_deps - c.n > 0 THEN 'waiting'
                                WHEN t.run_at > now() THEN 'scheduled'
                                ELSE 'queued' END,
                   run_at = CASE WHEN c.blocker IS NULL AND t.pending_deps - c.n <= 0
                                 THEN greatest(t.run_at, now()) ELSE t.run_at END,
                   finished_at = CASE WHEN c.blocker IS NOT NULL THEN now() END,
                   cancelled_by = CASE WHEN c.blocker IS NOT NULL THEN 'workflow'
                                       ELSE t.cancelled_by END,
                   last_error = CASE WHEN c.blocker IS NOT NULL THEN c.error
                                     ELSE t.last_error END,
                   inputs = CASE WHEN c.blocker IS NULL AND t.pending_deps - c.n <= 0 THEN (
                       SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                         FROM {schema}.task_deps AS d WHERE d.task_id = t.id) END
              FROM c
             WHERE t.id = c.id AND t.state = 'waiting'
            RETURNING t.id, t.state, t.queue, t.run_at, t.dependents
        )
        SELECT coalesce(array_agg(m.id) FILTER (WHERE m.state = 'cancelled' AND m.dependents), '{}'),
               count(*) FILTER (WHERE m.state = 'queued')::integer,
               coalesce(array_agg(m.queue) FILTER (WHERE m.state = 'queued'), '{}'),
               min(m.run_at) FILTER (WHERE m.state = 'queued')
          INTO parents, n, queues, first_at
          FROM moved AS m;
        released := released + n;
        woken := woken || queues;
        earliest := least(earliest, first_at);
    END LOOP;
    PERFORM {schema}.wake_steps(woken, earliest);
    ready_queues := ARRAY(SELECT DISTINCT w FROM unnest(woken) AS w);
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.settle_steps(ids bigint[]) RETURNS integer
LANGUAGE sql AS $$
    SELECT released FROM {schema}.settle_steps_ready(ids);
$$;
