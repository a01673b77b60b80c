-- 0034: the plans of two workflow functions hold for wide graphs whoever calls them first.
--
-- step_edges (schema/0032) names its edges with `d.depends_on = ANY(ids)`. Its generic plan is
-- made once per session, at its first call, and a first call made with nested loops allowed
-- (an acknowledgement's, before any cascade) could take the edges by that condition and test
-- each against every settled step: a failure cascading through 5,000 dependents took 12 to 15 s
-- instead of 0.5. The function now plans hash joins itself, whoever calls it.
--
-- task_deps_added (schema/0033) settled the new edges of dependencies that finished already by
-- reading every edge of the steps the statement touched, so a producer adding a join's edges
-- one statement at a time (create_workflow, plain INSERTs) read all the join's edges again each
-- time. It now reads only the edges of finished dependencies, and nothing when none finished.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

ALTER FUNCTION {schema}.step_edges(bigint[], text[], jsonb[], text[]) SET enable_nestloop = off;

CREATE OR REPLACE FUNCTION {schema}.task_deps_added() RETURNS trigger
LANGUAGE plpgsql
-- Hash joins over the steps read by `= ANY`: a nested loop would test each edge's step against
-- the whole array, which grows with the workflow (100,000 steps and more).
SET enable_nestloop = off
AS $$
DECLARE
    bad      record;
    doomed   bigint[];
    freed    integer;
    -- The steps and the dependencies of these edges: every look-up below names its rows with
    -- these (`= ANY`), so that it reads them by primary key whatever the planner believes the
    -- table holds, instead of joining the edges with the whole table.
    kids     bigint[] := ARRAY(SELECT DISTINCT a.task_id FROM added AS a);
    parents  bigint[] := ARRAY(SELECT DISTINCT a.depends_on FROM added AS a);
    finished bigint[];
BEGIN
    SELECT a.task_id INTO bad FROM added AS a WHERE a.task_id = a.depends_on LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow step % cannot depend on itself', bad.task_id
            USING ERRCODE = 'check_violation';
    END IF;
    SELECT a.task_id, a.depends_on, c.id IS NULL AS no_step INTO bad
      FROM added AS a
      LEFT JOIN {schema}.tasks AS c ON c.id = a.task_id AND c.id = ANY(kids)
      LEFT JOIN {schema}.tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
     WHERE c.id IS NULL OR p.id IS NULL
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow edge % -> %: task % does not exist', bad.task_id, bad.depends_on,
            CASE WHEN bad.no_step THEN bad.task_id ELSE bad.depends_on END
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    SELECT a.task_id, a.depends_on, c.workflow_id AS c_wf, p.workflow_id AS p_wf INTO bad
      FROM added AS a
      JOIN {schema}.tasks AS c ON c.id = a.task_id AND c.id = ANY(kids)
      JOIN {schema}.tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
     WHERE c.workflow_id IS NULL OR p.workflow_id IS DISTINCT FROM c.workflow_id
     LIMIT 1;
    IF FOUND THEN
        IF bad.c_wf IS NULL THEN
            RAISE EXCEPTION 'workflow edge % -> %: task % is not a workflow step (its workflow_id is NULL)',
                bad.task_id, bad.depends_on, bad.task_id USING ERRCODE = 'check_violation';
        END IF;
        RAISE EXCEPTION 'workflow edge % -> %: step % of workflow % cannot depend on task % of %',
            bad.task_id, bad.depends_on, bad.task_id, bad.c_wf, bad.depends_on,
            coalesce('workflow ' || bad.p_wf, 'no workflow') USING ERRCODE = 'check_violation';
    END IF;
    SELECT a.task_id, a.depends_on INTO bad FROM added AS a WHERE a.depends_on > a.task_id LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow edge % -> %: a step depends only on steps inserted before it (a lower id), which keeps a workflow free of cycles',
            bad.task_id, bad.depends_on USING ERRCODE = 'check_violation';
    END IF;
    -- Dependencies first, then the steps that wait, each in id order (as settle_steps locks).
    PERFORM 1 FROM {schema}.tasks AS t
     WHERE t.id = ANY(parents) ORDER BY t.id FOR UPDATE;
    PERFORM 1 FROM {schema}.tasks AS t
     WHERE t.id = ANY(kids) ORDER BY t.id FOR UPDATE;
    SELECT a.task_id, a.depends_on, c.state, c.dedupe_key IS NOT NULL AS keyed INTO bad
      FROM added AS a JOIN {schema}.tasks AS c ON c.id = a.task_id AND c.id = ANY(kids)
     WHERE c.state NOT IN ('waiting', 'scheduled', 'queued') OR c.dedupe_key IS NOT NULL
     LIMIT 1;
    IF FOUND THEN
        IF bad.keyed THEN
            RAISE EXCEPTION 'workflow edge % -> %: step % has a dedupe key, which a step that waits for others cannot hold',
                bad.task_id, bad.depends_on, bad.task_id USING ERRCODE = 'check_violation';
        END IF;
        RAISE EXCEPTION 'workflow edge % -> %: step % is % already; add a step''s dependencies before it can run',
            bad.task_id, bad.depends_on, bad.task_id, bad.state USING ERRCODE = 'check_violation';
    END IF;
    SELECT a.task_id, a.depends_on INTO bad
      FROM added AS a JOIN {schema}.tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
     WHERE p.state = 'in_progress' AND p.dependents IS NOT TRUE
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'workflow edge % -> %: step % is running, and was claimed without dependents; add dependencies on a step before it starts',
            bad.task_id, bad.depends_on, bad.depends_on USING ERRCODE = 'check_violation';
    END IF;
    -- Dependencies that finished already: settled now. Their edges are read by dependency, so
    -- that a producer adding a join's edges one statement at a time reads only the new ones.
    finished := ARRAY(SELECT p.id FROM {schema}.tasks AS p
                       WHERE p.id = ANY(parents) AND p.state IN ('done', 'failed', 'cancelled'));
    IF cardinality(finished) > 0 THEN
        UPDATE {schema}.task_deps AS d
           SET outcome = p.state::text, result = CASE WHEN p.state = 'done' THEN p.result END
          FROM added AS a JOIN {schema}.tasks AS p ON p.id = a.depends_on AND p.id = ANY(finished)
         WHERE d.task_id = a.task_id AND d.depends_on = a.depends_on AND d.outcome IS NULL
           AND d.depends_on = ANY(finished);
    END IF;
    UPDATE {schema}.tasks AS t SET dependents = true
     WHERE t.id = ANY(parents)
       AND t.state NOT IN ('done', 'failed', 'cancelled') AND t.dependents IS NOT TRUE;
    WITH c AS (
        SELECT a.task_id AS id,
               count(*) FILTER (WHERE p.state NOT IN ('done', 'failed', 'cancelled'))::integer AS n,
               min(a.depends_on) FILTER (WHERE p.state IN ('failed', 'cancelled')
                                           AND NOT a.run_on_failure) AS blocker
          FROM added AS a JOIN {schema}.tasks AS p ON p.id = a.depends_on AND p.id = ANY(parents)
         GROUP BY a.task_id
    ), moved AS (
        UPDATE {schema}.tasks AS t
           SET pending_deps = coalesce(t.pending_deps, 0) + c.n,
               state = CASE WHEN c.blocker IS NOT NULL THEN 'cancelled'::{schema}.task_state
                            WHEN coalesce(t.pending_deps, 0) + c.n > 0 THEN 'waiting'
                            WHEN t.state <> 'waiting' THEN t.state
                            WHEN t.run_at > now() THEN 'scheduled'
                            ELSE 'queued' END,
               finished_at = CASE WHEN c.blocker IS NOT NULL THEN now() ELSE t.finished_at END,
               cancelled_by = CASE WHEN c.blocker IS NOT NULL THEN 'workflow'
                                   ELSE t.cancelled_by END,
               last_error = CASE WHEN c.blocker IS NOT NULL
                                 THEN format('DependencyFailed: step %s ended before it was added',
                                             c.blocker)
                                 ELSE t.last_error END,
               inputs = CASE WHEN c.blocker IS NULL AND coalesce(t.pending_deps, 0) + c.n = 0 THEN (
                   SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                     FROM {schema}.task_deps AS d WHERE d.task_id = t.id) END
          FROM c
         WHERE t.id = c.id AND t.id = ANY(kids)
        RETURNING t.id, t.state, t.dependents
    )
    SELECT coalesce(array_agg(m.id) FILTER (WHERE m.state = 'cancelled' AND m.dependents), '{}'),
           count(*) FILTER (WHERE m.state = 'queued')::integer
      INTO doomed, freed
      FROM moved AS m;
    IF cardinality(doomed) > 0 THEN
        PERFORM {schema}.settle_steps(doomed);
    END IF;
    IF freed > 0 THEN
        PERFORM pg_notify(array_to_string(parse_ident('{schema}.tasks'), '.'), '');
    END IF;
    RETURN NULL;
END;
$$;
