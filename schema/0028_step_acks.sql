-- 0028: a workflow step's acknowledgement settles its dependents in the same statement.
--
-- The acknowledgement of steps that others wait for took three statements: complete_with_result,
-- then settle_steps_ready, which read the rows just acknowledged once more (a look-up of each by
-- primary key) to learn their outcomes and results, and a notification. The statement that
-- acknowledges them now hands what it wrote to the settlement directly (complete_steps, in the
-- worker's store), and the settlement is split in two functions it calls:
--
--   * step_edges: the outcomes (and results) of finished steps, given as arrays, onto their edges;
--     what each dependent learned (how many of its edges finished, the first that blocks it);
--   * settle_released: those counts onto the dependents, under their row locks, releasing the
--     ones with nothing left to wait for and cancelling those a failure blocks, then the same
--     for the dependents of the cancelled ones, down the graph.
--
-- settle_steps_ready (what a rescue, a cancel or maintenance settles with) reads the steps' rows
-- and calls the same two, so there is one copy of each statement.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE FUNCTION {schema}.step_edges(
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
END;
$$;

CREATE FUNCTION {schema}.settle_released(
    kids bigint[], counts integer[], blockers bigint[], errors text[], quiet text[] DEFAULT '{}',
    OUT released integer, OUT ready_queues text[]
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
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

-- Settle the dependents of finished steps among `ids` (done, failed or cancelled, with
-- dependents), read from their rows: a step is marked settled (dependents false) here, or
-- already by the acknowledgement that ended it, in this same transaction.
CREATE OR REPLACE FUNCTION {schema}.settle_steps_ready(
    ids bigint[], quiet text[] DEFAULT '{}', OUT released integer, OUT ready_queues text[]
)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    pids     bigint[];
    pstates  text[];
    presults jsonb[];
    ptasks   text[];
    e        record;
BEGIN
    WITH marked AS (
        UPDATE {schema}.tasks AS t SET dependents = false
         WHERE t.id = ANY(ids) AND t.dependents
           AND t.state IN ('done', 'failed', 'cancelled')
        RETURNING t.id, t.state::text AS state, t.result, t.task
    ), p AS (
        SELECT * FROM marked
        UNION ALL
        SELECT t.id, t.state::text, t.result, t.task FROM {schema}.tasks AS t
         WHERE t.id = ANY(ids) AND NOT t.dependents
           AND t.state IN ('done', 'failed', 'cancelled')
    )
    SELECT array_agg(p.id), array_agg(p.state), array_agg(p.result), array_agg(p.task)
      INTO pids, pstates, presults, ptasks
      FROM p;
    SELECT * INTO e FROM {schema}.step_edges(pids, pstates, presults, ptasks);
    SELECT s.released, s.ready_queues INTO released, ready_queues
      FROM {schema}.settle_released(e.kids, e.counts, e.blockers, e.errors, quiet) AS s;
END;
$$;
