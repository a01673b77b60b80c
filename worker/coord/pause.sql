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

-- name: queue_known
-- Whether anything has named %(queue)s: a scheduled, queued, running or failed task, one of
-- the %(recent)s latest finished ones, a worker's route for a task, a registered worker, a limit,
-- a pause, or one of the %(recent)s latest operator actions (a bulk action's filter, a pause or
-- resume, from the CLI or the console). And up to %(names)s queue names by name, for a message:
-- from skip scans of the waiting and failed tasks' indexes (one probe per name), the routes, the
-- workers, the limits and the pauses. Bounded on a table of any size.
WITH RECURSIVE queued_names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'queued' ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'queued' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM queued_names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(names)s
),
scheduled_names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'scheduled' ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'scheduled' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM scheduled_names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(names)s
),
failed_names AS (
    (SELECT t.queue, 1 AS depth FROM {schema}.tasks AS t
      WHERE t.state = 'failed' ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM {schema}.tasks AS t
             WHERE t.state = 'failed' AND t.queue > n.queue ORDER BY t.queue LIMIT 1),
           n.depth + 1
      FROM failed_names AS n
     WHERE n.queue IS NOT NULL AND n.depth < %(names)s
),
names AS (
    SELECT queue FROM queued_names WHERE queue IS NOT NULL
    UNION
    SELECT queue FROM scheduled_names WHERE queue IS NOT NULL
    UNION
    SELECT queue FROM failed_names WHERE queue IS NOT NULL
    UNION
    SELECT r.queue FROM {schema}.task_routes AS r
    UNION
    SELECT unnest(w.queues) FROM {schema}.workers AS w
    UNION
    SELECT l.queue FROM {schema}.queue_limits AS l
    UNION
    SELECT p.queue FROM {schema}.paused_queues AS p
)
SELECT EXISTS (SELECT 1 FROM {schema}.tasks AS t
                WHERE t.state = 'queued' AND t.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM {schema}.tasks AS t
                   WHERE t.state = 'scheduled' AND t.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM {schema}.tasks AS t
                   WHERE t.state = 'failed' AND t.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM {schema}.tasks AS t
                   WHERE t.state = 'in_progress' AND t.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM (SELECT t.queue FROM {schema}.task_rows AS t
                                  WHERE t.state IN ('done', 'cancelled')
                                  ORDER BY t.finished_at DESC LIMIT %(recent)s) AS f
                   WHERE f.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM {schema}.task_routes AS r WHERE r.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM {schema}.workers AS w WHERE %(queue)s = ANY(w.queues))
       OR EXISTS (SELECT 1 FROM {schema}.queue_limits AS l WHERE l.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM {schema}.paused_queues AS p WHERE p.queue = %(queue)s)
       OR EXISTS (SELECT 1 FROM (SELECT a.filter FROM {schema}.actions AS a
                                  ORDER BY a.at DESC LIMIT %(recent)s) AS a
                   WHERE %(queue)s IN (a.filter ->> 'queue', a.filter -> 'filter' ->> 'queue'))
           AS known,
       ARRAY(SELECT queue FROM names ORDER BY queue LIMIT %(names)s) AS names;
