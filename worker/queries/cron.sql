-- Cron: every worker process that declares a schedule offers its due slots; the unique index
-- tasks_cron_slot_idx on (cron_key, cron_at) lets exactly one insert per slot win, with no leader
-- and no error for the losers. The run is then an ordinary task (retries, leases, metrics).

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

-- name: cron_enqueue
-- One statement per tick for all offered slots of all schedules. A slot is inserted only when the
-- database clock says it is due (a process whose clock runs ahead offers it again next tick), only
-- while it is younger than the retention of finished cron rows (horizon_seconds), and never at or
-- before the schedule's recorded last_slot: the row of such a slot may already have been purged,
-- and inserting it again would run it twice. (Every slot up to last_slot was enqueued or skipped
-- on purpose: whoever won last_slot had offered the slots before it first.) Losers of the race
-- get nothing back. The winner of each schedule's latest slot records it in cron_schedules, so
-- that row is written once per slot, not once per process and tick.
WITH offered AS (
    SELECT o.*
      FROM unnest(%(keys)s::text[], %(slots)s::timestamptz[], %(next_slots)s::timestamptz[],
                  %(tasks)s::text[], %(queues)s::text[], %(payloads)s::jsonb[],
                  %(priorities)s::integer[], %(max_attempts)s::integer[])
           AS o(key, slot, next_slot, task, queue, payload, priority, max_attempts)
     WHERE o.slot <= now()
       AND o.slot > now() - make_interval(secs => %(horizon_seconds)s::float8)
       AND o.slot > coalesce((SELECT s.last_slot FROM {schema}.cron_schedules AS s
                               WHERE s.key = o.key), '-infinity')
),
won AS (
    INSERT INTO {schema}.tasks (task, payload, queue, priority, max_attempts, run_at,
                                cron_key, cron_at)
    SELECT o.task, o.payload, o.queue, o.priority, o.max_attempts, o.slot, o.key, o.slot
      FROM offered AS o
    ON CONFLICT (cron_key, cron_at) WHERE cron_key IS NOT NULL DO NOTHING
    RETURNING cron_key, cron_at
),
per_key AS (
    SELECT w.cron_key AS key, count(*) AS n, max(w.cron_at) AS last_slot
      FROM won AS w
     GROUP BY w.cron_key
),
noted AS (
    UPDATE {schema}.cron_schedules AS s
       SET last_slot = p.last_slot,
           next_slot = (SELECT o.next_slot FROM offered AS o
                         WHERE o.key = p.key AND o.slot = p.last_slot LIMIT 1),
           updated_at = now()
      FROM per_key AS p
     WHERE s.key = p.key
       AND (s.last_slot IS NULL OR s.last_slot < p.last_slot)
)
SELECT now() AS db_now,
       coalesce((SELECT jsonb_object_agg(p.key, p.n) FROM per_key AS p), '{}'::jsonb) AS won;

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
