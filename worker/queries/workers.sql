-- The worker registry: one row per worker process, for status and for operators.

-- name: register
INSERT INTO {schema}.workers (id, host, pid, queues, concurrency)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s);

-- name: unregister
UPDATE {schema}.workers SET stopped_at = now(), in_flight = 0 WHERE id = %(worker_id)s;

-- name: forget_stale
-- Rows of workers that stopped (or vanished) long ago only clutter the status page.
DELETE FROM {schema}.workers
 WHERE heartbeat_at < now() - make_interval(secs => %(older_than_seconds)s);
