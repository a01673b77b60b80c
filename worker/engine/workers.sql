-- The worker registry: one row per worker process, for status and for operators.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: register
-- A worker process starts: its row (with the tasks it can run, for status), and the queue of each
-- of its tasks (so that rows inserted without a queue land where a worker of that task looks;
-- see schema/0006). The store then makes the rows of its tasks that were handed back due at once
-- (wake_handed_back).
WITH me AS (
    INSERT INTO {schema}.workers (id, host, pid, queues, concurrency, tasks)
    VALUES (%(worker_id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(tasks)s)
)
INSERT INTO {schema}.task_routes AS r (task, queue)
SELECT task, queue FROM unnest(%(tasks)s::text[], %(task_queues)s::text[]) AS h(task, queue)
ON CONFLICT (task) DO UPDATE SET queue = excluded.queue, declared_at = now()
 WHERE r.queue IS DISTINCT FROM excluded.queue OR r.declared_at < now() - interval '1 hour';

-- name: unregister
UPDATE {schema}.workers SET stopped_at = now(), in_flight = 0 WHERE id = %(worker_id)s;

-- name: forget_stale
-- Rows of workers that stopped (or vanished) long ago only clutter the status page.
DELETE FROM {schema}.workers
 WHERE heartbeat_at < now() - make_interval(secs => %(older_than_seconds)s);
