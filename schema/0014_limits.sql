-- 0014: flow control. Fleet-wide concurrency limits and rate limits, per queue and per key,
-- enforced inside the claim (claim_limited below), so that claims made at the same instant by
-- any number of workers cannot together exceed a limit.
--
-- Only queues with a row in queue_limits take this path; the claim of every other queue is the
-- statement of queries/tasks.sql, which never reads these tables.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

-- The key a per-key limit counts by: set by the producer (Python derives it from the payload
-- with the task's `limit_key` declaration; SQL producers write the column). NULL: no key (the
-- queue's limits still apply).
ALTER TABLE {schema}.tasks ADD COLUMN limit_key text;
-- NOT VALID: the column is new (NULL in every row), so there is nothing to check, and a table of
-- millions of rows is not read while locked.
ALTER TABLE {schema}.tasks
    ADD CONSTRAINT tasks_limit_key_length CHECK (char_length(limit_key) <= 255) NOT VALID;
-- Set by claim_limited on the rows it claims: only those count against a concurrency limit
-- while they run, so the unlimited claim (which never sets it) adds nothing to the index below.
ALTER TABLE {schema}.tasks ADD COLUMN limit_held boolean;

-- One row per limited queue. NULL: no such limit. concurrency: at most this many running in the
-- queue; key_concurrency: at most this many running per key; rate per rate_seconds: at most
-- that many starts in any window of that length, in the queue; key_rate per key_rate_seconds:
-- the same per key. `source`: 'code' (declared by a worker's code, which its next start may
-- update) or 'operator' (set by `worker limits set` or set_queue_limit(); code leaves it alone).
CREATE TABLE {schema}.queue_limits (
    queue            text PRIMARY KEY,
    concurrency      integer,
    key_concurrency  integer,
    rate             integer,
    rate_seconds     double precision,
    key_rate         integer,
    key_rate_seconds double precision,
    source           text NOT NULL DEFAULT 'operator',
    updated_by       text NOT NULL DEFAULT current_user,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queue_limits_queue CHECK (queue <> '' AND char_length(queue) <= 255),
    CONSTRAINT queue_limits_source CHECK (source IN ('code', 'operator')),
    CONSTRAINT queue_limits_concurrency CHECK (concurrency >= 0 AND key_concurrency >= 0),
    CONSTRAINT queue_limits_rate CHECK (
        (rate IS NULL) = (rate_seconds IS NULL) AND rate >= 0
        AND rate_seconds > 0 AND rate_seconds <= 31622400),
    CONSTRAINT queue_limits_key_rate CHECK (
        (key_rate IS NULL) = (key_rate_seconds IS NULL) AND key_rate >= 0
        AND key_rate_seconds > 0 AND key_rate_seconds <= 31622400),
    CONSTRAINT queue_limits_some CHECK (num_nonnulls(concurrency, key_concurrency, rate,
                                                      key_rate) > 0)
);

-- The starts of rate-limited queues, by the database clock: a rate-limited claim counts the
-- starts inside the window that ends at its own start. One row per claim and key: the `n` rows
-- that claim started at `started_at`. Rows older than the longest window are deleted by the
-- claims themselves.
CREATE TABLE {schema}.limit_starts (
    queue      text NOT NULL,
    limit_key  text,
    started_at timestamptz NOT NULL,
    n          integer NOT NULL DEFAULT 1
);
CREATE INDEX limit_starts_queue_idx ON {schema}.limit_starts (queue, started_at);
CREATE INDEX limit_starts_key_idx ON {schema}.limit_starts (queue, limit_key, started_at)
    WHERE limit_key IS NOT NULL;

-- Operators (and the CLI, which calls it): set or change a queue's limits. Effective for the
-- next claim of that queue; a worker notices a queue that became (or stopped being) limited
-- within a second.
CREATE FUNCTION {schema}.set_queue_limit(
    queue text,
    concurrency integer DEFAULT NULL,
    key_concurrency integer DEFAULT NULL,
    rate integer DEFAULT NULL,
    rate_seconds double precision DEFAULT NULL,
    key_rate integer DEFAULT NULL,
    key_rate_seconds double precision DEFAULT NULL,
    source text DEFAULT 'operator',
    updated_by text DEFAULT current_user
) RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
BEGIN
    IF queue IS NULL OR queue = '' OR char_length(queue) > 255 THEN
        RAISE EXCEPTION 'a queue name is 1 to 255 characters' USING ERRCODE = '22023';
    END IF;
    IF num_nonnulls(concurrency, key_concurrency, rate, key_rate) = 0 THEN
        RAISE EXCEPTION 'give at least one limit (use clear_queue_limit to remove them)'
            USING ERRCODE = '22023';
    END IF;
    IF rate IS NOT NULL AND rate_seconds IS NULL THEN
        rate_seconds := 1;
    END IF;
    IF key_rate IS NOT NULL AND key_rate_seconds IS NULL THEN
        key_rate_seconds := 1;
    END IF;
    INSERT INTO {schema}.queue_limits AS l
        (queue, concurrency, key_concurrency, rate, rate_seconds, key_rate, key_rate_seconds,
         source, updated_by)
    VALUES (queue, concurrency, key_concurrency, rate,
            CASE WHEN rate IS NOT NULL THEN rate_seconds END, key_rate,
            CASE WHEN key_rate IS NOT NULL THEN key_rate_seconds END, source,
            left(coalesce(updated_by, ''), 200))
    ON CONFLICT ON CONSTRAINT queue_limits_pkey DO UPDATE
       SET concurrency = excluded.concurrency, key_concurrency = excluded.key_concurrency,
           rate = excluded.rate, rate_seconds = excluded.rate_seconds,
           key_rate = excluded.key_rate, key_rate_seconds = excluded.key_rate_seconds,
           source = excluded.source, updated_by = excluded.updated_by, updated_at = now()
     -- Code never overrides an operator's setting (see the table).
     WHERE excluded.source = 'operator' OR l.source = 'code';
    RETURN FOUND;
END;
$$;

CREATE FUNCTION {schema}.clear_queue_limit(queue text) RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
BEGIN
    DELETE FROM {schema}.queue_limits AS l WHERE l.queue = clear_queue_limit.queue;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    DELETE FROM {schema}.limit_starts AS s WHERE s.queue = clear_queue_limit.queue;
    RETURN true;
END;
$$;

-- The claim of one limited queue. Claims of a queue are serialised on its queue_limits row
-- (locked until the claiming transaction commits), and every count below is read after that
-- lock is held: each statement of a PL/pgSQL function under READ COMMITTED takes a new
-- snapshot, so it sees every claim committed before ours. Two claims can therefore never both
-- take the last slot or the last start of a window. Acknowledgements and rescue do not take the
-- lock: they only free slots, which a claim may see one commit late (it then claims less).
--
-- The rows returned are those of the claim statement (queries/tasks.sql), plus `wait_seconds`:
-- one extra row with a NULL id when a rate limit held work back, saying when the next start is
-- allowed.
CREATE FUNCTION {schema}.claim_limited(
    claim_queue text,
    claim_worker uuid,
    want integer,
    lease_seconds double precision,
    handler_tasks text[],
    handler_max_attempts integer[]
) RETURNS TABLE (
    id bigint, task text, payload text, attempts integer, max_attempts integer, queue text,
    priority integer, run_at timestamptz, created_at timestamptz, claimed_at timestamptz,
    xid text, wait_seconds double precision
)
LANGUAGE plpgsql
-- The statements below are planned once per session: planning them on each call (with the
-- parameters' values) took longer than running them.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_variable
DECLARE
    q       text := claim_queue;
    lim     {schema}.queue_limits;
    t0      timestamptz;
    room    integer := want;
    used    integer;
    oldest  timestamptz;
    wait    double precision;
    keyed   boolean;
    chosen  bigint[];
    -- How far into a queue with per-key limits a claim looks for rows without a key.
    keyless_window constant integer := 256;
BEGIN
    -- Serialise with the other claims of this queue (workers take their queues' locks in name
    -- order: no deadlock). No row: the queue is no longer limited; nothing from it this time.
    SELECT * INTO lim FROM {schema}.queue_limits AS l WHERE l.queue = q FOR UPDATE;
    IF NOT FOUND OR want <= 0 THEN
        RETURN;
    END IF;
    -- The database clock after the lock: later than every start recorded before ours.
    t0 := clock_timestamp();

    IF lim.concurrency IS NOT NULL THEN
        -- A row whose lease ran out does not count: its worker is gone (rescue puts it back).
        SELECT count(*) INTO used FROM {schema}.tasks AS t
         WHERE t.queue = q AND t.state = 'in_progress' AND t.limit_held
           AND t.lease_expires_at >= t0;
        room := least(room, lim.concurrency - used);
    END IF;
    IF lim.rate IS NOT NULL THEN
        DELETE FROM {schema}.limit_starts AS s
         WHERE s.queue = q
           AND s.started_at <= t0 - make_interval(
               secs => greatest(lim.rate_seconds, coalesce(lim.key_rate_seconds, 0)));
        SELECT coalesce(sum(s.n), 0), min(s.started_at) INTO used, oldest
          FROM {schema}.limit_starts AS s
         WHERE s.queue = q AND s.started_at > t0 - make_interval(secs => lim.rate_seconds);
        IF used >= lim.rate THEN
            -- The next start is allowed when the oldest starts in the window leave it.
            wait := extract(epoch FROM oldest + make_interval(secs => lim.rate_seconds) - t0);
        END IF;
        room := least(room, lim.rate - used);
    ELSIF lim.key_rate IS NOT NULL THEN
        DELETE FROM {schema}.limit_starts AS s
         WHERE s.queue = q AND s.started_at <= t0 - make_interval(secs => lim.key_rate_seconds);
    END IF;
    IF room <= 0 THEN
        IF wait IS NOT NULL THEN
            RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::integer,
                NULL::integer, q, NULL::integer, NULL::timestamptz, NULL::timestamptz,
                NULL::timestamptz, NULL::text, greatest(wait, 0.001);
        END IF;
        RETURN;
    END IF;

    keyed := lim.key_concurrency IS NOT NULL OR lim.key_rate IS NOT NULL;
    IF NOT keyed THEN
        -- The queue's limits only: its first rows in claim order.
        chosen := ARRAY(
            SELECT t.id FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= now()
             ORDER BY (-t.priority), t.run_at, t.id
             LIMIT room
               FOR UPDATE SKIP LOCKED);
    ELSE
        -- Per key: the room each key has left (concurrency and rate), then the first rows of
        -- each key with room, read from tasks_limit_key_idx (one probe per key with queued rows,
        -- found by a skip scan), merged in claim order with the rows that have no key.
        chosen := ARRAY(
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
            ), running AS (
                SELECT t.limit_key AS k, count(*)::integer AS n FROM {schema}.tasks AS t
                 WHERE t.queue = q AND t.state = 'in_progress' AND t.limit_held
                   AND t.limit_key IS NOT NULL AND t.lease_expires_at >= t0
                   AND lim.key_concurrency IS NOT NULL
                 GROUP BY t.limit_key
            ), started AS (
                SELECT s.limit_key AS k, sum(s.n)::integer AS n FROM {schema}.limit_starts AS s
                 WHERE s.queue = q AND s.limit_key IS NOT NULL
                   AND s.started_at > t0 - make_interval(secs => lim.key_rate_seconds)
                   AND lim.key_rate IS NOT NULL
                 GROUP BY s.limit_key
            ), roomy AS (
                SELECT keys.k,
                       least(room,
                             coalesce(lim.key_concurrency - r.n, lim.key_concurrency, room),
                             coalesce(lim.key_rate - s.n, lim.key_rate, room)) AS n
                  FROM keys
                  LEFT JOIN running AS r ON r.k = keys.k
                  LEFT JOIN started AS s ON s.k = keys.k
                 WHERE keys.k IS NOT NULL
            ), candidates AS (
                SELECT c.id, c.neg_priority, c.run_at
                  FROM roomy
                 CROSS JOIN LATERAL (
                    -- (LIMIT cannot name roomy.n: number the rows instead.)
                    SELECT f.*, row_number() OVER () AS nth FROM (
                        SELECT t.id, -t.priority AS neg_priority, t.run_at
                          FROM {schema}.tasks AS t
                         WHERE t.queue = q AND t.state = 'queued' AND t.limit_key = roomy.k
                           AND t.run_at <= now()
                         ORDER BY (-t.priority), t.run_at, t.id
                         LIMIT room) AS f) AS c
                 WHERE roomy.n > 0 AND c.nth <= roomy.n
                UNION ALL
                -- Rows without a key: among the first rows of the queue in claim order only
                -- (keyless_window), so that a keyed backlog is never walked in full.
                SELECT u.id, u.neg_priority, u.run_at FROM (
                    SELECT t.id, -t.priority AS neg_priority, t.run_at, t.limit_key
                      FROM {schema}.tasks AS t
                     WHERE t.state = 'queued' AND t.queue = q AND t.run_at <= now()
                     ORDER BY (-t.priority), t.run_at, t.id
                     LIMIT keyless_window) AS u
                 WHERE u.limit_key IS NULL
            )
            SELECT c.id FROM candidates AS c ORDER BY c.neg_priority, c.run_at, c.id LIMIT room);
        -- Lock what was chosen (others' claims of this queue wait on our lock; what is locked
        -- here was taken by an operator's action, and is left out).
        chosen := ARRAY(
            SELECT t.id FROM {schema}.tasks AS t
             WHERE t.id = ANY(chosen) AND t.state = 'queued'
               FOR UPDATE SKIP LOCKED);
        IF lim.key_rate IS NOT NULL AND cardinality(chosen) < room THEN
            -- Keys held back by their rate: when the first of them may start again.
            SELECT extract(epoch FROM min(s.started_at)
                           + make_interval(secs => lim.key_rate_seconds) - t0)
              INTO wait
              FROM {schema}.limit_starts AS s
             WHERE s.queue = q AND s.limit_key IS NOT NULL
               AND s.started_at > t0 - make_interval(secs => lim.key_rate_seconds);
        END IF;
    END IF;

    IF lim.rate IS NOT NULL OR lim.key_rate IS NOT NULL THEN
        INSERT INTO {schema}.limit_starts (queue, limit_key, started_at, n)
        SELECT q, t.limit_key, t0, count(*) FROM {schema}.tasks AS t WHERE t.id = ANY(chosen)
         GROUP BY t.limit_key;
    END IF;

    RETURN QUERY
    UPDATE {schema}.tasks AS t
       SET state = 'in_progress',
           attempts = t.attempts + 1,
           max_attempts = coalesce(
               t.max_attempts,
               (SELECT h.max_attempts
                  FROM unnest(handler_tasks, handler_max_attempts) AS h(task, max_attempts)
                 WHERE h.task = t.task)),
           worker_id = claim_worker,
           started_at = t0,
           limit_held = true,
           lease_expires_at = now() + make_interval(secs => lease_seconds)
     WHERE t.id = ANY(chosen)
    RETURNING t.id, t.task, t.payload::text, t.attempts, t.max_attempts, t.queue,
              t.priority,
              CASE WHEN isfinite(t.run_at) THEN t.run_at ELSE '0001-01-01 00:00:00+00' END,
              CASE WHEN isfinite(t.created_at) THEN t.created_at ELSE now() END,
              now(), pg_current_xact_id()::text, NULL::double precision;
    IF wait IS NOT NULL THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::integer, NULL::integer,
            q, NULL::integer, NULL::timestamptz, NULL::timestamptz, NULL::timestamptz,
            NULL::text, greatest(wait, 0.001);
    END IF;
END;
$$;

-- enqueue (schema/0006, 0013) with a key for per-key limits. The key is written in the same
-- transaction as the row, so no claim ever sees the row without it. A row that dedupe_key
-- matched keeps its own key. SQL producers may also write tasks.limit_key in a plain INSERT.
CREATE FUNCTION {schema}.enqueue_keyed(
    task         text,
    payload      jsonb       DEFAULT '{}',
    queue        text        DEFAULT NULL,
    run_at       timestamptz DEFAULT now(),
    priority     integer     DEFAULT 0,
    max_attempts integer     DEFAULT NULL,
    dedupe_key   text        DEFAULT NULL,
    limit_key    text        DEFAULT NULL,
    trace_context jsonb      DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql AS $$
#variable_conflict use_variable
DECLARE
    new_id bigint;
BEGIN
    new_id := {schema}.enqueue(task => task, payload => payload, queue => queue,
                               run_at => run_at, priority => priority,
                               max_attempts => max_attempts, dedupe_key => dedupe_key,
                               trace_context => trace_context);
    IF limit_key IS NOT NULL THEN
        UPDATE {schema}.tasks AS t SET limit_key = enqueue_keyed.limit_key
         WHERE t.id = new_id AND t.limit_key IS NULL AND t.state IN ('queued', 'scheduled')
           AND t.attempts = 0;
    END IF;
    RETURN new_id;
END;
$$;

-- worker:online
-- Built after the transaction above commits, without stopping the workers' reads and writes
-- of the table (see worker.db.migrate).

-- Running rows claimed under a limit, per queue and key: what a limited claim counts.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_limit_running_idx ON {schema}.tasks (queue, limit_key)
    WHERE state = 'in_progress' AND limit_held;

-- Queued rows with a key, per key in claim order: a claim of a queue with per-key limits reads
-- the first rows of each key that has room, so a key at its limit with a deep backlog costs the
-- others one index probe, not a walk over its backlog (no head-of-line blocking). Rows without a
-- key never enter it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_limit_key_idx ON {schema}.tasks (queue, limit_key, (-priority), run_at, id)
    WHERE state = 'queued' AND limit_key IS NOT NULL;
