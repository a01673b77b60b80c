-- 0031: the maintenance sweep of workflow steps reaches its rows by primary key in every plan.
--
-- settle_missed (schema/0022) runs after each rescue pass, on every worker. Its update of the
-- waiting steps it frees joined them with the table by `t.id = c.id` alone; a plan made while
-- the table was small or never analysed (autovacuum off, or before its first visit) read the
-- whole primary key index for it, whether there was a step to free or not: under a long
-- transaction elsewhere that index holds an entry for every task finished since, and the sweep
-- took 1.7 s every few seconds. The update now also names its rows with `t.id = ANY(...)`,
-- which the index answers directly.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE OR REPLACE FUNCTION {schema}.settle_missed(batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n        integer;
    freed    integer;
    queues   text[];
    earliest timestamptz;
BEGIN
    n := {schema}.settle_steps(ARRAY(
        SELECT t.id FROM {schema}.tasks AS t
         WHERE t.dependents AND t.state IN ('done', 'failed', 'cancelled')
         ORDER BY t.id LIMIT batch
           FOR UPDATE SKIP LOCKED));
    WITH free AS (
        SELECT t.id FROM {schema}.tasks AS t
         WHERE t.state = 'waiting' AND coalesce(t.pending_deps, 0) <= 0
         ORDER BY t.id LIMIT batch
           FOR UPDATE SKIP LOCKED
    ), counted AS (
        SELECT f.id, (SELECT count(*) FROM {schema}.task_deps AS d
                       WHERE d.task_id = f.id AND d.outcome IS NULL)::integer AS pending
          FROM free AS f
    ), moved AS (
        UPDATE {schema}.tasks AS t
           SET pending_deps = c.pending,
               state = CASE WHEN c.pending > 0 THEN 'waiting'::{schema}.task_state
                            WHEN t.run_at > now() THEN 'scheduled' ELSE 'queued' END,
               run_at = CASE WHEN c.pending > 0 THEN t.run_at ELSE greatest(t.run_at, now()) END,
               inputs = CASE WHEN c.pending = 0 THEN (
                   SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                     FROM {schema}.task_deps AS d WHERE d.task_id = t.id) END
          FROM counted AS c
         WHERE t.id = c.id
           -- The rows by primary key, whatever the planner believes the table holds.
           AND t.id = ANY(ARRAY(SELECT f.id FROM free AS f))
        RETURNING t.state, t.queue, t.run_at
    )
    SELECT count(*) FILTER (WHERE m.state = 'queued')::integer,
           coalesce(array_agg(m.queue) FILTER (WHERE m.state = 'queued'), '{}'),
           min(m.run_at) FILTER (WHERE m.state = 'queued')
      INTO freed, queues, earliest
      FROM moved AS m;
    PERFORM {schema}.wake_steps(queues, earliest);
    RETURN n + freed;
END;
$$;
