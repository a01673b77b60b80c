-- Every statement that changes a task row, in the order a task travels:
-- enqueue -> claim -> complete | retry | release -> (heartbeat while running) -> rescue -> purge.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: enqueue
-- One task through the SQL function, so Python and SQL producers share the dedupe logic.
-- A delay counts from the database's clock (now()), never the producer's.
SELECT {schema}.enqueue(
    task => %(task)s, payload => %(payload)s, queue => %(queue)s,
    run_at => coalesce(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
    priority => %(priority)s, max_attempts => %(max_attempts)s, dedupe_key => %(dedupe_key)s,
    trace_context => %(trace_context)s
) AS id;

-- name: enqueue_keyed
-- The same, for a task with a key for per-key limits (schema/0014): written with the row.
SELECT {schema}.enqueue_keyed(
    task => %(task)s, payload => %(payload)s, queue => %(queue)s,
    run_at => coalesce(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
    priority => %(priority)s, max_attempts => %(max_attempts)s, dedupe_key => %(dedupe_key)s,
    trace_context => %(trace_context)s, limit_key => %(limit_key)s
) AS id;

-- name: enqueue_copy
-- Bulk enqueue: COPY skips per-row parsing and planning; the statement trigger sends one NOTIFY.
-- run_at is left to its default, the database's now(). A NULL queue is routed (schema/0006).
COPY {schema}.tasks (task, payload, queue, priority, max_attempts) FROM STDIN;

-- name: enqueue_copy_at
-- The same, for rows that run at a given time (a delay was added to delayed_until first).
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, run_at) FROM STDIN;

-- name: enqueue_copy_traced
-- enqueue_copy with the producer's trace context (schema/0013), when tracing is on.
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, trace_context) FROM STDIN;

-- name: enqueue_copy_at_traced
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, run_at, trace_context)
FROM STDIN;

-- name: enqueue_copy_keyed
-- Bulk enqueue of a task that declares a key for per-key limits (schema/0014); the trace context
-- (schema/0013) is NULL when tracing is off.
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, trace_context, limit_key)
FROM STDIN;

-- name: enqueue_copy_at_keyed
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, run_at, trace_context,
                     limit_key)
FROM STDIN;

-- name: delayed_until
-- A delay counts from the database's clock, not the producer's.
SELECT now() + make_interval(secs => %(delay)s) AS run_at;

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
-- Take up to `limit` rows of the given queues, in that order of queues, and make them ours in one
-- statement, whatever the number of queues. SKIP LOCKED lets concurrent workers take different
-- rows without waiting on each other. The lease is set by the database clock, so clock skew
-- between machines does not matter.
--
-- Only due rows are in the claim index (delayed ones wait as 'scheduled'), so a claim reads the
-- first entries of each queue and stops. Dead entries are the other thing a scan can walk: rows
-- claimed since the last vacuum leave them at the front of the queue's range, and they pile up
-- while a long transaction elsewhere holds vacuum back. So each queue is read from a little
-- before where this worker's last claim stopped: the floor (floor_run_at, floor_id, within the
-- priority cursor_priority) trails the last claimed row by a short look-back (see ClaimCursor)
-- for rows that committed late. Three ranges together are the whole queue in claim order:
--   1. higher priorities than the cursor's, from their start;
--   2. the cursor's priority, from the floor;
--   3. lower priorities, from their start.
-- A row that commits further behind than the floor is found by `behind` (run by the
-- maintenance thread), which sends this worker back to the start of that queue.
WITH picked AS (
    SELECT c.id
      FROM unnest(%(queues)s::text[], %(cursor_priority)s::integer[],
                  %(floor_run_at)s::timestamptz[], %(floor_id)s::bigint[])
           AS q(name, neg_priority, run_at, id)
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
     -- A paused queue (schema/0009) gives nothing: one probe of a small table per queue, read in
     -- this statement's snapshot, so a pause holds from the moment it commits, fleet-wide.
     WHERE NOT EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = q.name)
     LIMIT %(limit)s
)
UPDATE {schema}.tasks AS t
   SET state = 'in_progress',
       attempts = t.attempts + 1,
       -- NULL: the producer left it to the handler (schema/0003); this worker's handlers say.
       -- A task this worker has no handler for keeps NULL: it is handed back (hand_back) and
       -- its own handler decides later.
       max_attempts = coalesce(
           t.max_attempts,
           (SELECT h.max_attempts
              FROM unnest(%(handler_tasks)s::text[], %(handler_max_attempts)s::integer[])
                   AS h(task, max_attempts)
             WHERE h.task = t.task)),
       worker_id = %(worker_id)s,
       started_at = now(),
       lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
-- = ANY(ARRAY(...)) makes the planner fetch the picked rows by primary key; a join against the
-- CTE may be planned as a hash join over a scan of the whole table.
 WHERE t.id = ANY(ARRAY(SELECT id FROM picked))
-- The payload comes back as text: the worker decodes it per task, outside this transaction, so a
-- payload the driver cannot decode (nested thousands deep, a number of thousands of digits) fails
-- its own task instead of this claim. Times the driver cannot represent (rows from before
-- migration 0004 refused them) come back as the nearest it can.
RETURNING t.id, t.task, t.payload::text AS payload, t.attempts, t.max_attempts, t.queue,
          t.priority,
          CASE WHEN isfinite(t.run_at) THEN t.run_at ELSE '0001-01-01 00:00:00+00' END AS run_at,
          CASE WHEN isfinite(t.created_at) THEN t.created_at ELSE now() END AS created_at,
          now() AS claimed_at,
          -- For the metrics journal (worker/_journal.py): saves it a round trip per batch.
          pg_current_xact_id()::text AS xid,
          -- The producer's trace context (schema/0013): NULL unless a traced producer wrote it,
          -- as text for the same reason as the payload.
          t.trace_context::text AS trace_context;

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
-- cursor than the claim's look-back window: a producer transaction that ran long, or a run_at set
-- in the past. Read by the maintenance thread, off the claim path, since this walks the dead
-- entries the claim avoids.
SELECT q.name
  FROM unnest(%(queues)s::text[], %(cursor_priority)s::integer[],
              %(floor_run_at)s::timestamptz[], %(floor_id)s::bigint[])
       AS q(name, neg_priority, run_at, id)
 WHERE EXISTS (
    SELECT 1 FROM {schema}.tasks
     WHERE state = 'queued' AND queue = q.name AND (-priority) = q.neg_priority
       AND (run_at, id) < (q.run_at, q.id));

-- name: complete
-- Mark finished tasks done in one statement per batch. Fencing: only the owner's current attempt
-- of a row still in progress may complete it; a worker that lost its lease gets nothing back for
-- that row and learns it lost the row. A row someone asked to cancel (schema/0010) ends
-- 'cancelled', not 'done', whatever its handler returned: the request and this statement lock
-- the row in turn, so a request that was granted is never followed by 'done'.
-- "In progress" is spelled "lease_expires_at IS NOT NULL" in the fencing statements (the two are
-- the same by the tasks_lease_iff_running constraint). Written as state = 'in_progress', the
-- planner may scan the whole partial lease index, dead entries and all, instead of fetching the
-- batch by primary key; that made acknowledgements the slowest step of the worker.
-- The batch drives the join: for each (id, attempt) the planner looks the row up by primary key.
-- (An extra `t.id = ANY(ids)` condition made it fetch the rows first and then compare each with
-- every element of the batch, a nested loop of batch x batch: 3 ms instead of 0.8 for 100 rows,
-- and the worker's largest cost in the database beyond the bare-SQL ceiling's.) The worker's
-- connections rule sequential scans out (session_index_plans), so a plan cached while the table
-- was small cannot turn this into a scan of the table.
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'done'::{schema}.task_state
                    ELSE 'cancelled' END,
       finished_at = now(), lease_expires_at = NULL
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
 WHERE t.id = a.id  -- one primary-key look-up per acknowledged row (see complete)
   AND t.attempts = a.attempt
   AND t.worker_id = %(worker_id)s
   AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
RETURNING t.id, t.state::text AS state;

-- name: complete_delete
-- The same fencing as `complete`, for installations that keep no finished rows (retention 0):
-- deleting is cheaper than writing a new row version that retention would delete later. Cron rows
-- and rows with a cancel request are left to `complete` (a cron slot must stay taken; a
-- cancelled task stays visible as cancelled until retention removes it).
DELETE FROM {schema}.tasks AS t
 USING unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
 WHERE t.id = a.id  -- one primary-key look-up per acknowledged row (see complete)
   AND t.attempts = a.attempt
   AND t.worker_id = %(worker_id)s
   AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
   AND t.cron_key IS NULL
   AND t.cancel_requested_at IS NULL
RETURNING t.id;

-- name: retry
-- Failed attempts: back to queued after the backoff delay, or failed when the handler said not to
-- retry or the row has used its attempts (its own max_attempts, which an operator may have raised).
-- Each error is also appended to the row's history (`errors`, schema/0008): the last
-- %(history)s attempts, each error cut to %(history_chars)s characters, stamped with the database
-- clock and the worker. Only this statement and the other three that record an error (hand_back,
-- worker_died, rescue) pay for it; claim and complete do not touch the column.
-- A row someone asked to cancel ends 'cancelled' instead: it is never retried.
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'::{schema}.task_state
                    WHEN a.permanent OR t.attempts >= t.max_attempts THEN 'failed'
                    WHEN a.delay > 0 THEN 'scheduled' ELSE 'queued' END,
       run_at = CASE WHEN t.cancel_requested_at IS NOT NULL OR a.permanent
                          OR t.attempts >= t.max_attempts
                     THEN t.run_at ELSE now() + make_interval(secs => a.delay) END,
       finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL OR a.permanent
                               OR t.attempts >= t.max_attempts THEN now() END,
       last_error = a.error,
       errors = jsonb_path_query_array(
           coalesce(t.errors, '[]') || jsonb_build_object(
               'attempt', t.attempts, 'at', now(), 'error', left(a.error, %(history_chars)s),
               'worker_id', t.worker_id),
           '$[last - $keep + 1 to last]', jsonb_build_object('keep', %(history)s::integer)),
       lease_expires_at = NULL
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(delays)s::float8[],
              %(errors)s::text[], %(permanent)s::boolean[]) AS a(id, attempt, delay, error, permanent)
 WHERE t.id = a.id  -- one primary-key look-up per acknowledged row (see complete)
   AND t.attempts = a.attempt
   AND t.worker_id = %(worker_id)s
   AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
RETURNING t.id, t.state::text AS state;

-- name: hand_back
-- Rows this worker has no handler for (an old worker during a rolling deploy, a typo in a task
-- name): back to 'scheduled' without counting the attempt, later each time (5 s, 10 s, 20 s, ...
-- up to 10 minutes), with an error that says why. A worker that has the handler takes them at
-- once when it starts (workers.sql, register). The error joins the history (see retry) marked
-- "counted": false, under the number of the attempt that was not counted. One with a cancel
-- request ends 'cancelled'.
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'scheduled'::{schema}.task_state
                    ELSE 'cancelled' END,
       attempts = greatest(t.attempts - 1, 0),
       run_at = CASE WHEN t.cancel_requested_at IS NULL
                     THEN now() + make_interval(
                         secs => least(5 * power(2, least(t.handed_back, 10)), 600))
                     ELSE t.run_at END,
       handed_back = t.handed_back + 1, last_error = left(a.error, 4000),
       errors = jsonb_path_query_array(
           coalesce(t.errors, '[]') || jsonb_build_object(
               'attempt', t.attempts, 'at', now(), 'error', left(a.error, %(history_chars)s),
               'worker_id', t.worker_id, 'counted', false),
           '$[last - $keep + 1 to last]', jsonb_build_object('keep', %(history)s::integer)),
       finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL THEN now() END,
       started_at = NULL, lease_expires_at = NULL
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(errors)s::text[])
       AS a(id, attempt, error)
 WHERE t.id = a.id  -- one primary-key look-up per acknowledged row (see complete)
   AND t.attempts = a.attempt
   AND t.worker_id = %(worker_id)s
   AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
RETURNING t.id, t.state::text AS state;

-- name: release
-- Graceful stop: hand back tasks that did not finish within the grace period. The interrupted
-- attempt is not counted, so a deploy does not use up a task's retries. A row with a cancel
-- request is not handed back: it ends 'cancelled' (its attempt counted, as it ran).
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NULL THEN 'queued'::{schema}.task_state
                    ELSE 'cancelled' END,
       attempts = CASE WHEN t.cancel_requested_at IS NULL THEN greatest(t.attempts - 1, 0)
                       ELSE t.attempts END,
       run_at = CASE WHEN t.cancel_requested_at IS NULL THEN now() ELSE t.run_at END,
       started_at = CASE WHEN t.cancel_requested_at IS NULL THEN NULL ELSE t.started_at END,
       finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL THEN now() END,
       lease_expires_at = NULL
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
 WHERE t.id = a.id  -- one primary-key look-up per acknowledged row (see complete)
   AND t.attempts = a.attempt
   AND t.worker_id = %(worker_id)s
   AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
RETURNING t.id;

-- name: heartbeat
-- One statement per heartbeat, whatever the number of tasks in flight: renew the leases of this
-- worker's rows at the attempts it claimed, and its own row. It returns the ids that are lost
-- (rescued, claimed again, or at another attempt): the worker must not complete them; and, with
-- `cancel` true, those it renewed that someone asked to cancel (schema/0010), in case their
-- notification did not reach the worker.
-- SKIP LOCKED: a row locked right now is being changed by our own acknowledgement or by a
-- transactional handler's commit (or by a rescuer, which the next heartbeat will notice); the
-- heartbeat never waits for it, and counts it as ours while it still is, or is done by us.
WITH me AS (
    UPDATE {schema}.workers
       SET heartbeat_at = now(), in_flight = cardinality(%(ids)s::bigint[])
     WHERE id = %(worker_id)s
), mine AS (
    SELECT t.id
      FROM {schema}.tasks AS t
      JOIN unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt) ON t.id = a.id
     WHERE t.attempts = a.attempt  -- one primary-key look-up per row (see complete)
       AND t.worker_id = %(worker_id)s
       AND t.lease_expires_at IS NOT NULL  -- in progress (see complete)
       FOR UPDATE OF t SKIP LOCKED
), renewed AS (
    UPDATE {schema}.tasks AS t
       SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
     WHERE t.id = ANY(ARRAY(SELECT id FROM mine))
    RETURNING t.id, t.attempts, t.cancel_requested_at IS NOT NULL AS cancel
)
SELECT a.id, a.attempt, false AS cancel
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[]) AS a(id, attempt)
  LEFT JOIN {schema}.tasks AS t ON t.id = a.id
 WHERE a.id NOT IN (SELECT id FROM renewed)
   AND NOT coalesce(t.worker_id = %(worker_id)s AND t.attempts = a.attempt
                    AND (t.lease_expires_at IS NOT NULL OR t.state = 'done'), false)
UNION ALL
SELECT r.id, r.attempts, true AS cancel
  FROM renewed AS r
 WHERE r.cancel;

-- name: session_statement_timeout
-- The lease keeper's connection: a renewal that cannot finish in time fails instead of waiting.
SELECT set_config('statement_timeout', %(ms)s, false);

-- name: session_index_plans
-- The worker's own connections (claim loop, lease keeper, maintenance): every statement they run
-- is meant to reach its rows through an index. Their statements are prepared, and PostgreSQL soon
-- caches a generic plan, costed with the table's statistics of that moment. A worker that starts
-- on an empty or freshly truncated table would keep a sequential scan for good, and the claim
-- would then read the whole table, done rows and dead versions included, each time: measured at
-- 2,000 buffers per claim once the table held 9,000 finished rows, and growing with it. Ruling
-- sequential scans out here keeps every plan, cached or not, on the indexes, whatever the table
-- held when it was made. Behind PgBouncer (no session settings) nothing is prepared, so each
-- statement is planned afresh against the table's actual size.
SELECT set_config('enable_seqscan', 'off', false);

-- name: worker_died
-- The supervisor saw one of its worker processes die: its rows go back at once instead of
-- waiting for their leases (or to failed when that was their last attempt, as in rescue), each
-- with an error that says how the process died and which tasks it was running. The attempt
-- counts, as every claimed attempt does: the supervisor cannot tell the task that crashed the
-- process from its neighbours, and a task that kills its process must still run out of attempts.
-- The error joins the history (see retry).
-- A row someone asked to cancel ends 'cancelled' (schema/0010).
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'::{schema}.task_state
                    WHEN t.attempts >= t.max_attempts THEN 'failed' ELSE 'queued' END,
       run_at = now(),
       finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL
                               OR t.attempts >= t.max_attempts THEN now() END,
       (last_error, errors) = (
           SELECT e.error,
                  jsonb_path_query_array(
                      coalesce(t.errors, '[]') || jsonb_build_object(
                          'attempt', t.attempts, 'at', now(),
                          'error', left(e.error, %(history_chars)s), 'worker_id', t.worker_id),
                      '$[last - $keep + 1 to last]',
                      jsonb_build_object('keep', %(history)s::integer))
             FROM (SELECT left(%(error)s || ' during attempt ' || t.attempts
                               || '; tasks it was running: ' || d.running, 4000) AS error) AS e),
       lease_expires_at = NULL
  FROM (SELECT id, string_agg(id || ' (' || left(task, 100) || ')', ', ') OVER () AS running
          FROM {schema}.tasks
         WHERE worker_id = %(worker_id)s
           AND state = 'in_progress'
         LIMIT 1000) AS d
 WHERE t.id = d.id
   AND t.state = 'in_progress'
   AND t.worker_id = %(worker_id)s
RETURNING t.id, t.queue, t.task, t.state::text AS state;

-- name: rescue
-- Any worker runs this now and then; no leader is needed. Rows whose lease ran out (their worker
-- died, hung or lost its connection) become claimable again, or failed when out of attempts; the
-- attempt that died was counted when it was claimed. SKIP LOCKED keeps concurrent rescuers apart.
-- The error joins the history (see retry).
-- A row someone asked to cancel (schema/0010) is not put back: it ends 'cancelled'.
-- %(since)s (NULL: no bound) starts the walk a little before this worker's last complete pass:
-- rows whose lease ran out earlier were there to take then. Without it, each pass would walk
-- the dead entries that every finished task leaves in tasks_lease_idx, and those pile up by the
-- hundred thousand while a long transaction elsewhere holds vacuum back. A full pass now and
-- then (see Maintenance.rescue) takes what a pass skipped because its row was locked.
WITH expired AS (
    SELECT id
      FROM {schema}.tasks
     WHERE state = 'in_progress'
       AND lease_expires_at < now()
       AND lease_expires_at >= coalesce(%(since)s::timestamptz, '-infinity')
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.tasks AS t
   SET state = CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'::{schema}.task_state
                    WHEN t.attempts >= t.max_attempts THEN 'failed' ELSE 'queued' END,
       run_at = now(),
       finished_at = CASE WHEN t.cancel_requested_at IS NOT NULL
                               OR t.attempts >= t.max_attempts THEN now() END,
       (last_error, errors) = (
           SELECT e.error,
                  jsonb_path_query_array(
                      coalesce(t.errors, '[]') || jsonb_build_object(
                          'attempt', t.attempts, 'at', now(),
                          'error', left(e.error, %(history_chars)s), 'worker_id', t.worker_id),
                      '$[last - $keep + 1 to last]',
                      jsonb_build_object('keep', %(history)s::integer))
             FROM (SELECT format('LeaseExpired: worker %%s stopped renewing its lease during '
                                 'attempt %%s (it died, hung or lost its connection)',
                                 t.worker_id, t.attempts) AS error) AS e),
       lease_expires_at = NULL
-- See claim: primary-key look-ups, never a scan of the table.
 WHERE t.id = ANY(ARRAY(SELECT id FROM expired))
RETURNING t.id, t.queue, t.task, t.state::text AS state;

-- name: purge
-- Retention: delete finished rows past their retention in small batches, oldest first. Done and
-- cancelled rows (kept `done_seconds`) and failed ones (kept `failed_seconds` too, usually much
-- longer) are read from two indexes (schema/0007), so a round reads only the entries it deletes
-- and never walks the failures it keeps. Done rows go first; failed ones fill what is left of the
-- batch. Cron rows are kept at least `cron_keep_seconds` so that a late, clock-skewed node cannot
-- enqueue the same slot again.
DELETE FROM {schema}.tasks
 WHERE id = ANY(ARRAY(
    SELECT id FROM (
        SELECT id FROM (
            SELECT id
              FROM {schema}.tasks
             WHERE state IN ('done', 'cancelled')
               AND finished_at < now() - make_interval(secs => %(done_seconds)s)
               AND (cron_key IS NULL
                    OR finished_at < now() - make_interval(secs => %(cron_keep_seconds)s))
             ORDER BY finished_at
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS done
        UNION ALL
        SELECT id FROM (
            SELECT id
              FROM {schema}.tasks
             WHERE state = 'failed'
               AND finished_at < now() - make_interval(secs => %(failed_seconds)s)
               AND finished_at < now() - make_interval(secs => %(done_seconds)s)
               AND (cron_key IS NULL
                    OR finished_at < now() - make_interval(secs => %(cron_keep_seconds)s))
             ORDER BY finished_at
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED) AS failed
        LIMIT %(limit)s) AS expired
 ));
