-- The minute rollup behind the charts (schema/0018), written by the workers' maintenance.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: rollup_claim
-- The minute to record, claimed for this worker: the last one over (%(settle)s seconds after it
-- ended, by the database's clock, so that the tasks that finished in it have committed), or
-- %(minute)s when given. No row when another worker recorded it already; while another records
-- it, this waits for that transaction and then finds its row.
INSERT INTO {schema}.stats_minutes (minute)
VALUES (coalesce(%(minute)s::timestamptz,
                 date_trunc('minute', now() - make_interval(secs => %(settle)s::float8))
                 - interval '1 minute'))
ON CONFLICT (minute) DO NOTHING
RETURNING minute;

-- name: rollup_record
-- The claimed minute %(minute)s, per queue: tasks queued (due, waiting; counted up to %(cap)s,
-- from tasks_claim_idx) and in progress now, and of the tasks that finished during the minute
-- (done from tasks_done_idx and the history's slots, schema/0025, failed for good from tasks_failed_idx, at most %(sample)s of each,
-- in finishing order) the median and 99th percentile of the seconds their last attempt waited
-- from due to start. Queue names come from a skip scan of tasks_claim_idx (at most
-- %(max_queues)s), the running tasks and the finished ones; at most %(max_queues)s rows are kept,
-- the busiest first. Then the fleet's totals on the minute's row (queued up to %(total_cap)s).
WITH RECURSIVE names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'queued' ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(max_queues)s
),
running AS (
    SELECT t.queue, count(*) AS n
      FROM {schema}.tasks AS t
     WHERE t.state = 'in_progress'
     GROUP BY t.queue
),
finished AS (
    SELECT f.queue, greatest(extract(epoch FROM f.started_at - f.run_at)::float8, 0) AS waited
      FROM ((SELECT t.queue, t.started_at, t.run_at FROM {schema}.task_rows AS t
              WHERE t.state IN ('done', 'cancelled') AND t.state = 'done'
                AND t.finished_at >= %(minute)s::timestamptz
                AND t.finished_at < %(minute)s::timestamptz + interval '1 minute'
              ORDER BY t.finished_at
              LIMIT %(sample)s)
            UNION ALL
            (SELECT t.queue, t.started_at, t.run_at FROM {schema}.tasks AS t
              WHERE t.state = 'failed'
                AND t.finished_at >= %(minute)s::timestamptz
                AND t.finished_at < %(minute)s::timestamptz + interval '1 minute'
              ORDER BY t.finished_at
              LIMIT %(sample)s)) AS f
     WHERE f.started_at IS NOT NULL
),
waits AS (
    SELECT f.queue, count(*) AS n,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY f.waited) AS p50,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY f.waited) AS p99
      FROM finished AS f
     GROUP BY f.queue
),
per_queue AS (
    SELECT a.queue,
           (SELECT count(*)
              FROM (SELECT 1 FROM {schema}.tasks AS t
                     WHERE t.state = 'queued' AND t.queue = a.queue
                     LIMIT %(cap)s) AS c) AS queued,
           coalesce(r.n, 0) AS in_progress, coalesce(w.n, 0) AS waited, w.p50, w.p99
      FROM (SELECT queue FROM names WHERE queue IS NOT NULL
            UNION
            SELECT queue FROM running
            UNION
            SELECT queue FROM waits) AS a
      LEFT JOIN running AS r ON r.queue = a.queue
      LEFT JOIN waits AS w ON w.queue = a.queue
),
kept AS (
    INSERT INTO {schema}.queue_minutes
           (minute, queue, queued, in_progress, waited, wait_p50, wait_p99)
    SELECT %(minute)s::timestamptz, p.queue, p.queued, p.in_progress, p.waited, p.p50, p.p99
      FROM per_queue AS p
     ORDER BY p.queued + p.in_progress + p.waited DESC, p.queue
     LIMIT %(max_queues)s
    RETURNING 1
),
total AS (
    SELECT (SELECT count(*)
              FROM (SELECT 1 FROM {schema}.tasks AS t
                     WHERE t.state = 'queued'
                     LIMIT %(total_cap)s) AS c) AS queued,
           (SELECT count(*) FROM {schema}.tasks AS t WHERE t.state = 'in_progress') AS in_progress
)
UPDATE {schema}.stats_minutes AS s
   SET sampled_at = now(),
       queued = total.queued,
       queued_capped = total.queued >= %(total_cap)s,
       in_progress = total.in_progress
  FROM total
 WHERE s.minute = %(minute)s::timestamptz
RETURNING (SELECT count(*) FROM kept) AS queues;

-- name: rollup_forget
-- Minutes older than %(keep)s seconds go (the charts show the last hour).
WITH gone AS (
    DELETE FROM {schema}.queue_minutes
     WHERE minute < now() - make_interval(secs => %(keep)s::float8)
)
DELETE FROM {schema}.stats_minutes
 WHERE minute < now() - make_interval(secs => %(keep)s::float8);
