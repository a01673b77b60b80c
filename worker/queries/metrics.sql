-- Read-only statements behind /metrics, /readyz and the status page (worker/_web.py).
--
-- They run once per cache period per machine, never per scrape, and each is bounded: queue
-- counts walk only the partial indexes of active rows (tasks_claim_idx, tasks_lease_idx) and stop
-- at a cap per queue; finished rows, which may number hundreds of millions, are never counted
-- by these statements (their size comes from the planner's statistics instead).

-- name: metrics_queue_stats
-- One row per queue that has queued or running tasks, or that a live worker serves (so a queue
-- that drains reports 0 instead of vanishing from the graphs).
--   queued, delayed: exact up to %(cap)s per queue (a scan of at most that many index entries);
--                    beyond it queued is reported as the cap and delayed as a lower bound.
--   running:         exact (in_progress rows are bounded by the fleet's concurrency).
--   oldest_seconds:  age of the oldest due task, found with one index probe per distinct priority
--                    (a skip scan), so it costs the same with ten rows or ten million.
--   served:          a live worker lists the queue (the monitor exports it whatever its size).
-- Queue names come from a skip scan over tasks_claim_idx as well: one probe per queue, and at most
-- %(max_queues)s of them, so a producer that writes a million queue names cannot make this
-- statement slow (20,000 names took 0.5 s, 100,000 took 4 s). scanned and scanned_last say where
-- the scan stopped; metrics_queue_rest counts what lies beyond.
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
scan AS (
    SELECT count(*) AS scanned,
           (SELECT q.queue FROM queued_names AS q WHERE q.queue IS NOT NULL
             ORDER BY q.depth DESC LIMIT 1) AS scanned_last
      FROM queued_names WHERE queue IS NOT NULL
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
    SELECT queue FROM running
    UNION
    SELECT queue FROM served
)
SELECT names.queue,
       c.queued,
       c.delayed,
       coalesce(running.n, 0) AS running,
       c.queued >= %(cap)s AS capped,
       o.oldest_seconds,
       served.queue IS NOT NULL AS served,
       scan.scanned,
       scan.scanned_last
  FROM names
 CROSS JOIN scan
  LEFT JOIN running ON running.queue = names.queue
  LEFT JOIN served ON served.queue = names.queue
 CROSS JOIN LATERAL (
    SELECT count(*) AS queued, count(*) FILTER (WHERE s.run_at > now()) AS delayed
      FROM (SELECT t.run_at FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue = names.queue
             LIMIT %(cap)s) AS s
 ) AS c
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
 ORDER BY names.queue;

-- name: metrics_queue_rest
-- Queued tasks of the queues past the point where metrics_queue_stats stopped its scan (queues
-- that statement listed anyway, because they run or are served, excluded), counted together up
-- to %(cap)s along tasks_claim_idx: one bounded range scan, however many queues lie there.
SELECT count(*) AS queued, count(*) FILTER (WHERE s.run_at > now()) AS delayed
  FROM (SELECT t.run_at FROM {schema}.tasks AS t
         WHERE t.state = 'queued' AND t.queue > %(after)s AND t.queue <> ALL(%(listed)s)
         LIMIT %(cap)s) AS s;

-- name: metrics_state_estimates
-- Rows per state across the whole table, from the planner's statistics (reltuples times the
-- most-common-value frequencies that ANALYZE keeps for `state`): free to read, as fresh as the last
-- autovacuum/analyze, and empty until the table has been analyzed once.
SELECT v.state, (greatest(c.reltuples, 0) * v.freq)::float8 AS estimate
  FROM pg_class AS c
  JOIN pg_namespace AS ns ON ns.oid = c.relnamespace
 CROSS JOIN LATERAL (
    SELECT unnest(s.most_common_vals::text::text[]) AS state,
           unnest(s.most_common_freqs) AS freq
      FROM pg_stats AS s
     WHERE s.schemaname = ns.nspname AND s.tablename = c.relname AND s.attname = 'state'
 ) AS v
 WHERE ns.nspname = %(schema)s AND c.relname = 'tasks';

-- name: metrics_table_estimate
-- The planner's row count for the task table (-1 before the first analyze) and the current size
-- of its heap, which needs no analyze to be right.
SELECT c.reltuples::float8 AS estimate, pg_relation_size(c.oid) AS bytes
  FROM pg_class AS c
  JOIN pg_namespace AS ns ON ns.oid = c.relnamespace
 WHERE ns.nspname = %(schema)s AND c.relname = 'tasks';

-- name: metrics_workers_alive
SELECT count(*) AS alive, coalesce(sum(in_flight), 0) AS in_flight
  FROM {schema}.workers
 WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(alive_seconds)s);

-- name: status_page_finished_counts
-- Finished rows per queue and state, counted exactly. The page runs this only while the planner
-- estimates the table below a limit; above it the page shows table-wide estimates instead. At most
-- %(limit)s groups: when a producer wrote more queue names than that, the page treats the table as
-- too big to count per queue.
SELECT queue, state::text AS state, count(*) AS n
  FROM {schema}.tasks
 WHERE state IN ('done', 'failed', 'cancelled')
 GROUP BY queue, state
 LIMIT %(limit)s;

-- name: status_page_recent_failed
-- The newest failures among the last %(scan)s finished rows, read backwards from
-- tasks_finished_idx: bounded even when failures are rare among millions of done rows. Names and
-- errors come cut to %(chars)s characters (with their full lengths): a producer may have written
-- megabytes into any of them.
SELECT t.id, left(t.queue, %(chars)s) AS queue, char_length(t.queue) AS queue_length,
       left(t.task, %(chars)s) AS task, char_length(t.task) AS task_length,
       t.attempts, t.max_attempts, t.finished_at,
       left(t.last_error, %(chars)s) AS last_error, char_length(t.last_error) AS last_error_length
  FROM (SELECT id, state
          FROM {schema}.tasks
         WHERE state IN ('done', 'failed', 'cancelled')
         ORDER BY finished_at DESC
         LIMIT %(scan)s) AS recent
  JOIN {schema}.tasks AS t ON t.id = recent.id
 WHERE recent.state = 'failed'
 ORDER BY t.finished_at DESC, t.id DESC
 LIMIT %(limit)s;

-- name: status_page_cron_runs
-- The latest slot of each cron key still in the table, from tasks_cron_slot_idx.
SELECT DISTINCT ON (cron_key) cron_key, cron_at, state::text AS state, finished_at
  FROM {schema}.tasks
 WHERE cron_key IS NOT NULL
 ORDER BY cron_key, cron_at DESC
 LIMIT %(limit)s;

-- name: status_page_table_exists
SELECT to_regclass(%(name)s) IS NOT NULL;

-- name: status_page_cron_schedules
-- Only run after status_page_table_exists said yes: the cron table belongs to the cron feature
-- and its columns are rendered as they are.
SELECT to_jsonb(c) AS row FROM {schema}.cron_schedules AS c LIMIT %(limit)s;

-- name: status_page_locks
-- Same as above for the lock table.
SELECT to_jsonb(l) AS row FROM {schema}.locks AS l LIMIT %(limit)s;

-- name: status_page_advisory_locks
-- Advisory locks granted in this database. pg_locks is not free on a busy server, which is why
-- only the status page (cached, on demand) reads it, never /metrics.
SELECT l.classid::bigint AS classid, l.objid::bigint AS objid, l.objsubid, l.mode, l.pid,
       a.application_name, a.client_addr::text AS client_addr, a.state,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_seconds
  FROM pg_locks AS l
  LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY l.pid, l.classid, l.objid
 LIMIT %(limit)s;

-- name: status_page_workers
-- Registered workers that have not stopped, as `worker status` lists them, at most %(limit)s.
SELECT id, host, pid, queues, concurrency, started_at, heartbeat_at, in_flight, stopped_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds
  FROM {schema}.workers
 WHERE stopped_at IS NULL
 ORDER BY host, pid
 LIMIT %(limit)s;

-- Exact counters across a SIGKILL (worker/_metrics.py, the journal). A worker process writes the
-- counts a transaction will add, tagged with its transaction id, before COMMIT; when the process
-- dies, the supervisor asks whether that transaction committed and adds what the dead process
-- did not get to count.

-- name: metrics_current_xact_id
SELECT pg_current_xact_id()::text AS xid;

-- name: metrics_xact_status
-- 'committed', 'aborted' or 'in progress'; NULL when the id is too old to be known.
SELECT pg_xact_status(%(xid)s::xid8) AS status;
