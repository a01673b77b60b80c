-- Enqueue: every statement that inserts a task row (one, by COPY, a cron slot).
-- Each block starts with `-- name: NAME`; {schema} is the quoted schema name; values are bound.

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

-- name: enqueue
-- One task through the SQL function, so Python and SQL producers share the dedupe logic.
-- A delay counts from the database's clock (now()), never the producer's.
SELECT {schema}.enqueue(
    task => %(task)s, payload => %(payload)s, queue => %(queue)s,
    run_at => coalesce(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
    priority => %(priority)s, max_attempts => %(max_attempts)s, dedupe_key => %(dedupe_key)s,
    trace_context => %(trace_context)s
) AS id;

-- name: enqueue_keyed
-- The same, for a task with a key for per-key limits (schema/0014): written with the row.
SELECT {schema}.enqueue_keyed(
    task => %(task)s, payload => %(payload)s, queue => %(queue)s,
    run_at => coalesce(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
    priority => %(priority)s, max_attempts => %(max_attempts)s, dedupe_key => %(dedupe_key)s,
    trace_context => %(trace_context)s, limit_key => %(limit_key)s
) AS id;

-- name: enqueue_copy
-- Bulk enqueue: COPY skips per-row parsing and planning; the statement trigger sends one NOTIFY.
-- run_at is left to its default, the database's now(). A NULL queue is routed (schema/0006).
COPY {schema}.tasks (task, payload, queue, priority, max_attempts) FROM STDIN;

-- name: enqueue_copy_at
-- The same, for rows that run at a given time (a delay was added to delayed_until first).
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, run_at) FROM STDIN;

-- name: enqueue_copy_traced
-- enqueue_copy with the producer's trace context (schema/0013), when tracing is on.
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, trace_context) FROM STDIN;

-- name: enqueue_copy_at_traced
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, run_at, trace_context)
FROM STDIN;

-- name: enqueue_copy_keyed
-- Bulk enqueue of a task that declares a key for per-key limits (schema/0014); the trace context
-- (schema/0013) is NULL when tracing is off.
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, trace_context, limit_key)
FROM STDIN;

-- name: enqueue_copy_at_keyed
COPY {schema}.tasks (task, payload, queue, priority, max_attempts, run_at, trace_context,
                     limit_key)
FROM STDIN;

-- name: delayed_until
-- A delay counts from the database's clock, not the producer's.
SELECT now() + make_interval(secs => %(delay)s) AS run_at;

-- name: workflow_create
-- A workflow's row (schema/0022); its steps follow in the same transaction.
INSERT INTO {schema}.workflows (name) VALUES (%(name)s) RETURNING id;

-- name: workflow_ids
-- Ids for a workflow's steps, taken from the tasks' own sequence before they are copied in, so
-- that the edges can name them; ascending, and given to the steps in dependency order, so every
-- dependency has a lower id than its dependents (schema/0022 requires it).
SELECT nextval(pg_get_serial_sequence('{schema}.tasks', 'id')) AS id
  FROM generate_series(1, %(n)s) ORDER BY 1;

-- name: workflow_copy_steps
-- A workflow's steps: waiting when they have dependencies (their count is made by the edges'
-- trigger), queued otherwise. A NULL queue is routed (schema/0006); run_at is the database's now().
-- Every step carries the trace context of the enqueue that wrote them (NULL when untraced), so
-- a traced workflow's steps share one trace. A step that others wait for is marked so here
-- (dependents), as the edges' trigger would mark it: written once, not in a second row version
-- that the claims of a large fan-out would then step over in their index.
COPY {schema}.tasks (id, task, payload, queue, priority, max_attempts, limit_key, workflow_id,
                     state, trace_context, dependents)
FROM STDIN;

-- name: workflow_copy_edges
-- Its edges, checked and counted by their trigger (schema/0022, task_deps_added), one statement.
COPY {schema}.task_deps (task_id, depends_on, run_on_failure, position) FROM STDIN;
