-- 0017: one claim for every queue, where pauses, limits and priorities are predicates of one
-- function, and no claim waits on a lock another worker holds.
--
-- Before this, limited queues had a claim of their own (claim_limited, 0014) that serialised the
-- claims of a queue on its queue_limits row until the whole batch committed: a worker frozen in
-- that transaction stalled every other worker's claims, and the limited claim did not read
-- paused_queues. Now:
--   * concurrency limits are permits: one row per slot (limit_permits), taken with
--     FOR UPDATE SKIP LOCKED by the claim and given back by the acknowledgement, so concurrent
--     claims take different permits and a frozen claim holds only the permits it took;
--   * rate limits pace starts (GCRA, limit_rates): each started task gets the moment it may
--     start, spaced at least period / rate apart, with a burst of `burst` at once; the row of a
--     queue's (or key's) pace is taken with SKIP LOCKED, so a claim that finds it busy moves on;
--   * `claim` below does it all, for every queue, in one statement of the worker.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER TABLE {schema}.queue_limits
    ADD COLUMN burst integer,
    ADD COLUMN key_burst integer,
    ADD CONSTRAINT queue_limits_burst CHECK (burst >= 1 AND key_burst >= 1);

-- One row per slot of a concurrency limit: `limit_key` '' for the queue's own limit, the key for
-- a per-key limit. A permit is free when task_id is NULL, or when its holder no longer runs that
-- attempt under a live lease (a crash the acknowledgement never saw: the claim takes it back).
CREATE TABLE {schema}.limit_permits (
    queue     text    NOT NULL,
    limit_key text    NOT NULL DEFAULT '',
    slot      integer NOT NULL,
    task_id   bigint,
    attempt   integer,
    PRIMARY KEY (queue, limit_key, slot)
);
CREATE INDEX limit_permits_free_idx ON {schema}.limit_permits (queue, limit_key, slot)
    WHERE task_id IS NULL;
CREATE INDEX limit_permits_task_idx ON {schema}.limit_permits (task_id)
    WHERE task_id IS NOT NULL;

-- The pace of a rate limit (GCRA): `tat` is the moment the next start would be due if the
-- starts so far had been spaced evenly; a start may come up to (burst - 1) intervals earlier.
-- `window_start` and `window_starts` count the starts of the current period (for status pages).
CREATE TABLE {schema}.limit_rates (
    queue         text NOT NULL,
    limit_key     text NOT NULL DEFAULT '',
    tat           timestamptz NOT NULL DEFAULT '-infinity',
    window_start  timestamptz NOT NULL DEFAULT '-infinity',
    window_starts integer NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, limit_key)
);

-- Running rows keep their permit; the table of recent starts is replaced by the pace.
DROP FUNCTION {schema}.claim_limited(text, uuid, integer, double precision, text[], integer[]);
DROP TABLE {schema}.limit_starts;

-- The permits of a queue's own concurrency limit follow its value: slots 1..concurrency exist,
-- free slots above it go (held ones go when freed, and are never taken meanwhile).
CREATE FUNCTION {schema}.sync_limit_permits(q text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    c integer;
BEGIN
    SELECT l.concurrency INTO c FROM {schema}.queue_limits AS l WHERE l.queue = q;
    INSERT INTO {schema}.limit_permits (queue, limit_key, slot)
    SELECT q, '', g FROM generate_series(1, coalesce(c, 0)) AS g
    ON CONFLICT DO NOTHING;
    DELETE FROM {schema}.limit_permits AS p
     WHERE p.queue = q AND p.limit_key = '' AND p.slot > coalesce(c, 0) AND p.task_id IS NULL;
    IF NOT EXISTS (SELECT 1 FROM {schema}.queue_limits AS l
                    WHERE l.queue = q AND l.key_concurrency IS NOT NULL) THEN
        DELETE FROM {schema}.limit_permits AS p
         WHERE p.queue = q AND p.limit_key <> '' AND p.task_id IS NULL;
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

DROP FUNCTION {schema}.set_queue_limit(text, integer, integer, integer, double precision,
                                       integer, double precision, text, text);

-- Operators (and the CLI, which calls it): set or change a queue's limits. Effective for the
-- next claim of that queue. `burst`: starts a rate limit lets through at once (default 1: starts
-- spaced evenly); `key_burst` the same per key.
CREATE FUNCTION {schema}.set_queue_limit(
    queue text,
    concurrency integer DEFAULT NULL,
    key_concurrency integer DEFAULT NULL,
    rate integer DEFAULT NULL,
    rate_seconds double precision DEFAULT NULL,
    key_rate integer DEFAULT NULL,
    key_rate_seconds double precision DEFAULT NULL,
    source text DEFAULT 'operator',
    updated_by text DEFAULT current_user,
    burst integer DEFAULT NULL,
    key_burst integer DEFAULT NULL
) RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    changed boolean;
BEGIN
    IF queue IS NULL OR queue = '' OR char_length(queue) > 255 THEN
        RAISE EXCEPTION 'a queue name is 1 to 255 characters' USING ERRCODE = '22023';
    END IF;
    IF num_nonnulls(concurrency, key_concurrency, rate, key_rate) = 0 THEN
        RAISE EXCEPTION 'give at least one limit (use clear_queue_limit to remove them)'
            USING ERRCODE = '22023';
    END IF;
    IF concurrency > 100000 OR key_concurrency > 100000 THEN
        RAISE EXCEPTION 'a concurrency limit is at most 100000' USING ERRCODE = '22023';
    END IF;
    IF rate IS NOT NULL AND rate_seconds IS NULL THEN
        rate_seconds := 1;
    END IF;
    IF key_rate IS NOT NULL AND key_rate_seconds IS NULL THEN
        key_rate_seconds := 1;
    END IF;
    INSERT INTO {schema}.queue_limits AS l
        (queue, concurrency, key_concurrency, rate, rate_seconds, key_rate, key_rate_seconds,
         burst, key_burst, source, updated_by)
    VALUES (queue, concurrency, key_concurrency, rate,
            CASE WHEN rate IS NOT NULL THEN rate_seconds END, key_rate,
            CASE WHEN key_rate IS NOT NULL THEN key_rate_seconds END,
            CASE WHEN rate IS NOT NULL THEN burst END,
            CASE WHEN key_rate IS NOT NULL THEN key_burst END, source,
            left(coalesce(updated_by, ''), 200))
    ON CONFLICT ON CONSTRAINT queue_limits_pkey DO UPDATE
       SET concurrency = excluded.concurrency, key_concurrency = excluded.key_concurrency,
           rate = excluded.rate, rate_seconds = excluded.rate_seconds,
           key_rate = excluded.key_rate, key_rate_seconds = excluded.key_rate_seconds,
           burst = excluded.burst, key_burst = excluded.key_burst,
           source = excluded.source, updated_by = excluded.updated_by, updated_at = now()
     -- Code never overrides an operator's setting (see the table).
     WHERE excluded.source = 'operator' OR l.source = 'code';
    changed := FOUND;
    PERFORM {schema}.sync_limit_permits(queue);
    RETURN changed;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.clear_queue_limit(queue text) RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
BEGIN
    DELETE FROM {schema}.queue_limits AS l WHERE l.queue = clear_queue_limit.queue;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM {schema}.sync_limit_permits(clear_queue_limit.queue);
    RETURN true;
END;
$$;

SELECT {schema}.sync_limit_permits(l.queue) FROM {schema}.queue_limits AS l;

-- The rows a claim of one limited queue may take, with the permit each holds and the moment
-- each may start under a rate's pace (NULL: no rate). Taken in claim order (priority, run_at, id), within:
--   * the queue's free permits (FOR UPDATE SKIP LOCKED: permits another claim is taking are
--     left to it); when the free ones run short, permits whose holder no longer runs;
--   * per key: the key's free permits, made for a key the first time it is met (a short wait
--     at most: a key whose permits another transaction is making is left for the next claim);
--   * the pace of the rate limits: the queue's pace row and each key's, taken with SKIP LOCKED
--     (busy: this claim takes nothing under that pace); starts are spaced at least
--     period / rate x 1.05 apart (the 5% absorbs the jitter of the handlers' start: up to 2%
--     late by the runner's clock, the rest for the delays it cannot see), up to
--     `burst` at once, and only those due within `lookahead` seconds are taken.
-- `wait_seconds` says when the next start is allowed when a rate held work back; `held` that a
-- concurrency limit did.
CREATE FUNCTION {schema}.claim_limited_rows(
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
AS $$
#variable_conflict use_variable
DECLARE
    lim      {schema}.queue_limits;
    -- The database clock now (not the transaction's start): the pace is counted from it.
    t0       timestamptz := clock_timestamp();
    room     integer := want;
    permits  integer[] := '{}';
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
        permits := ARRAY(
            SELECT p.slot FROM {schema}.limit_permits AS p
             WHERE p.queue = q AND p.limit_key = '' AND p.task_id IS NULL
               AND p.slot <= lim.concurrency
             ORDER BY p.slot LIMIT room
               FOR UPDATE SKIP LOCKED);
        IF cardinality(permits) < room THEN
            permits := permits || ARRAY(
                SELECT p.slot FROM {schema}.limit_permits AS p
                 WHERE p.queue = q AND p.limit_key = '' AND p.task_id IS NOT NULL
                   AND p.slot <= lim.concurrency
                   AND NOT EXISTS (
                       SELECT 1 FROM {schema}.tasks AS t
                        WHERE t.id = p.task_id AND t.attempts = p.attempt
                          AND t.state = 'in_progress' AND t.lease_expires_at >= t0)
                 ORDER BY p.slot LIMIT room - cardinality(permits)
                   FOR UPDATE SKIP LOCKED);
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
        SELECT r.tat INTO tat FROM {schema}.limit_rates AS r
         WHERE r.queue = q AND r.limit_key = '' FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            -- Busy: another claim paces this queue right now. Try again in a moment.
            wait_seconds := 0.02;
            room := 0;
        END IF;
    END IF;

    keyed := lim.key_concurrency IS NOT NULL OR lim.key_rate IS NOT NULL;
    IF lim.key_rate IS NOT NULL THEN
        key_gap := make_interval(secs => lim.key_rate_seconds / lim.key_rate * 1.05);
    END IF;

    IF room > 0 AND NOT keyed THEN
        -- The queue's first rows in claim order, as many as there is room for.
        FOR cand IN
            SELECT t.id FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= t0
             ORDER BY (-t.priority), t.run_at, t.id
             LIMIT room
               FOR UPDATE SKIP LOCKED
        LOOP
            s := NULL;
            IF lim.rate IS NOT NULL THEN
                s := greatest(t0, tat - (coalesce(lim.burst, 1) - 1) * gap);
                IF s > horizon THEN
                    wait_seconds := greatest(extract(epoch FROM s - horizon), 0.001);
                    EXIT;
                END IF;
                tat := greatest(tat, s) + gap;
            END IF;
            ids := ids || cand.id;
            start_at := start_at || s;
        END LOOP;
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
                SELECT f.id, f.k, f.neg_priority, f.run_at
                  FROM keys
                 CROSS JOIN LATERAL (
                    SELECT t.id, t.limit_key AS k, -t.priority AS neg_priority, t.run_at
                      FROM {schema}.tasks AS t
                     WHERE t.queue = q AND t.state = 'queued' AND t.limit_key = keys.k
                       AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT room) AS f
                 WHERE keys.k IS NOT NULL
                UNION ALL
                SELECT u.id, NULL, u.neg_priority, u.run_at FROM (
                    SELECT t.id, -t.priority AS neg_priority, t.run_at, t.limit_key
                      FROM {schema}.tasks AS t
                     WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= t0
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT 256) AS u
                 WHERE u.limit_key IS NULL
            )
            SELECT c.id, c.k FROM candidates AS c ORDER BY c.neg_priority, c.run_at, c.id
        LOOP
            EXIT WHEN cardinality(ids) >= room;
            CONTINUE WHEN cand.k = ANY(kbusy);
            s := NULL;
            kslot := NULL;
            IF cand.k IS NOT NULL AND lim.key_concurrency IS NOT NULL THEN
                kslot := {schema}.take_key_permit(q, cand.k, lim.key_concurrency, t0);
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
                -- Not taken after all: the permit taken for it is free again.
                IF kslot IS NOT NULL THEN
                    UPDATE {schema}.limit_permits AS p SET task_id = NULL, attempt = NULL
                     WHERE p.queue = q AND p.limit_key = cand.k AND p.slot = kslot;
                END IF;
                CONTINUE;
            END IF;
            IF lim.rate IS NOT NULL THEN
                tat := greatest(tat, s) + gap;
            END IF;
            ids := ids || cand.id;
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
    IF lim.concurrency IS NOT NULL THEN
        -- Permits not used (fewer rows than permits): free again at commit; the ones used name
        -- their rows (their attempt is the one the claim below makes).
        UPDATE {schema}.limit_permits AS p
           SET task_id = x.id, attempt = t.attempts + 1
          FROM unnest(permits[1:cardinality(ids)], ids) AS x(slot, id)
          JOIN {schema}.tasks AS t ON t.id = x.id
         WHERE p.queue = q AND p.limit_key = '' AND p.slot = x.slot;
    END IF;
    IF lim.key_concurrency IS NOT NULL THEN
        UPDATE {schema}.limit_permits AS p
           SET task_id = x.id, attempt = t.attempts + 1
          FROM unnest(rowslots, rowkeys, ids) AS x(slot, k, id)
          JOIN {schema}.tasks AS t ON t.id = x.id
         WHERE x.slot IS NOT NULL AND p.queue = q AND p.limit_key = x.k AND p.slot = x.slot;
    END IF;
    IF wait_seconds >= 1e9 THEN
        wait_seconds := NULL;
    END IF;
END;
$$;

-- The permits (c of them; NULL: none) and the pace row of key `k`, the first time the key is
-- met. It waits at most 50 ms for another transaction making the same rows (lock_not_available
-- then: the caller leaves the key for the next claim).
CREATE FUNCTION {schema}.make_key_limits(q text, k text, c integer) RETURNS void
LANGUAGE plpgsql SET lock_timeout = '50ms' AS $$
BEGIN
    IF c IS NOT NULL THEN
        INSERT INTO {schema}.limit_permits (queue, limit_key, slot)
        SELECT q, k, g FROM generate_series(1, c) AS g ON CONFLICT DO NOTHING;
    ELSE
        INSERT INTO {schema}.limit_rates (queue, limit_key) VALUES (q, k) ON CONFLICT DO NOTHING;
    END IF;
END;
$$;

-- A free permit of key `k` (made the first time the key is met), locked, or NULL when the key
-- is at its limit. Making the permits waits at most 50 ms on another transaction making them.
CREATE FUNCTION {schema}.take_key_permit(q text, k text, c integer, t0 timestamptz)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    got integer;
BEGIN
    SELECT p.slot INTO got FROM {schema}.limit_permits AS p
     WHERE p.queue = q AND p.limit_key = k AND p.task_id IS NULL AND p.slot <= c
     ORDER BY p.slot LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        -- Marked at once, so that the next row of the same key in this claim takes another.
        UPDATE {schema}.limit_permits AS p SET task_id = 0, attempt = 0
         WHERE p.queue = q AND p.limit_key = k AND p.slot = got;
        RETURN got;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM {schema}.limit_permits AS p
                    WHERE p.queue = q AND p.limit_key = k) THEN
        BEGIN
            PERFORM {schema}.make_key_limits(q, k, c);
        EXCEPTION WHEN lock_not_available THEN
            RETURN NULL;
        END;
        RETURN {schema}.take_key_permit(q, k, c, t0);
    END IF;
    -- Permits whose holder no longer runs.
    SELECT p.slot INTO got FROM {schema}.limit_permits AS p
     WHERE p.queue = q AND p.limit_key = k AND p.task_id IS NOT NULL AND p.task_id <> 0
       AND p.slot <= c
       AND NOT EXISTS (
           SELECT 1 FROM {schema}.tasks AS t
            WHERE t.id = p.task_id AND t.attempts = p.attempt
              AND t.state = 'in_progress' AND t.lease_expires_at >= t0)
     ORDER BY p.slot LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE {schema}.limit_permits AS p SET task_id = 0, attempt = 0
         WHERE p.queue = q AND p.limit_key = k AND p.slot = got;
    END IF;
    RETURN got;
END;
$$;

-- The moment the next start of key `k` may come (its pace row taken with SKIP LOCKED, made the
-- first time), advanced past it; NULL when that is after `horizon` or the row is busy.
CREATE FUNCTION {schema}.take_key_start(
    q text, k text, gap interval, burst integer, t0 timestamptz, horizon timestamptz
) RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    pace timestamptz;
    s   timestamptz;
BEGIN
    SELECT r.tat INTO pace FROM {schema}.limit_rates AS r
     WHERE r.queue = q AND r.limit_key = k FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        BEGIN
            PERFORM {schema}.make_key_limits(q, k, NULL);
        EXCEPTION WHEN lock_not_available THEN
            RETURN NULL;
        END;
        SELECT r.tat INTO pace FROM {schema}.limit_rates AS r
         WHERE r.queue = q AND r.limit_key = k FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    s := greatest(t0, pace - (burst - 1) * gap);
    IF s > horizon THEN
        RETURN NULL;
    END IF;
    UPDATE {schema}.limit_rates AS r SET tat = greatest(pace, s) + gap
     WHERE r.queue = q AND r.limit_key = k;
    RETURN s;
END;
$$;

-- The limited part of one claim: the limited queues among those asked (paused ones left out),
-- in name order (the order every worker takes their permits in), each given what room is left of
-- `want`. Rows with an id: taken (start_at: the moment a rate's pace lets it start; NULL: no
-- rate). Rows without: a queue a limit held back
-- (`held`: a concurrency limit; `wait_seconds`: when a rate allows the next start).
CREATE FUNCTION {schema}.claim_limited_batch(
    queues text[], want integer, lookahead double precision DEFAULT 0.5
) RETURNS TABLE (id bigint, start_at timestamptz, queue text, wait_seconds double precision,
                 held boolean)
LANGUAGE plpgsql AS $$
DECLARE
    q    text;
    rest integer := want;
    r    record;
BEGIN
    IF want <= 0 OR cardinality(queues) = 0 THEN
        RETURN;
    END IF;
    FOR q IN SELECT l.queue FROM {schema}.queue_limits AS l
              WHERE l.queue = ANY(queues)
                AND NOT EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = l.queue)
              ORDER BY l.queue
    LOOP
        EXIT WHEN rest <= 0;
        SELECT * INTO r FROM {schema}.claim_limited_rows(q, rest, lookahead);
        RETURN QUERY SELECT x.id, x.s, q, NULL::double precision, NULL::boolean
                       FROM unnest(r.ids, r.start_at) AS x(id, s);
        rest := rest - cardinality(r.ids);
        IF r.held OR r.wait_seconds IS NOT NULL THEN
            RETURN QUERY SELECT NULL::bigint, NULL::timestamptz, q, r.wait_seconds, r.held;
        END IF;
    END LOOP;
END;
$$;

-- Running rows under a limit hold their permit until they leave in_progress: the store's
-- acknowledgements free it in the same statement (see store/acks.sql), and a permit whose holder
-- no longer runs is taken back by the next claim that needs it.
