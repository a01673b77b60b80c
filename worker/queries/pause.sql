-- Paused queues (schema/0009): the operator's pause and resume, and the list workers and the
-- console read. Each block starts with `-- name: NAME`; {schema} is the quoted schema name.

-- name: pause_queue
-- Pause a queue; a queue already paused keeps its first pause (time and operator).
INSERT INTO {schema}.paused_queues (queue, paused_by)
VALUES (%(queue)s, %(by)s)
ON CONFLICT (queue) DO NOTHING
RETURNING queue;

-- name: resume_queue
DELETE FROM {schema}.paused_queues
 WHERE queue = %(queue)s
RETURNING queue;

-- name: paused_queues
-- Every paused queue, by name, at most %(limit)s.
SELECT queue, paused_at, paused_by
  FROM {schema}.paused_queues
 ORDER BY queue
 LIMIT %(limit)s;
