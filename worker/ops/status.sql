-- Read-only views of the queue for `worker status`, the status page and the metrics.
-- Every view is bounded on a table of any size: counts stop at a cap.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: queue_stats
-- One row per queue that has scheduled, queued, running or (when %(failed_cap)s > 0) failed
-- tasks, or that a live worker serves (so that a queue that drains reports 0 instead of vanishing,
-- and a queue nobody serves stands out).
--   queued, scheduled, failed: exact up to their cap per queue, from index-only scans of
--       tasks_claim_idx, tasks_scheduled_queue_idx and tasks_failed_queue_idx; the cap itself
--       when they reach it (a lower bound). failed_cap 0 reads no failure at all.
--   scheduled_due: scheduled rows already due that no worker has promoted yet (exact up to the
--       cap: the due ones come first in that index). Any live worker promotes every queue's rows,
--       so this stays 0 unless no worker runs at all.
--   running: exact (in_progress rows are bounded by the fleet's concurrency).
--   oldest_seconds: how long the oldest due task (queued, or scheduled and due) has waited; one
--       index probe per distinct priority of the queue (a skip scan), and one for scheduled rows.
--   served: a live worker (heartbeat within %(alive_seconds)s, not stopped) lists the queue.
-- Queue names come from skip scans of the same indexes, one probe per queue and at most
-- %(max_queues)s per index, so a producer that writes a million queue names cannot make this
-- slow. truncated_after is the name where the first of them stopped (NULL when each saw every
-- queue): queue_rest counts the queued and scheduled tasks past it.
WITH RECURSIVE queued_names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'queued' ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM queued_names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(max_queues)s
),
scheduled_names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'scheduled' ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'scheduled' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM scheduled_names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(max_queues)s
),
failed_names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'failed' AND %(failed_cap)s > 0 ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'failed' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM failed_names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(max_queues)s
),
scan AS (
    SELECT min(s.last) AS truncated_after
      FROM (SELECT max(queue) AS last, count(queue) AS n FROM queued_names
            UNION ALL
            SELECT max(queue), count(queue) FROM scheduled_names
            UNION ALL
            SELECT max(queue), count(queue) FROM failed_names) AS s
     WHERE s.n >= %(max_queues)s
),
running AS (
    SELECT t.queue, count(*) AS n
      FROM {schema}.tasks AS t
     WHERE t.state = 'in_progress'
     GROUP BY t.queue
),
served AS (
    SELECT DISTINCT unnest(w.queues) AS queue FROM {schema}.workers AS w
     WHERE w.stopped_at IS NULL AND w.heartbeat_at > now() - make_interval(secs => %(alive_seconds)s)
),
names AS (
    SELECT queue FROM queued_names WHERE queue IS NOT NULL
    UNION
    SELECT queue FROM scheduled_names WHERE queue IS NOT NULL
    UNION
    SELECT queue FROM failed_names WHERE queue IS NOT NULL
    UNION
    SELECT queue FROM running
    UNION
    SELECT queue FROM served
)
SELECT names.queue,
       q.queued,
       s.scheduled,
       s.scheduled_due,
       coalesce(running.n, 0) AS running,
       f.failed,
       q.queued >= %(cap)s AS queued_capped,
       s.scheduled >= %(cap)s AS scheduled_capped,
       f.failed >= %(failed_cap)s AND %(failed_cap)s > 0 AS failed_capped,
       greatest(o.oldest_seconds, d.oldest_seconds) AS oldest_seconds,
       served.queue IS NOT NULL AS served,
       scan.truncated_after
  FROM names
 CROSS JOIN scan
  LEFT JOIN running ON running.queue = names.queue
  LEFT JOIN served ON served.queue = names.queue
 CROSS JOIN LATERAL (
    SELECT count(*) AS queued
      FROM (SELECT 1 FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue = names.queue
             LIMIT %(cap)s) AS c
 ) AS q
 CROSS JOIN LATERAL (
    SELECT count(*) AS scheduled, count(*) FILTER (WHERE c.run_at <= now()) AS scheduled_due
      FROM (SELECT t.run_at FROM {schema}.tasks AS t
             WHERE t.state = 'scheduled' AND t.queue = names.queue
             ORDER BY t.run_at
             LIMIT %(cap)s) AS c
 ) AS s
 CROSS JOIN LATERAL (
    SELECT count(*) AS failed
      FROM (SELECT 1 FROM {schema}.tasks AS t
             WHERE t.state = 'failed' AND t.queue = names.queue
             LIMIT %(failed_cap)s) AS c
 ) AS f
 CROSS JOIN LATERAL (
    WITH RECURSIVE prio AS (
        (SELECT (-t.priority) AS p, 1 AS depth FROM {schema}.tasks AS t
          WHERE t.state = 'queued' AND t.queue = names.queue
          ORDER BY (-t.priority) LIMIT 1)
        UNION ALL
        SELECT (SELECT (-t.priority) FROM {schema}.tasks AS t
                 WHERE t.state = 'queued' AND t.queue = names.queue AND (-t.priority) > prio.p
                 ORDER BY (-t.priority) LIMIT 1),
               prio.depth + 1
          FROM prio
         WHERE prio.p IS NOT NULL AND prio.depth < 1000
    )
    SELECT extract(epoch FROM now() - min(f.run_at))::float8 AS oldest_seconds
      FROM prio
     CROSS JOIN LATERAL (
        SELECT t.run_at FROM {schema}.tasks AS t
         WHERE t.state = 'queued' AND t.queue = names.queue AND (-t.priority) = prio.p
         ORDER BY (-t.priority), t.run_at LIMIT 1
     ) AS f
     WHERE prio.p IS NOT NULL AND f.run_at <= now()
 ) AS o
 CROSS JOIN LATERAL (
    SELECT extract(epoch FROM now() - min(c.run_at))::float8 AS oldest_seconds
      FROM (SELECT t.run_at FROM {schema}.tasks AS t
             WHERE t.state = 'scheduled' AND t.queue = names.queue
             ORDER BY t.run_at LIMIT 1) AS c
     WHERE c.run_at <= now()
 ) AS d
 ORDER BY names.queue;

-- name: queue_rest
-- Queued and scheduled tasks of the queues past the point where queue_stats stopped its name
-- scans (queues it listed anyway, because they run or are served, excluded), counted together up
-- to %(cap)s each: one bounded range scan per state, however many queues lie there.
-- ORDER BY queue keeps the plan on the state's index (a range from %(after)s): without it the
-- planner may pick a sequential scan that stops early only when rows match early (seen on PG 16).
SELECT (SELECT count(*)
          FROM (SELECT 1 FROM {schema}.tasks AS t
                 WHERE t.state = 'queued' AND t.queue > %(after)s AND t.queue <> ALL(%(listed)s)
                 ORDER BY t.queue
                 LIMIT %(cap)s) AS c) AS queued,
       (SELECT count(*)
          FROM (SELECT 1 FROM {schema}.tasks AS t
                 WHERE t.state = 'scheduled' AND t.queue > %(after)s AND t.queue <> ALL(%(listed)s)
                 ORDER BY t.queue
                 LIMIT %(cap)s) AS c) AS scheduled;

-- name: finished_counts
-- Done and cancelled rows per queue among the newest %(cap)s of them, read backwards from
-- tasks_done_idx and the history's slots (schema/0025), merged: exact when the table holds fewer than %(cap)s such rows (the caller checks),
-- otherwise the caller shows the estimates instead (done rows are kept for an hour, so a busy
-- installation holds millions).
SELECT r.queue, r.state::text AS state, count(*) AS n
  FROM (SELECT t.queue, t.state FROM {schema}.task_rows AS t
         WHERE t.state IN ('done', 'cancelled')
         ORDER BY t.finished_at DESC
         LIMIT %(cap)s) AS r
 GROUP BY r.queue, r.state
 ORDER BY r.queue, r.state;

-- name: queue_state_estimates
-- The planner's estimate of the rows of each (queue, state) given, for counts that stopped at their
-- cap (schema/0007, estimated_rows: a plan per pair, nothing executed).
SELECT c.queue, c.state, {schema}.estimated_rows(c.queue, c.state) AS estimate
  FROM unnest(%(queues)s::text[], %(states)s::text[]) AS c(queue, state);

-- name: recent_failed
-- The newest failures, read backwards from tasks_failed_idx. Names and errors come cut to
-- %(chars)s characters (with their full lengths): a producer may have written megabytes into any
-- of them.
SELECT t.id, left(t.queue, %(chars)s) AS queue, char_length(t.queue) AS queue_length,
       left(t.task, %(chars)s) AS task, char_length(t.task) AS task_length,
       t.attempts, t.max_attempts, t.finished_at,
       left(t.last_error, %(chars)s) AS last_error, char_length(t.last_error) AS last_error_length
  FROM {schema}.tasks AS t
 WHERE t.state = 'failed'
 ORDER BY t.finished_at DESC, t.id DESC
 LIMIT %(limit)s;

-- name: workers
-- Registered workers that have not stopped, at most %(limit)s.
SELECT id, host, pid, queues, concurrency, started_at, heartbeat_at, in_flight, stopped_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds
  FROM {schema}.workers
 WHERE stopped_at IS NULL
 ORDER BY host, pid
 LIMIT %(limit)s;

-- name: missing_handlers
-- Tasks that wait for a handler no live worker has (workers.tasks lists each worker's handlers):
--   handed_back: rows that workers without the handler handed back (schema/0006), per task, from
--       a skip scan of tasks_handed_back_idx (at most %(max_tasks)s names), each counted up to
--       %(cap)s. The queue shown is that of one of the task's rows.
--   queued: the tasks among the first %(sample)s queued rows (in claim order) of each queue in
--       %(queues)s (the caller's pick of queues with queued rows): a bounded sample, not a count.
--       A served queue hands such rows back at once (they show up above); this finds them in
--       queues that nobody serves. capped: the queue's sample was full, so there may be more.
WITH RECURSIVE live AS (
    SELECT DISTINCT unnest(w.tasks) AS task FROM {schema}.workers AS w
     WHERE w.stopped_at IS NULL AND w.heartbeat_at > now() - make_interval(secs => %(alive_seconds)s)
),
handed AS (
    (SELECT t.task, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.handed_back > 0 AND t.state = 'scheduled' ORDER BY t.task LIMIT 1)
    UNION ALL
    SELECT (SELECT t.task FROM {schema}.tasks AS t
             WHERE t.handed_back > 0 AND t.state = 'scheduled' AND t.task > h.task
             ORDER BY t.task LIMIT 1),
           h.depth + 1
      FROM handed AS h
     WHERE h.task IS NOT NULL AND h.depth < %(max_tasks)s
),
sampled AS (
    SELECT n.queue, s.task, count(*) AS n, sum(count(*)) OVER (PARTITION BY n.queue) AS sampled
      FROM unnest(%(queues)s::text[]) AS n(queue)
     CROSS JOIN LATERAL (
        SELECT t.task FROM {schema}.tasks AS t
         WHERE t.state = 'queued' AND t.queue = n.queue
         ORDER BY (-t.priority), t.run_at, t.id
         LIMIT %(sample)s
     ) AS s
     GROUP BY n.queue, s.task
)
SELECT 'handed_back' AS kind, h.task, one.queue, c.n, c.n >= %(cap)s AS capped
  FROM handed AS h
 CROSS JOIN LATERAL (
    SELECT count(*) AS n
      FROM (SELECT 1 FROM {schema}.tasks AS t
             WHERE t.handed_back > 0 AND t.state = 'scheduled' AND t.task = h.task
             LIMIT %(cap)s) AS x
 ) AS c
 CROSS JOIN LATERAL (
    SELECT t.queue FROM {schema}.tasks AS t
     WHERE t.handed_back > 0 AND t.state = 'scheduled' AND t.task = h.task
     LIMIT 1
 ) AS one
 WHERE h.task IS NOT NULL AND NOT EXISTS (SELECT 1 FROM live WHERE live.task = h.task)
UNION ALL
SELECT 'queued', s.task, s.queue, s.n, s.sampled >= %(sample)s
  FROM sampled AS s
 WHERE NOT EXISTS (SELECT 1 FROM live WHERE live.task = s.task)
 ORDER BY 4 DESC, 2, 3
 LIMIT %(limit)s;

-- name: get_task
-- One task, with the errors of its last attempts (`errors`, oldest first; schema/0008), from
-- the task table or the history (task_rows, schema/0025).
SELECT id, queue, task, payload, priority, run_at, state::text AS state, attempts, max_attempts,
       last_error, coalesce(errors, '[]') AS errors, dedupe_key, worker_id, lease_expires_at,
       created_at, started_at, finished_at, cancel_requested_at, cancelled_by
  FROM {schema}.task_rows
 WHERE id = %(id)s;

-- name: metrics_workers_alive
SELECT count(*) AS alive, coalesce(sum(in_flight), 0) AS in_flight
  FROM {schema}.workers
 WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(alive_seconds)s);
