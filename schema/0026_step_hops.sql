-- 0026: a workflow's hop costs one claim, in one process.
--
-- settle_steps_ready, which the acknowledgement of a step with dependents runs, planned its
-- statements anew at each call (about 0.4 ms of a chain's hop of 2.5 ms); its plans are now made
-- once. And it woke every worker of the queues where steps became ready, the acknowledging one
-- included, although that worker claims them in the same transaction: each hop of a chain cost
-- an empty claim in every other worker process, and one more in its own. A caller that claims
-- next now names the queues it will read (`quiet`), and those are not woken; the worker wakes
-- them after its claim itself when the claim may have left a ready step behind (it came back
-- full, the queue was held by a limit, or no claim followed).
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

DROP FUNCTION {schema}.settle_steps_ready(bigint[]);

CREATE FUNCTION {schema}.settle_steps_ready(
    ids bigint[], quiet text[] DEFAULT '{}', OUT released integer, OUT ready_queues text[]
)
LANGUAGE plpgsql
-- Its statements' plans are made once: planned anew at each call (PostgreSQL's choice for
-- statements over arrays), they cost more than running them.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    parents  bigint[] := ids;
    n        integer;
    woken    text[] := '{}';
    earliest timestamptz;
    first_at timestamptz;
    queues   text[];
    kids     bigint[];
    counts   integer[];
    blockers bigint[];
    errors   text[];
BEGIN
    released := 0;
    WHILE cardinality(parents) > 0 LOOP
        -- The outcomes (and results) of the finished steps, onto their edges.
        -- A step is marked settled (dependents false) here, or already by the acknowledgement
        -- that ended it, in this same transaction (complete_with_result): one row version
        -- fewer per step. An edge settled before is not settled again (outcome IS NULL below).
        WITH marked AS (
            UPDATE {schema}.tasks AS t SET dependents = false
             WHERE t.id = ANY(parents) AND t.dependents
               AND t.state IN ('done', 'failed', 'cancelled')
            RETURNING t.id, t.state::text AS state, t.result, t.task
        ), p AS (
            SELECT * FROM marked
            UNION ALL
            SELECT t.id, t.state::text, t.result, t.task FROM {schema}.tasks AS t
             WHERE t.id = ANY(parents) AND NOT t.dependents
               AND t.state IN ('done', 'failed', 'cancelled')
        ), e AS (
            UPDATE {schema}.task_deps AS d
               SET outcome = p.state, result = CASE WHEN p.state = 'done' THEN p.result END
              FROM p
             WHERE d.depends_on = p.id AND d.outcome IS NULL
            RETURNING d.task_id, d.depends_on, d.run_on_failure, d.outcome, p.task
        ), c AS (
            SELECT e.task_id AS id, count(*)::integer AS n,
                   min(e.depends_on) FILTER (WHERE e.outcome <> 'done' AND NOT e.run_on_failure)
                       AS blocker
              FROM e GROUP BY e.task_id
        )
        SELECT coalesce(array_agg(c.id ORDER BY c.id), '{}'),
               coalesce(array_agg(c.n ORDER BY c.id), '{}'),
               coalesce(array_agg(c.blocker ORDER BY c.id), '{}'),
               coalesce(array_agg((SELECT format('DependencyFailed: step %s (%s) ended %s',
                                                 e.depends_on, left(e.task, 100), e.outcome)
                                     FROM e WHERE e.task_id = c.id AND e.depends_on = c.blocker)
                                  ORDER BY c.id), '{}')
          INTO kids, counts, blockers, errors
          FROM c;
        EXIT WHEN cardinality(kids) = 0;
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
    END LOOP;
    -- The caller claims in the quiet queues in this same transaction, and wakes them itself if
    -- its claim may have left a step behind (see engine.batch).
    PERFORM {schema}.wake_steps(ARRAY(SELECT w FROM unnest(woken) AS w WHERE w <> ALL(quiet)),
                                earliest);
    ready_queues := ARRAY(SELECT DISTINCT w FROM unnest(woken) AS w);
END;
$$;


CREATE OR REPLACE FUNCTION {schema}.settle_steps(ids bigint[]) RETURNS integer
LANGUAGE sql AS $$
    SELECT released FROM {schema}.settle_steps_ready(ids);
$$;
