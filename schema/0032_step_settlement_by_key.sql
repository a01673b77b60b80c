-- 0032: a step's acknowledgement settles its dependents in time that grows with their edges,
-- and reaches them by primary key in every plan.
--
-- step_edges (schema/0028) looked up each dependent's error message among all the edges it had
-- just settled, whether the dependent was blocked or not: the acknowledgement of one step with
-- 5,000 dependents took 2.6 s, and with 20,000 33 s, holding their rows locked. The count, the
-- first blocking dependency and its message now come from one pass over the edges.
--
-- settle_released (schema/0028) joined the dependents with the table by `t.id = c.id` alone,
-- with a generic plan (plan_cache_mode) made from the table's statistics of the moment: while
-- those said the table was nearly empty (a vacuum that found one live row in hundreds of pages,
-- say), the plan read the whole primary key index for the one join a fan-in releases, at every
-- acknowledgement: 30,000 entries per batch of 100 steps in a table of 30,000 rows, growing with
-- the table. The update now also names its rows with `t.id = ANY(kids)`, which the index answers
-- directly, and the function plans hash joins: a nested loop would test each dependent against
-- the whole array, and the source of a fan-out may have 100,000 dependents. step_edges names
-- its edges the same way, for the failures that settle_released passes down the graph.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE OR REPLACE FUNCTION {schema}.step_edges(
    ids bigint[], states text[], results jsonb[], tasks text[],
    OUT kids bigint[], OUT counts integer[], OUT blockers bigint[], OUT errors text[]
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    -- An edge settled before is not settled again (outcome IS NULL): a step given twice counts
    -- once.
    WITH p AS (
        SELECT * FROM unnest(ids, states, results, tasks) AS p(id, state, result, task)
    ), e AS (
        UPDATE {schema}.task_deps AS d
           SET outcome = p.state, result = CASE WHEN p.state = 'done' THEN p.result END
          FROM p
         WHERE d.depends_on = p.id AND d.outcome IS NULL
           AND d.depends_on = ANY(ids)  -- by key in every plan (see settle_released)
        RETURNING d.task_id, d.depends_on, d.run_on_failure, d.outcome, p.task
    ), c AS (
        -- Each dependent's count, its first blocking dependency and what to say about it, in
        -- one pass over the edges (a look-up of each dependent's error among all the edges made
        -- a fan-out from one step cost the square of its width).
        SELECT e.task_id AS id, count(*)::integer AS n,
               min(e.depends_on) FILTER (WHERE e.outcome <> 'done' AND NOT e.run_on_failure)
                   AS blocker,
               (array_agg(format('DependencyFailed: step %s (%s) ended %s',
                                 e.depends_on, left(e.task, 100), e.outcome)
                          ORDER BY e.depends_on)
                    FILTER (WHERE e.outcome <> 'done' AND NOT e.run_on_failure))[1] AS error
          FROM e GROUP BY e.task_id
    )
    SELECT coalesce(array_agg(c.id ORDER BY c.id), '{}'),
           coalesce(array_agg(c.n ORDER BY c.id), '{}'),
           coalesce(array_agg(c.blocker ORDER BY c.id), '{}'),
           coalesce(array_agg(c.error ORDER BY c.id), '{}')
      INTO kids, counts, blockers, errors
      FROM c;
END;
$$;

CREATE OR REPLACE FUNCTION {schema}.settle_released(
    kids bigint[], counts integer[], blockers bigint[], errors text[], quiet text[] DEFAULT '{}',
    OUT released integer, OUT ready_queues text[]
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
-- Hash joins, the dependents read by `= ANY(kids)`: a nested loop would test each of them
-- against the whole array, and a fan-out's source may have 100,000 dependents.
SET enable_nestloop = off
AS $$
DECLARE
    n        integer;
    woken    text[] := '{}';
    earliest timestamptz;
    first_at timestamptz;
    queues   text[];
    parents  bigint[];
    pstates  text[];
    presults jsonb[];
    ptasks   text[];
BEGIN
    released := 0;
    WHILE cardinality(kids) > 0 LOOP
        -- In id order: the acknowledgements of other workers settle the same joins.
        PERFORM 1 FROM {schema}.tasks AS t WHERE t.id = ANY(kids) ORDER BY t.id FOR UPDATE;
        -- A statement of its own, so that it sees what was committed before the locks.
        WITH c AS (
            SELECT * FROM unnest(kids, counts, blockers, errors) AS c(id, n, blocker, error)
        ), moved AS (
            UPDATE {schema}.tasks AS t
               SET pending_deps = t.pending_deps - c.n,
                   state = CASE WHEN c.blocker IS NOT NULL THEN 'cancelled'::{schema}.task_state
                                WHEN t.pending_deps - c.n > 0 THEN 'waiting'
                                WHEN t.run_at > now() THEN 'scheduled'
                                ELSE 'queued' END,
                   run_at = CASE WHEN c.blocker IS NULL AND t.pending_deps - c.n <= 0
                                 THEN greatest(t.run_at, now()) ELSE t.run_at END,
                   finished_at = CASE WHEN c.blocker IS NOT NULL THEN now() END,
                   cancelled_by = CASE WHEN c.blocker IS NOT NULL THEN 'workflow'
                                       ELSE t.cancelled_by END,
                   last_error = CASE WHEN c.blocker IS NOT NULL THEN c.error
                                     ELSE t.last_error END,
                   inputs = CASE WHEN c.blocker IS NULL AND t.pending_deps - c.n <= 0 THEN (
                       SELECT jsonb_agg(d.result ORDER BY d.position, d.depends_on)
                         FROM {schema}.task_deps AS d WHERE d.task_id = t.id) END
              FROM c
             WHERE t.id = c.id AND t.state = 'waiting'
               AND t.id = ANY(kids)  -- by primary key in every plan
            RETURNING t.id, t.state, t.queue, t.run_at, t.dependents
        )
        SELECT coalesce(array_agg(m.id) FILTER (WHERE m.state = 'cancelled' AND m.dependents), '{}'),
               count(*) FILTER (WHERE m.state = 'queued')::integer,
               coalesce(array_agg(m.queue) FILTER (WHERE m.state = 'queued'), '{}'),
               min(m.run_at) FILTER (WHERE m.state = 'queued')
          INTO parents, n, queues, first_at
          FROM moved AS m;
        released := released + n;
        woken := woken || queues;
        earliest := least(earliest, first_at);
        EXIT WHEN cardinality(parents) = 0;
        -- The steps a failure cancelled here, which others wait for in turn: settled now, their
        -- dependents next.
        WITH marked AS (
            UPDATE {schema}.tasks AS t SET dependents = false
             WHERE t.id = ANY(parents) AND t.dependents
            RETURNING t.id, t.state::text AS state, t.result, t.task
        )
        SELECT array_agg(m.id), array_agg(m.state), array_agg(m.result), array_agg(m.task)
          INTO parents, pstates, presults, ptasks
          FROM marked AS m;
        SELECT s.kids, s.counts, s.blockers, s.errors INTO kids, counts, blockers, errors
          FROM {schema}.step_edges(parents, pstates, presults, ptasks) AS s;
    END LOOP;
    -- The caller claims in the quiet queues in this same transaction, and wakes them itself if
    -- its claim may have left a step behind (see engine.batch).
    PERFORM {schema}.wake_steps(ARRAY(SELECT w FROM unnest(woken) AS w WHERE w <> ALL(quiet)),
                                earliest);
    ready_queues := ARRAY(SELECT DISTINCT w FROM unnest(woken) AS w);
END;
$$;
