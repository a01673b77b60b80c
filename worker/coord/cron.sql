-- Cron schedules kept in the database (schema/0002).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

-- name: cron_register
-- Once per process start: record the declared schedules (the last process to start wins the
-- definition) and read where the fleet stopped, so that slots missed while every process was down
-- can be caught up or skipped. The database clock comes back too.
INSERT INTO {schema}.cron_schedules AS s (key, expr, tz, task, queue, catch_up, next_slot)
SELECT d.key, d.expr, d.tz, d.task, d.queue, d.catch_up, d.next_slot
  FROM unnest(%(keys)s::text[], %(exprs)s::text[], %(tzs)s::text[], %(tasks)s::text[],
              %(queues)s::text[], %(catch_ups)s::text[], %(next_slots)s::timestamptz[])
       AS d(key, expr, tz, task, queue, catch_up, next_slot)
ON CONFLICT (key) DO UPDATE
   SET expr = excluded.expr,
       tz = excluded.tz,
       task = excluded.task,
       queue = excluded.queue,
       catch_up = excluded.catch_up,
       next_slot = CASE WHEN s.last_slot IS NULL OR excluded.next_slot > s.last_slot
                        THEN excluded.next_slot ELSE s.next_slot END,
       declared_at = now(),
       updated_at = now()
RETURNING s.key, s.last_slot, now() AS db_now;

-- name: cron_list
-- What the database knows about schedules, with the latest run of each (its slot and state) read
-- from the cron slot index.
SELECT s.key, s.expr, s.tz, s.task, s.queue, s.catch_up, s.last_slot, s.next_slot,
       s.declared_at, s.updated_at,
       r.cron_at AS last_run_slot, r.state::text AS last_run_state, r.id AS last_run_id
  FROM {schema}.cron_schedules AS s
  LEFT JOIN LATERAL (
      SELECT t.cron_at, t.state, t.id
        FROM {schema}.tasks AS t
       WHERE t.cron_key = s.key
       ORDER BY t.cron_at DESC
       LIMIT 1
  ) AS r ON true
 ORDER BY s.key;

-- name: cron_last_runs
-- The latest run of schedules that may not be in cron_schedules yet (declared in a module given to
-- `worker cron` but never run by a worker).
SELECT k.key, r.cron_at AS last_run_slot, r.state::text AS last_run_state, r.id AS last_run_id
  FROM unnest(%(keys)s::text[]) AS k(key)
  LEFT JOIN LATERAL (
      SELECT t.cron_at, t.state, t.id
        FROM {schema}.tasks AS t
       WHERE t.cron_key = k.key
       ORDER BY t.cron_at DESC
       LIMIT 1
  ) AS r ON true;
