-- Where rows land when their producer names no queue: the queue of each task, as the handlers
-- that run it declare (schema/0006; the enqueue function and the tasks' insert trigger read it).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: record_routes
-- The queue of each task (declared_at refreshed hourly at most, so that starting workers do not
-- write the same rows again and again).
INSERT INTO {schema}.task_routes AS r (task, queue)
SELECT task, queue FROM unnest(%(tasks)s::text[], %(queues)s::text[]) AS h(task, queue)
ON CONFLICT (task) DO UPDATE SET queue = excluded.queue, declared_at = now()
 WHERE r.queue IS DISTINCT FROM excluded.queue OR r.declared_at < now() - interval '1 hour';

-- name: task_routed
-- Whether a worker (or `worker migrate --module`) has ever declared the task: a name no handler
-- has is most likely a typo.
SELECT EXISTS (SELECT 1 FROM {schema}.task_routes WHERE task = %(task)s);
