-- `worker demo`'s summary.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: demo_last_id
SELECT coalesce(max(id), 0) FROM {schema}.task_rows;

-- name: demo_summary
-- retried: tasks that failed an attempt and ran again or wait for it (a retry is scheduled).
SELECT count(*) AS enqueued,
       count(*) FILTER (WHERE state = 'done') AS done,
       count(*) FILTER (WHERE attempts > 1 OR (state = 'scheduled' AND attempts > 0)) AS retried,
       count(*) FILTER (WHERE state = 'failed') AS failed,
       count(*) FILTER (WHERE state = 'in_progress') AS running,
       count(*) FILTER (WHERE state IN ('scheduled', 'queued')) AS waiting,
       count(*) FILTER (WHERE cron_key IS NOT NULL) AS cron_runs,
       (SELECT count(*) FROM {schema}.workers WHERE stopped_at IS NULL) AS workers
  FROM {schema}.task_rows
 WHERE id > %(after)s;
