-- Operator actions and read-only views used by `worker status`, `worker retry` and `worker cancel`.

-- name: queue_counts
-- Counts per queue and state. Active states come from the partial indexes; finished states are
-- counted too, which costs a scan of the finished index: fine for a command, cached for scrapes.
SELECT queue, state::text AS state, count(*) AS n
  FROM {schema}.tasks
 GROUP BY queue, state
 ORDER BY queue, state;

-- name: queue_oldest
-- Age of the oldest due task per queue, read from the claim index.
SELECT queue,
       count(*) FILTER (WHERE run_at > now()) AS delayed,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE run_at <= now()))::float8 AS oldest_seconds
  FROM {schema}.tasks
 WHERE state = 'queued'
 GROUP BY queue
 ORDER BY queue;

-- name: recent_failed
SELECT id, queue, task, attempts, max_attempts, finished_at, last_error
  FROM {schema}.tasks
 WHERE state = 'failed'
 ORDER BY finished_at DESC
 LIMIT %(limit)s;

-- name: workers
SELECT id, host, pid, queues, concurrency, started_at, heartbeat_at, in_flight, stopped_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds
  FROM {schema}.workers
 WHERE stopped_at IS NULL
 ORDER BY host, pid;

-- name: get_task
SELECT id, queue, task, payload, priority, run_at, state::text AS state, attempts, max_attempts,
       last_error, dedupe_key, worker_id, lease_expires_at, created_at, started_at, finished_at
  FROM {schema}.tasks
 WHERE id = %(id)s;

-- name: retry_task
-- Put a failed or cancelled task back in the queue with fresh attempts.
UPDATE {schema}.tasks
   SET state = 'queued', run_at = now(), attempts = 0, finished_at = NULL, lease_expires_at = NULL
 WHERE id = %(id)s AND state IN ('failed', 'cancelled')
RETURNING id;

-- name: retry_failed
UPDATE {schema}.tasks
   SET state = 'queued', run_at = now(), attempts = 0, finished_at = NULL, lease_expires_at = NULL
 WHERE state = 'failed' AND (%(queue)s::text IS NULL OR queue = %(queue)s)
RETURNING id;

-- name: cancel_task
-- Only a task that has not started can be cancelled; a running one finishes or fails on its own.
UPDATE {schema}.tasks
   SET state = 'cancelled', finished_at = now()
 WHERE id = %(id)s AND state = 'queued'
RETURNING id;

-- name: wake
-- Rows put back in the queue by an operator: wake idle workers as an INSERT would.
SELECT pg_notify(%(channel)s, '');
