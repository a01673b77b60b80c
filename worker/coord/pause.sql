-- Paused queues (schema/0009, 0011).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: pause_queue
-- Pause a queue; a queue already paused keeps its first pause (time and operator): false.
SELECT {schema}.pause_queue(queue => %(queue)s, paused_by => %(by)s) AS changed;

-- name: resume_queue
-- Resume a queue and wake the workers that serve it (the same notification as a new row's), so
-- its backlog starts at once rather than at their next poll. False when it was not paused.
SELECT {schema}.resume_queue(queue => %(queue)s) AS changed;

-- name: paused_queues
-- Every paused queue, by name, at most %(limit)s.
SELECT queue, paused_at, paused_by
  FROM {schema}.paused_queues
 ORDER BY queue
 LIMIT %(limit)s;
