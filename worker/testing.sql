-- worker.testing: what was enqueued, and which queues hold due rows.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: testing_due_queues
-- The queues holding a row ready to claim, so a test's run_due needs no list of queues.
SELECT DISTINCT queue FROM {schema}.tasks WHERE state = 'queued' AND run_at <= now()
 ORDER BY queue;

-- name: testing_enqueued
-- The task rows a test looks at, oldest first, optionally of one task and one queue.
SELECT id, task, payload, queue, priority, run_at, state::text AS state, attempts, max_attempts,
       last_error
  FROM {schema}.tasks
 WHERE (%(task)s::text IS NULL OR task = %(task)s)
   AND (%(queue)s::text IS NULL OR queue = %(queue)s)
 ORDER BY id;
