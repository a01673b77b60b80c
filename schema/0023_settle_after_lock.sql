-- 0023: settle_steps reads a dependent's count and its inputs after it holds the dependent's lock.
--
-- In 0022 one statement decremented a join and gathered its inputs: when two acknowledgements
-- settled inputs of the same join at once, the second waited for the first's lock, and then
-- re-read the join's row but not the edges, which it still saw as they were when its statement
-- began: the first's results were missing from the join's inputs (None). Now the edges are
-- settled by one statement, the dependents locked by the next (in id order, as before), and
-- counted down and released by a third, whose snapshot, taken after the locks, holds every
-- settlement committed before them. The cost stays one update per dependent and batch.
--
-- {schema} stands for the configured schema name, quoted by the migrator; nothing else is
-- substituted.

CREATE OR REPLACE FUNCTION {schema}.settle_steps(ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    parents  bigint[] := ids;
    released integer := 0;
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
    WHILE cardinality(parents) > 0 LOOP
        -- The outcomes (and results) of the finished steps, onto their edges.
        WITH p AS (
            UPDATE {schema}.tasks AS t SET dependents = false
             WHERE t.id = ANY(parents) AND t.dependents
               AND t.state IN ('done', 'failed', 'cancelled')
            RETURNING t.id, t.state::text AS state, t.result, t.task
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
    PERFORM {schema}.wake_steps(woken, earliest);
    RETURN released;
END;
$$;
