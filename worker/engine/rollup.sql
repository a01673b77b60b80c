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
-- (done from tasks_done_idx and the history's slots, schema/0025, failed for good from
-- tasks_failed_idx, at most %(sample)s of each, in finishing order) the median and 99th
-- percentile of the seconds their last attempt waited from due to start. At most %(max_queues)s
-- rows are kept, the busiest first. Then the fleet's totals on the minute's row (queued up to
-- %(total_cap)s).
--
-- The queues come from a skip scan of tasks_claim_idx (at most %(max_queues)s): for each, its
-- front, the first entry this statement sees. The dead entries of claimed rows lie before the
-- fronts, and while a long transaction elsewhere holds vacuum back they pile up by the million;
-- so the skip scan walks them once, and every count starts at a front. When the skip scan found
-- every queue, the fleet's total is the sum of those counts; otherwise it is counted over the
-- whole index, as a queue past the first %(max_queues)s is. Each count is made once
-- (MATERIALIZED), and the running tasks are counted once per queue and summed.
WITH RECURSIVE fronts AS (
    (SELECT t.queue, (-t.priority) AS neg_priority, t.run_at, t.id, 1 AS depth
       FROM {schema}.tasks AS t
      WHERE t.state = 'queued'
      ORDER BY t.queue, (-t.priority), t.run_at, t.id
      LIMIT 1)
    UNION ALL
    SELECT x.queue, x.neg_priority, x.run_at, x.id, f.depth + 1
      FROM fronts AS f
     CROSS JOIN LATERAL (
        SELECT t.queue, (-t.priority) AS neg_priority, t.run_at, t.id
          FROM {schema}.tasks AS t
         WHERE t.state = 'queued' AND t.queue > f.queue
         ORDER BY t.queue, (-t.priority), t.run_at, t.id
         LIMIT 1) AS x
     WHERE f.depth < %(max_queues)s
),
every_queue AS MATERIALIZED (
    SELECT count(*) < %(max_queues)s AS found FROM fronts
),
counted AS MATERIALIZED (
    SELECT f.queue,
           (SELECT count(*)
              FROM (SELECT 1 FROM {schema}.tasks AS t
                     WHERE t.state = 'queued' AND t.queue = f.queue
                       AND ((-t.priority), t.run_at, t.id) >= (f.neg_priority, f.run_at, f.id)
                     LIMIT %(cap)s) AS c) AS queued
      FROM fronts AS f
),
running AS MATERIALIZED (
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
waits AS MATERIALIZED (
    SELECT f.queue, count(*) AS n,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY f.waited) AS p50,
           percentile_cont(0.99) WITHIN GROUP (ORDER BY f.waited) AS p99
      FROM finished AS f
     GROUP BY f.queue
),
per_queue AS MATERIALIZED (
    SELECT a.queue,
           coalesce(
               c.queued,
               CASE WHEN (SELECT found FROM every_queue) THEN 0 ELSE
                   (SELECT count(*)
                      FROM (SELECT 1 FROM {schema}.tasks AS t
                             WHERE t.state = 'queued' AND t.queue = a.queue
                             LIMIT %(cap)s) AS c) END) AS queued,
           coalesce(r.n, 0) AS in_progress, coalesce(w.n, 0) AS waited, w.p50, w.p99
      FROM (SELECT queue FROM fronts
            UNION
            SELECT queue FROM running
            UNION
            SELECT queue FROM waits) AS a
      LEFT JOIN counted AS c ON c.queue = a.queue
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
total AS MATERIALIZED (
    SELECT CASE WHEN (SELECT found FROM every_queue) THEN
               (SELECT count(*)
                  FROM (SELECT 1
                          FROM fronts AS f
                         CROSS JOIN LATERAL (
                            SELECT 1 FROM {schema}.tasks AS t
                             WHERE t.state = 'queued' AND t.queue = f.queue
                               AND ((-t.priority), t.run_at, t.id)
                                   >= (f.neg_priority, f.run_at, f.id)
                             LIMIT %(total_cap)s) AS q
                         LIMIT %(total_cap)s) AS c)
           ELSE
               (SELECT count(*)
                  FROM (SELECT 1 FROM {schema}.tasks AS t
                         WHERE t.state = 'queued'
                         LIMIT %(total_cap)s) AS c)
           END AS queued,
           (SELECT coalesce(sum(r.n), 0) FROM running AS r) AS in_progress
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
