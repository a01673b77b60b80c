-- The claim path: promotion of due rows, the claim, and the probes that say which queues hold work.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: promote
-- Scheduled rows that are due become claimable. Any worker runs this (no leader): SKIP LOCKED keeps
-- concurrent promoters on different rows. It runs in the claiming transaction, just before the
-- claim, which therefore sees the rows it promoted. It says how many it promoted, in which queues
-- (to wake the workers of other queues, with the earliest run_at as the insert trigger gives it:
-- schema/0015), and how long until the next scheduled row is due.
WITH due AS (
    SELECT id
      FROM {schema}.tasks
     WHERE state = 'scheduled'
       AND run_at <= now()
     ORDER BY run_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE {schema}.tasks AS t
       SET state = 'queued'
     WHERE t.id = ANY(ARRAY(SELECT id FROM due))
    RETURNING t.queue, t.run_at
), names AS (
    SELECT coalesce(string_agg(queue, ','), '') AS list, sum(n)::integer AS n,
           array_agg(queue) AS queues,
           coalesce(bool_or(strpos(queue, ',') > 0 OR strpos(queue, chr(30)) > 0), false) AS odd,
           CASE WHEN isfinite(min(earliest))
                THEN (extract(epoch FROM min(earliest)) * 1000000)::bigint END AS earliest
      FROM (SELECT queue, count(*) AS n, min(run_at) AS earliest FROM moved
             GROUP BY queue LIMIT 50) AS g
)
SELECT coalesce(names.n, 0) AS promoted,
       CASE WHEN names.n > 0
            THEN pg_notify(%(channel)s, CASE WHEN names.odd OR names.earliest IS NULL
                                                  OR octet_length(names.list) > 7000
                                             THEN ''
                                             ELSE names.list || ',' || chr(30)
                                                  || names.earliest::text END)::text END
           AS notified,
       extract(epoch FROM (SELECT min(run_at) FROM {schema}.tasks
                            WHERE state = 'scheduled' AND run_at > now()) - now())::float8
           AS next_due_in,
       names.queues, names.earliest
  FROM names;

-- name: make_due
-- worker.testing only (no worker runs it): a test that asks to run tasks "as of" a later time
-- makes the scheduled rows due by then (%(until)s) queued, as promote would once that time came.
-- Their run_at becomes now(), since the claim takes only rows with run_at <= now().
UPDATE {schema}.tasks
   SET state = 'queued', run_at = now()
 WHERE state = 'scheduled' AND run_at <= %(until)s
RETURNING id;

-- name: claim
-- One claim for every queue a worker serves: take up to `limit` rows of the given queues, in that
-- order of queues, and make them ours in one statement, whatever the number of queues. Every
-- rule a claim obeys is a predicate here, in one place:
--   * a paused queue (schema/0009) gives nothing, from the moment the pause commits (one probe
--     of a small table per queue, in this statement's snapshot), fleet-wide;
--   * a queue with limits (schema/0014, 0017) is taken by claim_limited_batch: within its
--     concurrency permits and the pace of its rate limits, per queue and per key, each row with
--     the moment it may start (the pace of one queue may have been taken ahead: pace_ahead);
--   * every other queue by priority, then run_at, then id, from this worker's cursor;
--   * rows someone asked to cancel never reach this claim (they end cancelled, see cancel_tasks).
-- SKIP LOCKED everywhere: concurrent workers take different rows and permits without waiting on
-- each other, and a worker frozen in its transaction holds only what it took. The lease is set
-- by the database clock, so clock skew between machines does not matter.
--
-- Only due rows are in the claim index (delayed ones wait as 'scheduled'), so a claim reads the
-- first entries of each queue and stops. Dead entries are the other thing a scan can walk: rows
-- claimed since the last vacuum leave them at the front of the queue's range, and they pile up
-- while a long transaction elsewhere holds vacuum back. So each unlimited queue is read from a
-- little before where this worker's last claim stopped: the floor (floor_run_at, floor_id,
-- within the priority cursor_priority) trails the last claimed row by a short look-back (see
-- ClaimCursor) for rows that committed late. Three ranges together are the whole queue in claim
-- order:
--   1. higher priorities than the cursor's, from their start;
--   2. the cursor's priority, from the floor;
--   3. lower priorities, from their start.
-- A row that commits further behind than the floor is announced with its run_at, or found by
-- `behind` (run by the maintenance thread): the worker's floor then moves back to that run_at.
--
-- Rows come back with `start_in` (a rate limit's pace: seconds until the handler may start;
-- NULL: no pace) and `slack` (how late it may start), and `limited`; a queue a limit held back comes back as a row without an id, with
-- `wait_seconds` (when a rate allows the next start) or `held` (a concurrency limit is full).
WITH asked AS (
    SELECT q.name, q.neg_priority, q.run_at, q.id,
           EXISTS (SELECT 1 FROM {schema}.queue_limits AS l WHERE l.queue = q.name) AS limited
      FROM unnest(%(queues)s::text[], %(cursor_priority)s::integer[],
                  %(floor_run_at)s::timestamptz[], %(floor_id)s::bigint[])
           AS q(name, neg_priority, run_at, id)
     WHERE NOT EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = q.name)
), picked AS (
    SELECT c.id
      FROM asked AS q
     CROSS JOIN LATERAL (
        SELECT id FROM (
            SELECT id FROM {schema}.tasks
             WHERE state = 'queued' AND queue = q.name AND (-priority) < q.neg_priority
               AND run_at <= now()
             ORDER BY (-priority), run_at, id
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS higher
        UNION ALL
        SELECT id FROM (
            SELECT id FROM {schema}.tasks
             WHERE state = 'queued' AND queue = q.name AND (-priority) = q.neg_priority
               AND (run_at, id) >= (q.run_at, q.id)
               AND run_at <= now()
             ORDER BY (-priority), run_at, id
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS current
        UNION ALL
        SELECT id FROM (
            SELECT id FROM {schema}.tasks
             WHERE state = 'queued' AND queue = q.name AND (-priority) > q.neg_priority
               AND run_at <= now()
             ORDER BY (-priority), run_at, id
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS lower
        LIMIT %(limit)s
     ) AS c
     WHERE NOT q.limited
     LIMIT %(limit)s
), limited AS (
    SELECT * FROM {schema}.claim_limited_batch(
        ARRAY(SELECT name FROM asked WHERE limited),
        %(limit)s - (SELECT count(*) FROM picked)::integer, %(lookahead)s,
        %(pace_queue)s, %(pace_t0)s, %(pace_m)s, %(pace_gap)s, %(pace_burst)s, %(pace_n)s,
        %(pace_wait)s, %(pace_end)s)
), taken AS (
    -- Every row this claim takes, with what a limit says of it: the moment it may start (a
    -- rate's pace), whether a limit took it, and whether it holds a place under a concurrency
    -- limit (limit_held, which the limit counts; a queue limited by a rate alone pays no index
    -- entry per row for it). A join, not a look-up per row in arrays of the batch (that
    -- compared each row with every other: a limited claim of 100 rows paid half a millisecond).
    SELECT p.id, NULL::timestamptz AS start_at, false AS limited, NULL::boolean AS held
      FROM picked AS p
    UNION ALL
    SELECT l.id, l.start_at, true, l.held FROM limited AS l WHERE l.id IS NOT NULL
), moved AS (
    UPDATE {schema}.tasks AS t
       SET state = 'in_progress',
           attempts = t.attempts + 1,
           -- NULL: the producer left it to the handler (schema/0003); this worker's handlers
           -- say. A task this worker has no handler for keeps NULL: it is handed back
           -- (hand_back) and its own handler decides later.
           max_attempts = coalesce(
               t.max_attempts,
               (SELECT h.max_attempts
                  FROM unnest(%(handler_tasks)s::text[], %(handler_max_attempts)s::integer[])
                       AS h(task, max_attempts)
                 WHERE h.task = t.task)),
           worker_id = %(worker_id)s,
           -- A rate limit's pace: the moment the row may start, when later than now.
           started_at = coalesce(x.start_at, now()),
           limit_held = x.held,
           lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
      FROM taken AS x
    -- = ANY(ARRAY(...)) makes the planner fetch the taken rows by primary key; a join alone
    -- may be planned as a hash join over a scan of the whole table.
     WHERE t.id = ANY(ARRAY(SELECT id FROM taken)) AND t.id = x.id
    -- The payload comes back as text: the worker decodes it per task, outside this transaction,
    -- so a payload the driver cannot decode (nested thousands deep, a number of thousands of
    -- digits) fails its own task instead of this claim. Times the driver cannot represent (rows
    -- from before migration 0004 refused them) come back as the nearest it can.
    RETURNING t.id, t.task, t.payload::text AS payload, t.attempts, t.max_attempts, t.queue,
              t.priority,
              CASE WHEN isfinite(t.run_at) THEN t.run_at
                   ELSE '0001-01-01 00:00:00+00' END AS run_at,
              CASE WHEN isfinite(t.created_at) THEN t.created_at ELSE now() END AS created_at,
              now() AS claimed_at,
              -- For the metrics journal: saves it a round trip per batch.
              pg_current_xact_id()::text AS xid,
              -- The producer's trace context (schema/0013): NULL unless a traced producer wrote
              -- it, as text for the same reason as the payload.
              t.trace_context::text AS trace_context,
              -- A paced start in seconds from now by the database clock (the worker counts
              -- them from when it reads this row, by its own clock), and how late it may start:
              -- 2% of the shortest period of the queue's rates (the pace leaves 5%: the rest is
              -- for the delays between this statement and the handler's call the worker cannot
              -- measure, such as this row's way back and a busy machine's scheduling; starts
              -- taken ahead of the claim begin late by the claim's own time, which brings more
              -- of them near that bound: at 3% a window by the handlers' clock once held 41
              -- starts under rate 40/s on a machine with a load average of 6).
              CASE WHEN x.start_at IS NOT NULL
                   THEN extract(epoch FROM t.started_at - clock_timestamp())::float8
              END AS start_in,
              x.limited,
              -- Workflows (schema/0022): whether others wait for this step (its acknowledgement
              -- then settles them), the results of the steps it waited for, and its workflow.
              t.dependents IS TRUE AS dependents, t.inputs::text AS inputs, t.workflow_id
)
SELECT m.id, m.task, m.payload, m.attempts, m.max_attempts, m.queue, m.priority, m.run_at,
       m.created_at, m.claimed_at, m.xid, m.trace_context, m.start_in,
       CASE WHEN m.start_in IS NOT NULL
            THEN (SELECT 0.02 * least(ql.rate_seconds, ql.key_rate_seconds)
                    FROM {schema}.queue_limits AS ql WHERE ql.queue = m.queue) END AS slack,
       m.limited, NULL::double precision AS wait_seconds,
       NULL::boolean AS held, m.dependents, m.inputs, m.workflow_id
  FROM moved AS m
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, l.queue, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       true, l.wait_seconds, l.held, NULL, NULL, NULL
  FROM limited AS l
 WHERE l.id IS NULL;

-- name: pace_ahead
-- The starts of the next claim of one rate-limited queue, taken in a transaction of their own
-- before the claim's (schema/0024), so that no claim holds the queue's pace until it commits.
SELECT t0, m, gap_seconds, burst, n, wait_seconds, tat_end
  FROM {schema}.pace_ahead(%(queue)s, %(want)s, %(lookahead)s);

-- name: due_queues
-- Of the given queues, those with a row ready to claim: one index probe each, no lock. The
-- maintenance thread of a worker serving many queues asks this once a second, instead of the
-- claim reading every queue (see Batcher). Paused queues are left out, as in the claim.
SELECT q.name
  FROM unnest(%(queues)s::text[]) AS q(name)
 WHERE NOT EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = q.name)
   AND EXISTS (
    SELECT 1 FROM {schema}.tasks
     WHERE state = 'queued' AND queue = q.name AND run_at <= now());

-- name: behind
-- The queues (of those given) with a claimable row that committed further behind this worker's
-- cursor than the claim's look-back window (a producer transaction that ran long, or a run_at set
-- in the past), each with the earliest such row's run_at in microseconds since the epoch (NULL
-- for a run_at of -infinity, which has no number: the worker then reads the queue from its
-- start). The worker's next claim of the queue reads from there. Read by the maintenance thread,
-- off the claim path, since this walks the dead entries the claim avoids.
SELECT q.name,
       CASE WHEN isfinite(b.run_at) THEN (extract(epoch FROM b.run_at) * 1000000)::bigint END
  FROM unnest(%(queues)s::text[], %(cursor_priority)s::integer[],
              %(floor_run_at)s::timestamptz[], %(floor_id)s::bigint[])
       AS q(name, neg_priority, run_at, id)
 CROSS JOIN LATERAL (
    SELECT t.run_at FROM {schema}.tasks AS t
     WHERE t.state = 'queued' AND t.queue = q.name AND (-t.priority) = q.neg_priority
       AND (t.run_at, t.id) < (q.run_at, q.id)
     ORDER BY (-t.priority), t.run_at, t.id
     LIMIT 1) AS b;

-- name: wake_handed_back
-- A worker that has handlers for %(tasks)s started: the rows of those tasks that workers without
-- the handler handed back are due at once, now that a worker that has it is here.
UPDATE {schema}.tasks
   SET run_at = now()
 WHERE state = 'scheduled'
   AND handed_back > 0
   AND left(task, 255) = ANY(ARRAY(SELECT left(n, 255) FROM unnest(%(tasks)s::text[]) AS n))
   AND task = ANY(%(tasks)s::text[])
   AND run_at > now();
