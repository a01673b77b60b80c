-- The worker registry: one row per worker process, for status and for operators.
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: register
-- A worker process starts: its row, with the tasks it can run, for status and operators.
INSERT INTO {schema}.workers (id, host, pid, queues, concurrency, tasks)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s, %(tasks)s);

-- name: unregister
UPDATE {schema}.workers SET stopped_at = now(), in_flight = 0 WHERE id = %(worker_id)s;

-- name: forget_stale
-- Rows of workers that stopped (or vanished) long ago only clutter the status page.
DELETE FROM {schema}.workers
 WHERE heartbeat_at < now() - make_interval(secs => %(older_than_seconds)s);
