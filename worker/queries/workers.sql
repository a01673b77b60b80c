-- The worker registry: one row per worker process, for status and for operators.

-- name: register
-- A worker process starts: its row (with the tasks it can run, for status), the queue of each of
-- its tasks (so that rows inserted without a queue land where a worker of that task looks; see
-- schema/0006), and the rows of its tasks that workers without the handler handed back, which
-- are due at once now that a worker that has it is here.
WITH me AS (
    INSERT INTO {schema}.workers (id, host, pid, queues, concurrency, tasks)
    VALUES (%(worker_id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(tasks)s)
), routes AS (
    INSERT INTO {schema}.task_routes AS r (task, queue)
    SELECT task, queue FROM unnest(%(tasks)s::text[], %(task_queues)s::text[]) AS h(task, queue)
    ON CONFLICT (task) DO UPDATE SET queue = excluded.queue, declared_at = now()
     WHERE r.queue IS DISTINCT FROM excluded.queue OR r.declared_at < now() - interval '1 hour'
)
UPDATE {schema}.tasks
   SET run_at = now()
 WHERE state = 'scheduled'
   AND handed_back > 0
   AND left(task, 255) = ANY(ARRAY(SELECT left(n, 255) FROM unnest(%(tasks)s::text[]) AS n))
   AND task = ANY(%(tasks)s::text[])
   AND run_at > now();

-- name: unregister
UPDATE {schema}.workers SET stopped_at = now(), in_flight = 0 WHERE id = %(worker_id)s;

-- name: forget_stale
-- Rows of workers that stopped (or vanished) long ago only clutter the status page.
DELETE FROM {schema}.workers
 WHERE heartbeat_at < now() - make_interval(secs => %(older_than_seconds)s);
